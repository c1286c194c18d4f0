"""`CheckpointManager`: periodic save, resume, initial weights and model-only export.

See the package docstring for the checkpoint format and its guarantees.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.folders import (
    fsync_dir,
    is_complete,
    purge_old,
    scan_folder,
)
from torchtitan.components.checkpoint.manifest import (
    CheckpointWriter,
    hash_own_files,
    merge_manifest,
    verify_checkpoint,
)
from torchtitan.components.checkpoint.safe_load import (
    SafeLoadPlanner,
    SafeReader,
    one_line_reason,
    read_keys,
)
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserInputError
from torchtitan.tools.logging import logger

# How long rank 0 waits for the other ranks' checksums of a save before it gives up.
CHECKSUM_WAIT_S = 600.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointSaveError(RuntimeError):
    """A save failed (a full disk, a folder gone): one line naming the checkpoint folder
    and the cause, instead of DCP's per-rank tracebacks."""


@contextlib.contextmanager
def _saving(folder: Path, step: int):
    """Turn any failure of the save of `step` (DCP raises `CheckpointException`, a
    `BaseException`, with every rank's traceback in it) into a `CheckpointSaveError`."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        cause: BaseException = e
        while isinstance(cause, CheckpointException) and cause.failures:
            cause = next(iter(cause.failures.values()))[0]  # the first failing rank's
        full = isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        fix = "free space there" if full else "check that folder"
        raise CheckpointSaveError(
            f"cannot save checkpoint step-{step} in {folder}: {one_line_reason(cause)}; the "
            f"checkpoints saved before it are intact; {fix}, or save elsewhere with "
            "--job.dump_folder / --checkpoint.folder"
        ) from e


class CheckpointManager:
    """Saves and restores the training state; see the package docstring for the format.

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
        job_config: JobConfig,
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
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._pending: Future | None = None  # the asynchronous save in flight
        self._pending_step = 0
        # step-N folders found corrupt at load: a save of step N sets them aside
        self._failed_verification: set[Path] = set()
        self._background: ThreadPoolExecutor | None = None
        self.blocked_s = 0.0  # time the training loop spent in save()
        self.saves = 0
        self._async_pg = None
        self._run_id = "0"
        if self.enable:
            self._run_id = _broadcast(uuid.uuid4().hex[:8])
            if cfg.async_mode == "async" and dist.is_initialized():
                # Background saves run their collectives on their own group, never
                # interleaved with the training loop's.
                self._async_pg = dist.new_group(backend="gloo")
            if cfg.async_mode == "async":
                self._background = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

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
        """Restore the latest intact checkpoint (or `step`); else `initial_load_path`.

        Returns whether anything was loaded.
        """
        if self.enable:
            found = self._resume_step(step)
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
            reason = self._verify(root)
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

    def _verify(self, path: Path) -> str | None:
        """Whether `path` matches its manifest, checked by all ranks at once (each hashes its
        share of the files): None, or the first problem any rank found.  Collective."""
        mine = verify_checkpoint(path, share=(self.rank, self.world))
        if self.world == 1:
            return mine
        found: list[str | None] = [None] * self.world
        dist.all_gather_object(found, mine)
        return next((reason for reason in found if reason), None)

    def _resume_step(self, step: int) -> int | None:
        """The step to resume from (`step` if given), verified by every rank; None if there is
        no checkpoint to resume from.  Collective."""
        plan = _broadcast(self._candidates_or_error(step) if self.rank == 0 else None)
        if isinstance(plan, str):  # an error found by rank 0, raised on every rank
            raise UserInputError(plan)
        skipped: list[tuple[str, str]] = []
        chosen = None
        for candidate, path, known, corrupt in plan:
            reason = self._verify(Path(path)) or known
            if reason is None:
                chosen = candidate
                break
            if corrupt:  # --checkpoint.load_step names this one
                raise UserInputError(corrupt.replace("{reason}", reason))
            skipped.append((path, reason))
        if chosen is None and skipped:
            found = ", ".join(f"{Path(path).name} ({reason})" for path, reason in skipped)
            raise UserInputError(
                f"no intact checkpoint to resume from in {self.folder}: {found}; they are "
                "kept as they are: to start again from step 1, move them out of that folder "
                "(or use another --job.dump_folder)"
            )
        self._failed_verification = {Path(path) for path, _ in skipped}
        if self.rank == 0:
            for path, reason in skipped:
                logger.warning("checkpoint %s: %s; falling back to step-%s", path, reason, chosen)
        return chosen

    def _candidates_or_error(self, step: int) -> list[tuple] | str:
        """`_candidates`, with a failure turned into a message (other ranks wait on rank 0)."""
        try:
            return self._candidates(step)
        except Exception as e:  # noqa: BLE001 - raised on every rank by load()
            return f"cannot read the checkpoints in {self.folder}: {one_line_reason(e)}"

    def _candidates(self, step: int) -> list[tuple] | str:
        """Rank 0: the checkpoints to try, newest first, as (step, path, known problem or
        None, message if it is corrupt or None); or an error message.  Deletes interrupted
        saves; skips model-only exports."""
        complete, partial = scan_folder(self.folder)
        for path in partial:
            logger.warning(
                "ignoring and deleting incomplete checkpoint %s (an interrupted save)", path
            )
            shutil.rmtree(path, ignore_errors=True)
        if step >= 0:
            return self._load_step_candidate(step, complete)
        candidates: list[tuple] = []
        for candidate in reversed(complete):
            path = complete[candidate]
            try:
                keys = read_keys(path)
            except Exception as e:  # noqa: BLE001 - reported and skipped
                # verification, if it fails, says more precisely what is wrong with .metadata
                candidates.append(
                    (candidate, str(path), f".metadata unreadable ({one_line_reason(e)})", None)
                )
                continue
            if not self._is_full(keys):  # before hashing: an export is skipped anyway
                logger.info("not resuming from %s: model-only export", path)
                continue
            candidates.append((candidate, str(path), None, None))
        return candidates

    def _load_step_candidate(self, step: int, complete: dict[int, Path]) -> list[tuple] | str:
        """`--checkpoint.load_step step` as the only candidate, or why it cannot resume."""
        flag = f"--checkpoint.load_step {step}"
        if step not in complete:
            return (
                f"{flag}: no complete checkpoint step-{step} in "
                f"{self.folder} (found: {', '.join(map(str, complete)) or 'none'})"
            )
        path = complete[step]
        others = ", ".join(str(s) for s in complete if s != step) or "none"
        corrupt = (
            f"{flag}: checkpoint {path} is corrupt: {{reason}}; pick another step "
            f"(found: {others}) or delete that folder"
        )
        try:
            keys = read_keys(path)
        except Exception as e:  # noqa: BLE001 - verification names the culprit, if it can
            return [(step, str(path), f".metadata unreadable ({one_line_reason(e)})", corrupt)]
        if not self._is_full(keys):
            return (
                f"{flag}: {path} is a model-only export and "
                "cannot resume training; load it with --checkpoint.initial_load_path instead"
            )
        return [(step, str(path), None, corrupt)]

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
            reason = one_line_reason(e)
            raise UserInputError(f"cannot load {what} from {path}: {reason}") from e
        for part in self.model_parts:
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
        _restore(states, state_dict)
        logger.info("loaded %s from %s in %.2f s", what, path, time.monotonic() - start)

    # ---- saving ------------------------------------------------------------------------

    def save(self, curr_step: int, last_step: bool = False, force: bool = False) -> None:
        """Save if `curr_step` is a multiple of the interval, the last step, or `force`d."""
        if not self.enable or not (force or last_step or curr_step % self.cfg.interval == 0):
            return
        start = time.monotonic()
        self._wait_pending()
        model_only = last_step and self.cfg.last_save_model_only
        if model_only:
            state_dict = self._model_state_dict(_DTYPES[self.cfg.export_dtype])
        else:
            state_dict = {**self._model_state_dict(), **self.states}
        final = self.folder / f"step-{curr_step}"
        tmp = self.folder / f"step-{curr_step}.tmp-{self._run_id}"
        writer = CheckpointWriter(tmp)
        with _saving(self.folder, curr_step):
            if self._background is None:
                dcp.save(state_dict, storage_writer=writer)
                self._finish(None, tmp, final, curr_step, start, model_only)
            else:
                saving = dcp.async_save(
                    state_dict, storage_writer=writer, process_group=self._async_pg
                )
                upload = (
                    saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving
                )
                self._pending = self._background.submit(
                    self._finish, upload, tmp, final, curr_step, start, model_only
                )
                self._pending_step = curr_step
                logger.info(
                    "checkpoint step-%d: staged in %.1f s, writing in the background",
                    curr_step,
                    time.monotonic() - start,
                )
        self.blocked_s += time.monotonic() - start
        self.saves += 1

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with _saving(self.folder, self._pending_step):
                pending.result()

    def _finish(
        self,
        upload: Future | None,
        tmp: Path,
        final: Path,
        step: int,
        start: float,
        model_only: bool,
    ) -> None:
        """Once this rank's files are written: hash them; rank 0 then makes the save visible
        (in the background thread for an asynchronous save)."""
        if upload is not None:
            upload.result()
        hashing = time.monotonic()
        hash_own_files(tmp, self.rank)
        if self.rank != 0:
            return
        merge_manifest(tmp, self.world, CHECKSUM_WAIT_S)
        hashing = time.monotonic() - hashing
        if final in self._failed_verification:  # evidence: set aside, never overwritten
            kept = final.with_name(f"{final.name}.corrupt-{self._run_id}")
            final.rename(kept)
            logger.warning("kept the corrupt checkpoint %s as %s", final, kept)
        elif final.exists():  # e.g. resumed from an earlier load_step: replace the old one
            old = final.with_name(f"{final.name}.tmp-replaced-{self._run_id}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(final.parent)
        kind = "model-only checkpoint" if model_only else "checkpoint"
        logger.info(
            "saved %s %s in %.2f s (checksums %.2f s)",
            kind,
            final,
            time.monotonic() - start,
            hashing,
        )
        for path in purge_old(self.folder, self.cfg.keep_latest_k):
            logger.info(
                "deleted old checkpoint %s (keep_latest_k %d)", path, self.cfg.keep_latest_k
            )

    def newest(self) -> Path | None:
        """The newest complete checkpoint folder, once a save in flight has finished
        (every rank calls it, and sees rank 0's commit); None when there is none."""
        if not self.enable:
            return None
        self._wait_pending()
        if dist.is_initialized():
            dist.barrier()
        complete, _ = scan_folder(self.folder)
        return list(complete.values())[-1] if complete else None

    def close(self) -> None:
        """Finish an asynchronous save still in flight; say how long saving held training."""
        start = time.monotonic()
        self._wait_pending()
        self.blocked_s += time.monotonic() - start
        if self._background is not None:
            self._background.shutdown()
        if self.saves:
            logger.info(
                "checkpointing held training for %.2f s in %d saves (%s)",
                self.blocked_s,
                self.saves,
                "asynchronous" if self._background is not None else "synchronous",
            )


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
