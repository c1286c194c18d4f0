"""Named datasets: where each lives, how it is loaded, and the preflight check of one.

Named datasets live in ``DATASETS``. ``titan_corpus`` (the default) ships with the repo
in ``tests/assets/titan_corpus`` and needs no network; ``c4`` and ``c4_validation``
stream from the Hugging Face Hub and fail with an ``AssetError`` when it is unreachable
(``hub``).  ``training.dataset_path`` replaces the dataset's location with a local file
or folder (``local_files``); the registered name then only labels the run.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torchtitan.components.errors import AssetError
from torchtitan.config.job_config import Training
from torchtitan.datasets.hub import load_hub_dataset
from torchtitan.datasets.local_files import check_local_dataset, load_local_dataset


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
    "c4": DatasetConfig(
        path="allenai/c4", loader=partial(load_hub_dataset, name="en", split="train")
    ),
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


def check_dataset(training: Training) -> str:
    """What preflight checks of `[training]`'s data before any rank starts: local files
    parsed (`check_local_dataset`), a hub dataset opened; a line saying what was checked."""
    path, config = resolve_dataset(training.dataset, training.dataset_path)
    if config.loader is load_local_dataset:
        return f"{path}: {check_local_dataset(path)}"
    config.loader(path)
    return f"{path}: opened"
