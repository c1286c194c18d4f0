"""Tokenizing and packing documents into fixed-length samples, split across dp ranks."""

import itertools
import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.errors import AssetError
from torchtitan.datasets.registry import resolve_dataset

logger = logging.getLogger(__name__)


class HuggingFaceDataset(IterableDataset, Stateful):
    """Packed ``(input_ids, labels)`` samples of length ``seq_len`` for one data-parallel rank.

    Documents are tokenized with BOS and EOS and appended to a token buffer; every
    ``seq_len + 1`` buffered tokens ``w`` become one window ``(w[:-1], w[1:])``, without
    padding or overlap.  All ranks read the same window stream and cut it into global
    batches of ``local_batch_size × dp_world_size`` windows; rank r takes the r-th slice
    of each.  So the global batch at every step is the same whatever the data-parallel
    degree — 4 ranks see exactly what 1 rank with a 4× local batch sees, which is what
    makes losses comparable across meshes and the data position reshardable.  The price:
    every rank tokenizes the whole stream (cheap next to a training step at the batch
    sizes here; a per-document split would scale better and lose both properties).

    With ``infinite=True`` the data is re-read from the start whenever it runs out;
    otherwise iteration ends before an incomplete global batch.  Between global batches
    ``state_dict()`` (document position and leftover token buffer) is identical on every
    rank, and a dataset restored with ``load_state_dict()`` yields exactly the samples
    the original would have yielded next — under any dp degree.
    """

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
        local_batch_size: int = 1,
    ):
        path, config = resolve_dataset(dataset_name, dataset_path)
        logger.info("Preparing dataset %s from %s", dataset_name, path)
        data = config.loader(path)
        self.dataset_name = dataset_name
        self._path = path
        self.seq_len = seq_len
        self.infinite = infinite
        self._data = data
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._local_batch_size = local_batch_size
        # map-style (a `datasets.Dataset`, local documents): a length and rows by position;
        # else an iterable one (a streamed hub dataset) with its own epoch and state
        self._map_style = isinstance(self._data, Sized)
        self._text_processor = config.text_processor
        self._tokenizer = tokenizer

        self._epoch = 0
        self.reloops = 0  # re-loops in this process (not checkpointed; for logging)
        self._sample_idx = 0  # documents of this epoch already tokenized (map-style only)
        self._token_buffer: list[int] = []

    def _documents(self) -> Iterator[dict[str, Any]]:
        """The remaining documents of the current epoch."""
        if self._map_style:
            for i in range(self._sample_idx, len(self._data)):
                yield self._data[i]
        else:
            self._data.set_epoch(self._epoch)
            yield from self._data

    def _drain(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every full window in the token buffer, oldest first."""
        window = self.seq_len + 1
        while len(self._token_buffer) >= window:
            x = torch.tensor(self._token_buffer[:window], dtype=torch.long)
            self._token_buffer = self._token_buffer[window:]
            yield x[:-1], x[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        global_batch = self._local_batch_size * self._dp_world_size
        start = self._dp_rank * self._local_batch_size
        windows = self._windows()
        while True:
            # Read the whole global batch before yielding this rank's share, so that when
            # the share is consumed the stream position is the same on every rank.
            batch = list(itertools.islice(windows, global_batch))
            if len(batch) < global_batch:
                return
            yield from batch[start : start + self._local_batch_size]

    def _windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The global stream of packed windows, continuing from the current position."""
        first_pass = True
        while True:
            yield from self._drain()  # a restored buffer may already hold full windows
            documents_read = tokens_read = 0
            for sample in self._documents():
                tokens = self._tokenizer.encode(self._text_processor(sample))
                self._token_buffer.extend(tokens)
                self._sample_idx += 1
                documents_read += 1
                tokens_read += len(tokens)
                yield from self._drain()
            if not self.infinite:
                logger.info("Dataset %s is exhausted", self.dataset_name)
                return
            if documents_read == 0 and not first_pass:
                raise AssetError(
                    f"dataset '{self.dataset_name}' ({self._path}) has no documents; point "
                    "--training.dataset or --training.dataset_path at data with text"
                )
            first_pass = False
            self._epoch += 1
            self._sample_idx = 0
            self._log_reloop(tokens_read)

    def _log_reloop(self, tokens_read: int) -> None:
        """A warning at the first re-loop, naming the data and saying when one pass over it
        is less than one global batch (every batch then repeats it); later re-loops go to
        debug level, with their count."""
        self.reloops += 1
        if self.reloops == 1:
            batch_tokens = self._local_batch_size * self._dp_world_size * (self.seq_len + 1)
            if tokens_read and tokens_read < batch_tokens:
                logger.warning(
                    "Dataset %s (%s) holds %d tokens, less than one global batch (%d tokens): "
                    "every batch trains on repeats of it; use more data or a smaller "
                    "--training.local_batch_size or --training.seq_len",
                    self.dataset_name,
                    self._path,
                    tokens_read,
                    batch_tokens,
                )
                return
            logger.warning(
                "Dataset %s (%s) is being re-looped after %d tokens (later re-loops are "
                "logged at debug level)",
                self.dataset_name,
                self._path,
                tokens_read,
            )
        else:
            logger.debug("Dataset %s re-looped %d times", self.dataset_name, self.reloops)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self._epoch, "token_buffer": list(self._token_buffer)}
        if self._map_style:
            state["sample_idx"] = self._sample_idx
        else:
            state["data"] = self._data.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = state_dict["epoch"]
        self._token_buffer = list(state_dict["token_buffer"])
        if self._map_style:
            self._sample_idx = state_dict["sample_idx"]
        else:
            self._data.set_epoch(self._epoch)
            self._data.load_state_dict(state_dict["data"])
