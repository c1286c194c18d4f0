"""Batching packed samples, with a resumable (checkpointed) data position."""

import json

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.packing import HuggingFaceDataset
from torchtitan.errors import UserInputError


def _collate(
    samples: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
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

    dataset: HuggingFaceDataset  # DataLoader types it as any Dataset

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
    dp_world_size: int, dp_rank: int, tokenizer, job_config: JobConfig, infinite: bool = True
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
