"""Text datasets for pre-training: loading, tokenizing, packing and per-rank splitting.

Named datasets live in ``DATASETS``. ``titan_corpus`` (the default) ships with the repo
in ``tests/assets/titan_corpus`` and needs no network; ``c4`` and ``c4_validation``
stream from the Hugging Face Hub and fail with an ``AssetError`` when it is unreachable.

``training.dataset_path`` replaces the dataset's location with a local file or folder
(the registered name then only labels the run). Supported files, chosen by suffix:

* ``.jsonl`` / ``.json``: one JSON object per line, or a JSON list of objects; the
  document is the ``"text"`` field.
* ``.parquet``: the ``text`` column, one document per row.
* ``.txt``: one document per paragraph; paragraphs are separated by blank lines.

A folder means every such file below it (hidden ones excluded), in sorted path order.
"""

import itertools
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.components.errors import AssetError
from torchtitan.errors import UserInputError

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def _resolve_local(path: str) -> Path:
    """``path`` if it exists; a relative path is tried from the cwd, then from the repo root."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [given, _REPO_ROOT / given]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise AssetError(
        f"dataset path '{path}' does not exist (resolved to {given.resolve()}): set "
        "--training.dataset_path to a local .jsonl/.json/.parquet/.txt file or a folder of them"
    )


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        files = [root] if root.suffix in _LOCAL_SUFFIXES else []
    else:
        files = sorted(
            (
                p
                for p in root.rglob("*")
                if p.is_file()
                and p.suffix in _LOCAL_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(root).parts)
            ),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    if not files:
        raise AssetError(f"dataset path '{root}' holds no {'/'.join(_LOCAL_SUFFIXES)} files")
    return files


def _read_json_texts(file: Path) -> list[str]:
    content = file.read_text(encoding="utf-8")
    if file.suffix == ".json" and content.lstrip().startswith("["):
        records = json.loads(content)
    else:
        records = [json.loads(line) for line in content.splitlines() if line.strip()]
    try:
        return [record["text"] for record in records]
    except (KeyError, TypeError) as e:
        raise AssetError(f"{file}: every record needs a \"text\" field") from e


def _read_parquet_texts(file: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file, columns=["text"]).column("text").to_pylist()
    except KeyError as e:
        raise AssetError(f"{file}: the parquet file needs a \"text\" column") from e


def _read_txt_texts(file: Path) -> list[str]:
    paragraphs = re.split(r"\n[ \t]*\n", file.read_text(encoding="utf-8"))
    return [p.strip() for p in paragraphs if p.strip()]


_READERS = {
    ".jsonl": _read_json_texts,
    ".json": _read_json_texts,
    ".parquet": _read_parquet_texts,
    ".txt": _read_txt_texts,
}


def load_local_dataset(path: str):
    """A map-style ``datasets.Dataset`` with one ``text`` row per document found at ``path``.

    Files are read directly (no ``load_dataset``), so nothing is cached or downloaded.
    """
    import datasets

    texts: list[str] = []
    for file in _local_files(_resolve_local(path)):
        texts.extend(_READERS[file.suffix](file))
    return datasets.Dataset.from_dict({"text": texts})


def _hub_offline() -> bool:
    import datasets

    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags) or bool(datasets.config.HF_HUB_OFFLINE)


def load_hub_dataset(path: str, *, name: str | None, split: str):
    """A streaming dataset from the Hub; any failure becomes a one-line ``AssetError``."""
    import datasets

    def no_hub(reason: str) -> AssetError:
        reason = " ".join(reason.split())[:300]
        return AssetError(
            f"cannot load '{path}' from the Hugging Face Hub ({reason}); no hub access: use "
            "--training.dataset titan_corpus (ships with the repo) or --training.dataset_path "
            "<local .jsonl/.json/.parquet/.txt file or folder>"
        )

    if _hub_offline():
        raise no_hub("offline mode is set by HF_HUB_OFFLINE/HF_DATASETS_OFFLINE")
    try:
        return datasets.load_dataset(path, name=name, split=split, streaming=True)
    except Exception as e:  # connection, auth, missing repo: all mean "not usable here"
        raise no_hub(f"{type(e).__name__}: {e}") from e


def _text_field(sample: dict[str, Any]) -> str:
    return sample["text"]


@dataclass(frozen=True)
class DatasetConfig:
    """Where a named dataset lives, how to load it, and how to get a document's text."""

    path: str
    loader: Callable[[str], Any]
    text_processor: Callable[[dict[str, Any]], str] = _text_field


DATASETS: dict[str, DatasetConfig] = {
    "titan_corpus": DatasetConfig(path="tests/assets/titan_corpus", loader=load_local_dataset),
    "c4": DatasetConfig(path="allenai/c4", loader=partial(load_hub_dataset, name="en", split="train")),
    "c4_validation": DatasetConfig(
        path="allenai/c4", loader=partial(load_hub_dataset, name="en", split="validation")
    ),
}


def resolve_dataset(dataset_name: str, dataset_path: str | None) -> tuple[str, DatasetConfig]:
    """(path, config) to load: the registered location, or ``dataset_path`` as a local override."""
    if dataset_name not in DATASETS:
        raise AssetError(
            f"unknown dataset '{dataset_name}'; registered datasets: {', '.join(sorted(DATASETS))} "
            "(or set --training.dataset_path to a local file or folder)"
        )
    config = DATASETS[dataset_name]
    if dataset_path:
        return dataset_path, DatasetConfig(dataset_path, load_local_dataset, config.text_processor)
    return config.path, config


# ---------------------------------------------------------------------------------------
# Tokenizing and packing
# ---------------------------------------------------------------------------------------


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
        import datasets

        path, config = resolve_dataset(dataset_name, dataset_path)
        logger.info("Preparing dataset %s from %s", dataset_name, path)
        data = config.loader(path)
        self.dataset_name = dataset_name
        self.seq_len = seq_len
        self.infinite = infinite
        self._data = data
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._local_batch_size = local_batch_size
        self._map_style = isinstance(self._data, datasets.Dataset)
        self._text_processor = config.text_processor
        self._tokenizer = tokenizer

        self._epoch = 0
        self._sample_idx = 0  # documents of this epoch already tokenized (map-style only)
        self._token_buffer: list[int] = []

    def _documents(self) -> Iterator[dict[str, Any]]:
        """The remaining documents of the current epoch."""
        if self._map_style:
            if self._sample_idx < len(self._data):  # select() rejects an empty range at the end
                yield from self._data.select(range(self._sample_idx, len(self._data)))
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
            yield from batch[start:start + self._local_batch_size]

    def _windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The global stream of packed windows, continuing from the current position."""
        first_pass = True
        while True:
            yield from self._drain()  # a restored buffer may already hold full windows
            documents_read = 0
            for sample in self._documents():
                self._token_buffer.extend(self._tokenizer.encode(self._text_processor(sample)))
                self._sample_idx += 1
                documents_read += 1
                yield from self._drain()
            if not self.infinite:
                logger.info("Dataset %s is exhausted", self.dataset_name)
                return
            if documents_read == 0 and not first_pass:
                raise AssetError(f"dataset '{self.dataset_name}' has no documents")
            first_pass = False
            self._epoch += 1
            self._sample_idx = 0
            logger.warning("Dataset %s is being re-looped", self.dataset_name)

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


# ---------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs, labels = zip(*samples)
    return {"input": torch.stack(inputs)}, torch.stack(labels)


class ParallelAwareDataloader(DataLoader, Stateful):
    """Batches of ``({"input": LongTensor[b, seq_len]}, labels LongTensor[b, seq_len])``.

    A plain single-process ``DataLoader``: with ``num_workers=0`` the dataset's state after
    a batch is the loader's state.  Because every rank reads the same window stream (see
    ``HuggingFaceDataset``), that state is the same on all ranks after each step and does
    not depend on the dp degree: a checkpoint's data position loads under any mesh.
    Stored as JSON bytes (no pickled objects).
    """

    def __init__(self, dataset: HuggingFaceDataset, batch_size: int):
        super().__init__(dataset, batch_size=batch_size, num_workers=0, collate_fn=_collate)

    def state_dict(self) -> dict[str, bytes]:
        return {"dataset": json.dumps(self.dataset.state_dict()).encode("utf-8")}

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        """Restore the stream position; an empty ``state_dict`` is a no-op (nothing saved)."""
        if not state_dict:
            return
        if "dataset" not in state_dict:
            raise UserInputError(
                f"dataloader checkpoint has no 'dataset' entry (it holds "
                f"{', '.join(sorted(state_dict))}); was it written by another trainer version?"
            )
        self.dataset.load_state_dict(json.loads(state_dict["dataset"]))


def build_hf_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True
) -> ParallelAwareDataloader:
    """The training dataloader described by ``job_config.training``.

    Reads ``dataset``, ``dataset_path``, ``local_batch_size`` and ``seq_len``.
    """
    training = job_config.training
    dataset = HuggingFaceDataset(
        dataset_name=training.dataset,
        dataset_path=getattr(training, "dataset_path", None),
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        local_batch_size=training.local_batch_size,
    )
    return ParallelAwareDataloader(dataset, training.local_batch_size)
