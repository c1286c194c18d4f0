"""Checksum manifests: every file's size and digest, written at save, verified at load.

Before a save is made visible, rank 0 writes `checksums.json` into the folder: every
file's size and BLAKE2b-256 digest (`{"format": 1, "hash": "blake2b-256", "files":
{name: {"size": n, "blake2b": hex}}}`), itself via a temporary name, fsync and rename.
`CheckpointWriter` marks `.metadata` as carrying a manifest (in DCP's
`StorageMeta.modules`), so that a lost manifest is told apart from a checkpoint written
before manifests existed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from torchtitan.components.checkpoint.folders import MANIFEST, fsync_dir
from torchtitan.components.checkpoint.safe_load import SafeReader, one_line_reason
from torchtitan.tools.logging import logger

_MANIFEST_FORMAT = {"format": 1, "hash": "blake2b-256"}
# In `.metadata`'s StorageMeta.modules (unused by DCP's file storage): "has a manifest".
_MANIFEST_MARK = f"torchtitan:{MANIFEST}"


def _digest(path: Path) -> str:
    """BLAKE2b-256 of the file, read in 8 MiB chunks (hashlib.file_digest is 3.11+)."""
    digest = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(folder: Path) -> dict[str, Any]:
    """Size and digest of every file under `folder` except the manifest itself."""
    files = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in (MANIFEST, MANIFEST + ".tmp"):
            files[name] = {"size": path.stat().st_size, "blake2b": _digest(path)}
    return {**_MANIFEST_FORMAT, "files": files}


def write_manifest(folder: Path) -> None:
    """Write `folder`/checksums.json durably: temporary name, fsync, rename, fsync."""
    tmp = folder / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(build_manifest(folder), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    fsync_dir(folder)


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's {file: {"size", "blake2b"}}; ValueError if it is not one of ours."""
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or any(
        manifest.get(k) != v for k, v in _MANIFEST_FORMAT.items()
    ):
        raise ValueError(f"not a {_MANIFEST_FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("blake2b"), str)
        for e in files.values()
    ):
        raise ValueError("malformed file entries")
    return files


def verify_checkpoint(path: Path, strict: bool = False) -> str | None:
    """None if the checkpoint folder `path` matches its manifest, else why not (one line).

    Needs no torch.distributed. Sizes are checked before any file is hashed. Files not in
    the manifest are ignored (DCP reads only those `.metadata` names). A checkpoint from
    before manifests existed is accepted with a warning, or refused if `strict`.
    """
    if not (path / MANIFEST).is_file():
        return _without_manifest(path, strict)
    try:
        files = _read_manifest(path / MANIFEST)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} missing"
        size = file.stat().st_size
        if size != entry["size"]:
            hint = "truncated?" if size < entry["size"] else "appended to?"
            return f"{name} size {size} != {entry['size']} ({hint})"
    for name, entry in files.items():
        if _digest(path / name) != entry["blake2b"]:
            return f"{name} checksum mismatch (corrupted bytes)"
    return None


def _without_manifest(path: Path, strict: bool) -> str | None:
    """Verdict on a folder without a manifest: lost if `.metadata` says it had one."""
    try:
        storage_meta = SafeReader(path).read_metadata().storage_meta
    except Exception as e:  # noqa: BLE001 - any failure to read is the verdict
        return f".metadata unreadable ({one_line_reason(e)})"
    if _MANIFEST_MARK in (getattr(storage_meta, "modules", None) or []):
        return f"{MANIFEST} missing"
    old = f"no {MANIFEST} (written before checkpoints carried checksums)"
    if strict:
        return old
    logger.warning("checkpoint %s: %s; loading it unverified", path, old)
    return None


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer (one fsynced file per rank) that marks `.metadata` as carrying a
    manifest."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True)

    def storage_meta(self) -> StorageMeta | None:
        """Marks `.metadata`: this checkpoint carries a manifest (see `verify_checkpoint`)."""
        meta = super().storage_meta() or StorageMeta()
        meta.modules = [*meta.modules, _MANIFEST_MARK]
        return meta
