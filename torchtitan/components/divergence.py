"""Stop a run whose loss or gradient norm is no longer a finite number.

Once the loss or the global gradient norm is `nan` or `inf`, every later step is wasted
and every later checkpoint would be poison: saved, it pushes the good ones out
(`keep_latest_k`) and the next launch resumes from it.  So the loop checks both before
the optimizer step and stops there — nothing is stepped, saved or purged after a
non-finite step — with one line naming the step and the newest checkpoint, which was
saved at a finite step.

Both values are already reduced over the whole job when the check runs (the loss over
the data-parallel ranks, the norm over every rank), so all ranks stop at the same step.
"""

from __future__ import annotations

import math
from pathlib import Path

from torchtitan.errors import UserInputError


class TrainingDiverged(UserInputError):
    """Training produced a non-finite loss or gradient norm: the settings (learning rate,
    clipping, precision) let it diverge."""


def check_finite(
    step: int, loss: float, grad_norm: float, newest_checkpoint, checkpointing: bool
) -> None:
    """Raise `TrainingDiverged` unless `loss` and `grad_norm` are finite.

    `newest_checkpoint()` returns the newest saved checkpoint folder (or None); it is
    only called once the run has diverged (it may wait for a save in flight)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    latest: Path | None = newest_checkpoint()
    if latest is not None:
        resume = f"the newest checkpoint, from a finite step, is {latest}"
    elif checkpointing:
        resume = "no checkpoint was saved before it"
    else:
        resume = "nothing was saved (--checkpoint.enable is off)"
    raise TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped "
        f"before the optimizer step, nothing saved after step {step - 1}; {resume}; lower "
        "--optimizer.lr or clip gradients with --training.max_norm"
    )
