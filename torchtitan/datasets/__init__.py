"""Datasets and dataloaders for training (see ``hf_datasets``)."""

from torchtitan.datasets.hf_datasets import (
    DATASETS,
    DatasetConfig,
    HuggingFaceDataset,
    ParallelAwareDataloader,
    build_hf_dataloader,
    check_dataset,
    check_local_dataset,
)

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceDataset",
    "ParallelAwareDataloader",
    "build_hf_dataloader",
    "check_dataset",
    "check_local_dataset",
]
