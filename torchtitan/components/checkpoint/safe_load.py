"""Reading checkpoints without unpickling arbitrary objects.

The `.metadata` file goes through an allowlisting unpickler (`SafeReader`) and non-tensor
values through `torch.load(weights_only=True)` (`SafeLoadPlanner`), so non-tensor state
must be plain Python values (int, float, str, bytes, lists, dicts).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchtitan.torch_private import set_element

# Globals a DCP .metadata pickle may reference: DCP's own metadata classes and the torch
# value types inside them. Anything else (os.system, ...) is refused.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
} | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # its own classes only
                return obj
        raise pickle.UnpicklingError(
            f"checkpoint metadata references {module}.{name}, which is not allowed"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader with the `.metadata` pickle restricted to DCP's own types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("checkpoint .metadata does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values are read with `weights_only=True` (plain Python types only)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_keys(path: Path) -> set[str]:
    """The (flattened) keys stored in the checkpoint at `path`."""
    return set(SafeReader(path).read_metadata().state_dict_metadata)


def one_line_reason(e: BaseException) -> str:
    """The gist of a (possibly multi-rank, traceback-laden) DCP error, on one line."""
    text = str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # CheckpointException embeds each rank's traceback; its last line is the cause.
    gist = lines[-1] if lines else type(e).__name__
    return gist[:400]
