"""Distributed checkpoints: periodic save, resume, initial weights and model-only export.

A checkpoint is a `torch.distributed.checkpoint` (DCP) folder
`{dump_folder}/{checkpoint.folder}/step-{N}`. Its keys are the model's parameters by
fully qualified name at the top level (so a model-only checkpoint and a full one look
alike to a weights-only loader), plus one entry per stateful component: "optimizer",
"lr_scheduler", "dataloader" and those passed as `states` (e.g. "train_state").
Model and optimizer states go through DCP's state-dict helpers, so a checkpoint saved
under one mesh (FSDP, TP, one rank) loads under any other. Values that are the same on
every rank (dataloader position, step, scheduler) are written once: DCP's save planner
keeps a single copy of items with the same key.

Atomic visibility: a save writes into `step-N.tmp-<run id>`; DCP returns only after
every rank wrote its files and the coordinator wrote `.metadata`, and rank 0 then
renames the folder to `step-N`. So a `step-N` folder is complete by construction; a
`.tmp-` folder is an interrupted save, reported and deleted when the next job starts.

Integrity: before that rename, rank 0 writes `checksums.json` into the folder: every
file's size and BLAKE2b-256 digest (`{"format": 1, "hash": "blake2b-256", "files":
{name: {"size": n, "blake2b": hex}}}`), itself via a temporary name, fsync and rename,
so it is part of the atomic commit. Rank 0 hashes files that every rank wrote: this
assumes a filesystem shared by all ranks (as the rename already does). `.metadata`
records that the checkpoint carries a manifest (a mark in DCP's `StorageMeta.modules`).
Before a load, rank 0 checks sizes, then digests (`verify_checkpoint`) and broadcasts
the verdict; a checkpoint that does not match (flipped bytes, truncated or missing
file, manifest missing though `.metadata` says there is one) is skipped with a warning
naming the file, and the newest intact one loads. Checkpoints written before manifests
existed have no mark: they load unverified, with a warning. Hashing reads every byte
once: about a second per GB, on rank 0, at each save and at each load.

Loading never unpickles arbitrary objects: the `.metadata` file goes through an
allowlisting unpickler and non-tensor values through `torch.load(weights_only=True)`,
so non-tensor state must be plain Python values (int, float, str, bytes, lists, dicts).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.errors import UserInputError
from torchtitan.tools.logging import logger
from torchtitan.torch_private import set_element

_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_DIR = re.compile(r"step-(\d+)\.tmp-.*")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Test hook: `TORCHTITAN_TEST_KILL_DURING_SAVE=<step>` SIGKILLs rank 1 while it saves that
# step, after its data files are written but before the checkpoint is complete (no
# .metadata, no rename) — a crash in the middle of a save, for the integration tests.
KILL_ENV = "TORCHTITAN_TEST_KILL_DURING_SAVE"


# ---------------------------------------------------------------------------------------
# Finding checkpoints on disk
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------

MANIFEST = "checksums.json"
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
    _fsync_dir(folder)


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
        return f".metadata unreadable ({_reason(e)})"
    if _MANIFEST_MARK in (getattr(storage_meta, "modules", None) or []):
        return f"{MANIFEST} missing"
    old = f"no {MANIFEST} (written before checkpoints carried checksums)"
    if strict:
        return old
    logger.warning("checkpoint %s: %s; loading it unverified", path, old)
    return None


# ---------------------------------------------------------------------------------------
# Safe reading
# ---------------------------------------------------------------------------------------

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
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
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


class _Writer(FileSystemWriter):
    """DCP's file writer plus the manifest mark and the kill-during-save test hook (KILL_ENV)."""

    def __init__(self, path: Path, kill: bool):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._kill = kill

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        if self._kill:
            future.wait()
            logger.warning("%s: killing this rank in the middle of a save", KILL_ENV)
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    def storage_meta(self) -> StorageMeta | None:
        """Marks `.metadata`: this checkpoint carries a manifest (see `verify_checkpoint`)."""
        meta = super().storage_meta() or StorageMeta()
        meta.modules = [*meta.modules, _MANIFEST_MARK]
        return meta


# ---------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves and restores the training state; see the module docstring for the format.

    `load()` once before training, `save(step)` after every step (it decides whether
    this step saves), `close()` at the end (waits for an asynchronous save).
    """

    def __init__(
        self,
        dataloader: Stateful,
        model_parts: list[nn.Module],
        optimizers: Stateful,
        lr_schedulers: Stateful,
        states: dict[str, Stateful],
        job_config: Any,
    ):
        cfg = self.cfg = job_config.checkpoint
        self.enable = cfg.enable
        self.folder = Path(job_config.job.dump_folder) / cfg.folder
        self.model_parts = model_parts
        # Restored in this order: the schedule after the optimizer (see `_restore`).
        self.states: dict[str, Stateful] = {
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": dataloader,
            **states,
        }
        if cfg.interval < 1:
            raise UserInputError(f"--checkpoint.interval must be at least 1, got {cfg.interval}")
        if cfg.keep_latest_k < 0:
            raise UserInputError(
                f"--checkpoint.keep_latest_k must be 0 (keep all) or more, got {cfg.keep_latest_k}"
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: tuple[Future, Path, Path, int, float, bool] | None = None
        self._async_pg = None
        self._run_id = "0"
        if self.enable:
            self._run_id = _broadcast(uuid.uuid4().hex[:8])
            if cfg.async_mode == "async" and dist.is_initialized():
                # Background saves run their collectives on their own group, never
                # interleaved with the training loop's.
                self._async_pg = dist.new_group(backend="gloo")

    # ---- state dicts -------------------------------------------------------------------

    def _model_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        if dtype is not None:
            merged = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}
        return merged

    def _is_full(self, keys: set[str]) -> bool:
        """Whether a checkpoint with these keys holds every state (not just weights)."""
        return all(any(k.startswith(name + ".") or k == name for k in keys) for name in self.states)

    # ---- loading -----------------------------------------------------------------------

    def load(self, step: int = -1) -> bool:
        """Restore the latest complete checkpoint (or `step`); else `initial_load_path`.

        Returns whether anything was loaded.
        """
        if self.enable:
            found = _broadcast(self._choose_or_error(step) if self.rank == 0 else None)
            if isinstance(found, str):  # an error found by rank 0, raised on every rank
                raise UserInputError(found)
            if found is not None:
                self._load(
                    self.folder / f"step-{found}", model_only=False, what=f"checkpoint step-{found}"
                )
                return True
        path = self.cfg.initial_load_path
        if path:
            root = Path(path)
            if not root.is_dir() or not is_complete(root):
                raise UserInputError(
                    f"--checkpoint.initial_load_path {path}: not a complete DCP checkpoint folder "
                    "(no such folder, or no .metadata in it)"
                )
            reason = _broadcast(verify_checkpoint(root) if self.rank == 0 else None)
            if reason:
                raise UserInputError(
                    f"--checkpoint.initial_load_path {path}: corrupt checkpoint: {reason}"
                )
            model_only = self.cfg.initial_load_model_only
            self._load(
                root,
                model_only=model_only,
                what="initial_load_path" + (" (model weights only)" if model_only else ""),
            )
            return True
        return False

    def _choose_or_error(self, step: int) -> int | str | None:
        """`_choose`, with a failure turned into a message (other ranks wait on rank 0)."""
        try:
            return self._choose(step)
        except Exception as e:  # noqa: BLE001 - raised on every rank by load()
            return f"cannot read the checkpoints in {self.folder}: {_reason(e)}"

    def _choose(self, step: int) -> int | str | None:
        """Rank 0: the step to resume from, None for none, or an error message."""
        complete, partial = scan_folder(self.folder)
        for path in partial:
            logger.warning(
                "ignoring and deleting incomplete checkpoint %s (an interrupted save)", path
            )
            shutil.rmtree(path, ignore_errors=True)
        if step >= 0:
            return self._check_load_step(step, complete)
        skipped: list[tuple[Path, str]] = []
        chosen = None
        for candidate in reversed(complete):
            path = complete[candidate]
            try:
                keys = read_keys(path)
            except Exception as e:  # noqa: BLE001 - reported and skipped
                # The manifest, if any, says more precisely what is wrong with .metadata.
                skipped.append(
                    (path, verify_checkpoint(path) or f".metadata unreadable ({_reason(e)})")
                )
                continue
            if not self._is_full(keys):  # before hashing: an export is skipped anyway
                logger.info("not resuming from %s: model-only export", path)
                continue
            reason = verify_checkpoint(path)
            if reason is None:
                chosen = candidate
                break
            skipped.append((path, reason))
        then = (
            f"falling back to step-{chosen}"
            if chosen is not None
            else "no intact checkpoint left to resume from"
        )
        for path, reason in skipped:
            logger.warning("checkpoint %s: %s; %s", path, reason, then)
        return chosen

    def _check_load_step(self, step: int, complete: dict[int, Path]) -> int | str:
        """`step` if `--checkpoint.load_step step` can resume training, else why not."""
        flag = f"--checkpoint.load_step {step}"
        if step not in complete:
            return (
                f"{flag}: no complete checkpoint step-{step} in "
                f"{self.folder} (found: {', '.join(map(str, complete)) or 'none'})"
            )
        path = complete[step]
        reason = verify_checkpoint(path)
        if reason:
            others = ", ".join(str(s) for s in complete if s != step) or "none"
            return (
                f"{flag}: checkpoint {path} is corrupt: {reason}; pick another step "
                f"(found: {others}) or delete that folder"
            )
        if not self._is_full(read_keys(path)):
            return (
                f"{flag}: {path} is a model-only export and "
                "cannot resume training; load it with --checkpoint.initial_load_path instead"
            )
        return step

    def _load(self, path: Path, model_only: bool, what: str) -> None:
        start = time.monotonic()
        model_sd = self._model_state_dict()
        states = {} if model_only else self.states
        # Plain state dicts, not the Stateful objects: DCP would hand them their state in
        # sorted key order, and `_restore` needs ours.
        state_dict: dict[str, Any] = {**model_sd, **{k: v.state_dict() for k, v in states.items()}}
        try:
            dcp.load(state_dict, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as e:  # a bad file is the user's to fix
            reason = _reason(e)
            raise UserInputError(f"cannot load {what} from {path}: {reason}") from e
        for part in self.model_parts:
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
        _restore(states, state_dict)
        logger.info("loaded %s from %s in %.1f s", what, path, time.monotonic() - start)

    # ---- saving ------------------------------------------------------------------------

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """Save if `curr_step` is a multiple of the interval or the last step."""
        if not self.enable or not (last_step or curr_step % self.cfg.interval == 0):
            return
        self._wait_pending()
        start = time.monotonic()
        model_only = last_step and self.cfg.last_save_model_only
        if model_only:
            state_dict = self._model_state_dict(_DTYPES[self.cfg.export_dtype])
        else:
            state_dict = {**self._model_state_dict(), **self.states}
        final = self.folder / f"step-{curr_step}"
        tmp = self.folder / f"step-{curr_step}.tmp-{self._run_id}"
        kill = os.environ.get(KILL_ENV) == str(curr_step) and self.rank == 1
        writer = _Writer(tmp, kill)
        if self.cfg.async_mode == "async":
            future = dcp.async_save(state_dict, storage_writer=writer, process_group=self._async_pg)
            future = getattr(future, "upload_completion", future)
            self._pending = (future, tmp, final, curr_step, start, model_only)
            logger.info(
                "checkpoint step-%d: staged in %.1f s, writing in the background",
                curr_step,
                time.monotonic() - start,
            )
        else:
            dcp.save(state_dict, storage_writer=writer)
            self._commit(tmp, final, curr_step, start, model_only)

    def _wait_pending(self) -> None:
        if self._pending is not None:
            future, tmp, final, step, start, model_only = self._pending
            self._pending = None
            future.result()
            self._commit(tmp, final, step, start, model_only)

    def _commit(self, tmp: Path, final: Path, step: int, start: float, model_only: bool) -> None:
        """Rank 0 makes a finished save visible as `step-N` and purges old ones."""
        if self.rank != 0:
            return
        hashing = time.monotonic()
        write_manifest(tmp)
        hashing = time.monotonic() - hashing
        if final.exists():  # e.g. resumed from an earlier load_step: replace the old one
            old = final.with_name(f"{final.name}.tmp-replaced-{self._run_id}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(final.parent)
        kind = "model-only checkpoint" if model_only else "checkpoint"
        logger.info(
            "saved %s %s in %.1f s (checksums %.1f s)",
            kind,
            final,
            time.monotonic() - start,
            hashing,
        )
        for path in purge_old(self.folder, self.cfg.keep_latest_k):
            logger.info(
                "deleted old checkpoint %s (keep_latest_k %d)", path, self.cfg.keep_latest_k
            )

    def close(self) -> None:
        """Finish an asynchronous save still in flight."""
        self._wait_pending()


def _restore(states: dict[str, Stateful], loaded: dict[str, Any]) -> None:
    """Hand each component its loaded state, in the order of `states`.

    The optimizer's state dict carries its param_groups' lr as saved; the schedule,
    restored after it, sets the lr of the (possibly changed) schedule at the resumed
    step. In the other order (DCP's, by name) the first resumed step ran at the saved lr.
    """
    for name, state in states.items():
        state.load_state_dict(loaded[name])


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (plain Python values only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _reason(e: BaseException) -> str:
    """The gist of a (possibly multi-rank, traceback-laden) DCP error, on one line."""
    text = str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # CheckpointException embeds each rank's traceback; its last line is the cause.
    gist = lines[-1] if lines else type(e).__name__
    return gist[:400]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
