"""Datasets and dataloaders for training.

* ``registry``: the named datasets (``DATASETS``), resolving one, the preflight check.
* ``local_files`` / ``file_readers``: a local file or folder of documents, read by suffix.
* ``hub``: a dataset streamed from the Hugging Face Hub, failing fast when offline.
* ``packing``: tokenizing and packing documents into samples, split across dp ranks.
* ``dataloader``: batches of samples with a resumable data position.
"""

from torchtitan.datasets.dataloader import ParallelAwareDataloader, build_hf_dataloader
from torchtitan.datasets.local_files import check_local_dataset
from torchtitan.datasets.packing import HuggingFaceDataset
from torchtitan.datasets.registry import DATASETS, DatasetConfig, check_dataset

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceDataset",
    "ParallelAwareDataloader",
    "build_hf_dataloader",
    "check_dataset",
    "check_local_dataset",
]
