"""Warmup → (stable) → decay learning-rate schedule, torchtitan style.

Linear warmup over `warmup_steps`; then, if `decay_ratio` is set, a stable phase at the
peak LR and a decay over the last `decay_ratio` of the steps (warmup-stable-decay);
without it the decay starts right after warmup.  The decay goes from the peak to
`min_lr_factor × peak` with the chosen shape.
"""

from __future__ import annotations

import math
from typing import Any, cast

from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import JobConfig


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR for the optimizer step number `step` (1-based)."""
    warmup_steps = min(warmup_steps, total_steps)
    decay_steps = (
        total_steps - warmup_steps if decay_ratio is None else round(total_steps * decay_ratio)
    )
    decay_start = total_steps - decay_steps
    if step <= warmup_steps:
        # (step) / (warmup + 1): never exactly 0 at step 1, exactly 1 only after warmup.
        return step / (warmup_steps + 1)
    if step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / max(decay_steps, 1), 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"--lr_scheduler.decay_type: unknown {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


class LRSchedulersContainer(Stateful):
    """One LambdaLR per optimizer, stepped together; checkpointed as one."""

    def __init__(self, optimizers: Any, job_config: JobConfig):
        cfg = job_config.lr_scheduler
        kwargs: dict[str, Any] = dict(
            warmup_steps=cfg.warmup_steps,
            total_steps=job_config.training.steps,
            decay_ratio=cfg.decay_ratio,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        )
        # LambdaLR evaluates the lambda at its internal epoch (0 at construction);
        # the LR used at optimizer step s is factor(s), hence the +1.
        self.schedulers = [
            LambdaLR(opt, lambda epoch: lr_factor(epoch + 1, **kwargs))
            for opt in optimizers.optimizers
        ]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        # torch types an lr as float | Tensor; ours are floats (`optimizer.lr` times `lr_factor`)
        return cast(float, self.schedulers[0].get_last_lr()[0])

    def state_dict(self) -> dict[str, Any]:
        # All schedulers advance together; the first one's counters describe them all.
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved step with this job's schedule (steps, warmup, peak lr).

        Sets the optimizers' lr, so it must run after their own state is loaded: theirs
        carries the lr as saved (see checkpoint/manager.py's `_restore`).
        """
        for scheduler in self.schedulers:
            scheduler.last_epoch = state_dict["last_epoch"]
        self.apply()

    def apply(self) -> None:
        """Set every param group's lr to the schedule's value at the current step."""
        for scheduler in self.schedulers:
            scheduler._last_lr = [  # keep get_last_lr() consistent after a resume
                base * lam(scheduler.last_epoch)
                for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas)
            ]
            for group, base, lr in zip(
                scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler._last_lr
            ):
                group["initial_lr"] = base  # a loaded optimizer state brings the saved peak
                group["lr"] = lr


def build_lr_schedulers(optimizers: Any, job_config: JobConfig) -> LRSchedulersContainer:
    return LRSchedulersContainer(optimizers, job_config)
