"""Checksum manifests: every file's size and digest, written at save, verified at load.

Before a save is made visible, `checksums.json` is written into the folder: every
file's size and BLAKE2b-256 digest (`{"format": 1, "hash": "blake2b-256", "files":
{name: {"size": n, "blake2b": hex}}}`), itself via a temporary name, fsync and rename.
Every rank hashes the files it wrote (`hash_own_files`, a part file each) and rank 0
merges the parts (`merge_manifest`); at load every rank hashes its share of the files
(`verify_checkpoint(share=...)`), so both cost one n-th of the bytes per rank.
`CheckpointWriter` marks `.metadata` as carrying a manifest (in DCP's
`StorageMeta.modules`), so that a lost manifest is told apart from a checkpoint written
before manifests existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
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


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "blake2b": _digest(path)}


def _data_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but the manifest and its parts."""
    names = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and not name.startswith(MANIFEST.removesuffix(".json")):
            names.append(name)
    return names


def build_manifest(folder: Path) -> dict[str, Any]:
    """Size and digest of every file under `folder` except the manifest itself."""
    return {**_MANIFEST_FORMAT, "files": {n: _entry(folder / n) for n in _data_files(folder)}}


def write_manifest(folder: Path, entries: dict[str, Any] | None = None) -> None:
    """Write `folder`/checksums.json durably (temporary name, fsync, rename, fsync): the
    given `entries` plus every file they leave out, hashed here."""
    entries = dict(entries or {})
    for name in _data_files(folder):
        if name not in entries:
            entries[name] = _entry(folder / name)
    tmp = folder / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump({**_MANIFEST_FORMAT, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    fsync_dir(folder)


# ---- saving on many ranks: each hashes what it wrote ---------------------------------


def _part(folder: Path, rank: int) -> Path:
    return folder / f"{MANIFEST.removesuffix('.json')}.part{rank}.json"


def hash_own_files(folder: Path, rank: int) -> None:
    """Rank `rank`'s share of a save's checksums: the files DCP's file writer named after
    it (`__{rank}_*`), written as a part file that `merge_manifest` collects."""
    entries = {n: _entry(folder / n) for n in _data_files(folder) if n.startswith(f"__{rank}_")}
    tmp = _part(folder, rank).with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    tmp.rename(_part(folder, rank))


def merge_manifest(folder: Path, world: int, timeout_s: float) -> None:
    """Rank 0: wait for every rank's part (`hash_own_files`), hash what no rank claimed
    (`.metadata`), write the manifest and remove the parts."""
    deadline = time.monotonic() + timeout_s
    parts = [_part(folder, r) for r in range(world)]
    while missing := [p for p in parts if not p.is_file()]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {folder}: no checksums from {missing[0].name}")
        time.sleep(0.05)
    entries: dict[str, Any] = {}
    for part in parts:
        entries.update(json.loads(part.read_text()))
    for part in parts:
        part.unlink()
    write_manifest(folder, entries)


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


def verify_checkpoint(
    path: Path, strict: bool = False, share: tuple[int, int] = (0, 1)
) -> str | None:
    """None if the checkpoint folder `path` matches its manifest, else why not (one line).

    Needs no torch.distributed. Sizes are checked before any file is hashed. Files not in
    the manifest are ignored (DCP reads only those `.metadata` names). A checkpoint from
    before manifests existed is accepted with a warning, or refused if `strict`.
    `share=(i, n)` hashes only every n-th file from the i-th (sizes are all checked): n
    ranks calling it with their own i verify the whole folder in parallel.
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
    index, count = share
    for name in sorted(files)[index::count]:
        if _digest(path / name) != files[name]["blake2b"]:
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
