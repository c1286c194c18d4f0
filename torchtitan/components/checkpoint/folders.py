"""Checkpoint folders on disk: which `step-N` folders are complete, purging old ones.

A checkpoint is the folder `{dump_folder}/{checkpoint.folder}/step-{N}`; a save in
progress (or interrupted) is `step-N.tmp-<run id>`. A folder is complete once DCP's
`.metadata` is in it, or once it was committed with a manifest (`MANIFEST`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_DIR = re.compile(r"step-(\d+)\.tmp-.*")

# The checksum manifest's name in a checkpoint folder (written and read by `manifest`).
MANIFEST = "checksums.json"


def is_complete(path: Path) -> bool:
    """A DCP folder is complete once its `.metadata` exists (written last, by rename)."""
    return (path / ".metadata").is_file()


def scan_folder(folder: Path) -> tuple[dict[int, Path], list[Path]]:
    """({step: path} of complete `step-N` checkpoints, [incomplete leftovers]) in `folder`.

    A `step-N` folder with a manifest was committed, so it counts as complete even
    without `.metadata`: verification then reports it, and it is not deleted.
    """
    complete: dict[int, Path] = {}
    partial: list[Path] = []
    if not folder.is_dir():
        return complete, partial
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir():
            continue
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (is_complete(entry) or (entry / MANIFEST).is_file()):
            complete[int(match.group(1))] = entry
        elif match or _TMP_DIR.fullmatch(entry.name):
            partial.append(entry)
    return dict(sorted(complete.items())), partial


def purge_old(folder: Path, keep_latest_k: int) -> list[Path]:
    """Delete all but the newest `keep_latest_k` complete checkpoints (0 keeps all)."""
    if keep_latest_k <= 0:
        return []
    complete, _ = scan_folder(folder)
    doomed = list(complete.values())[:-keep_latest_k]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
