"""Launch real multi-rank training jobs (torchrun + gloo) from tests and read their losses.

The trainer leaves through barrier + flush + os._exit, which avoids gloo's occasional
SIGABRT in interpreter teardown (cpu_feasibility.md §2), so any non-zero exit here is a
real failure and is reported with the tail of the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from torchtitan.tools.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
DEBUG_TOML = REPO / "torchtitan/models/llama3/train_configs/debug_model.toml"

# Small and deterministic: enough steps and tokens to see the curve, quick on 2 cores.
FAST_ARGS = [
    "--training.steps", "10",
    "--training.seq_len", "64",
    "--training.seed", "42",
    "--training.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard",
    "--metrics.disable_color_printing",
]


@dataclass
class Run:
    returncode: int
    output: str
    dump_folder: Path

    def losses(self) -> dict[int, float]:
        return read_scalars(self.dump_folder / "tb")

    def check(self) -> "Run":
        assert self.returncode == 0, f"training failed (rc {self.returncode}):\n{self.output[-6000:]}"
        return self


def run_training(nproc: int, args: list[str], dump_folder: Path, timeout: int = 600) -> Run:
    """Run `python -m torchtitan.train` on `nproc` CPU ranks with the debug config + args."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "torchtitan.train",
        "--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump_folder),
        *FAST_ARGS, *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, Path(dump_folder))


def assert_losses_close(actual: dict[int, float], expected: dict[int, float], rtol: float) -> None:
    assert list(actual) == list(expected), f"steps differ: {list(actual)} vs {list(expected)}"
    for step in expected:
        a, e = actual[step], expected[step]
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a!r} vs {e!r} (rtol {rtol})"
