"""`CheckpointManager`: periodic save, resume, initial weights and model-only export.

See the package docstring for the checkpoint format and its guarantees.
"""

from __future__ import annotations

import shutil
import time
import uuid
from concurrent.futures import Future
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
    verify_checkpoint,
    write_manifest,
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

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
            return f"cannot read the checkpoints in {self.folder}: {one_line_reason(e)}"

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
                why = verify_checkpoint(path) or f".metadata unreadable ({one_line_reason(e)})"
                skipped.append((path, why))
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
            reason = one_line_reason(e)
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
        writer = CheckpointWriter(tmp)
        if self.cfg.async_mode == "async":
            saving = dcp.async_save(state_dict, storage_writer=writer, process_group=self._async_pg)
            future = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving
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
        fsync_dir(final.parent)
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
