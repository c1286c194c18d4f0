"""Launch real multi-rank training jobs (torchrun + gloo) from tests and read their losses.

The runner, `Run` and the loss comparison live in `torchtitan.tools.loss_compare` (shared
with `scripts/loss_compare.py`); this module adds the small, fast test configuration.

The trainer leaves through barrier + flush + os._exit, which avoids gloo's occasional
SIGABRT in interpreter teardown (cpu_feasibility.md §2), so any non-zero exit here is a
real failure and is reported with the tail of the output.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.tools import loss_compare
from torchtitan.tools.loss_compare import DEBUG_TOML, REPO, Run, assert_losses_close  # noqa: F401

# Small and deterministic: enough steps and tokens to see the curve, quick on 2 cores.
# Options given to run_training come after these, so they override them.
FAST_ARGS = [
    "--training.steps",
    "10",
    "--training.seq_len",
    "64",
    *loss_compare.deterministic_args(seed=42),
]


def run_training(
    nproc: int,
    args: list[str],
    dump_folder: Path,
    timeout: int = 600,
    env: dict[str, str] | None = None,
    inductor_cache: Path | None = None,
    config_file: Path = DEBUG_TOML,
) -> Run:
    """Run `python -m torchtitan.train` on `nproc` CPU ranks with the debug config,
    FAST_ARGS and then `args` (see `loss_compare.run_training` for `inductor_cache`)."""
    return loss_compare.run_training(
        nproc,
        [*FAST_ARGS, *args],
        dump_folder,
        timeout=timeout,
        env=env,
        inductor_cache=inductor_cache,
        config_file=config_file,
    )
