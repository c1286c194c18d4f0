"""Loss-curve comparison: run training configurations, read their losses, compare them.

One place for what both `scripts/loss_compare.py` and the integration tests need:

* `run_training` launches `torchtitan.train` under torchrun on CPU/GPU ranks and returns a
  `Run` (exit code, output, dump folder); `Run.losses()` reads the TensorBoard series.
* `read_tb_losses` / `read_log_losses` turn an existing run into {step: loss}.
* `compare` lists the steps where two curves disagree beyond `rtol`;
  `assert_losses_close` raises an AssertionError naming the first one.
* `read_golden` / `write_golden` handle golden files: "step loss" per line, losses as
  Python float reprs, lines starting with `#` are comments.
* `plot_losses` draws curves into a PNG (matplotlib, Agg backend).

Losses from TensorBoard are the float32 values the trainer logged; the console line has
only 4 decimals, so curves read from logs compare meaningfully only at rtol >~ 1e-4.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torchtitan.config.manager import last_wins
from torchtitan.errors import UserInputError

REPO = Path(__file__).resolve().parents[2]
DEBUG_TOML = REPO / "torchtitan/models/llama3/train_configs/debug_model.toml"
LOSS_TAG = "loss_metrics/global_avg_loss"
LOG_NAME = "train.log"  # each run's full console output, inside its dump folder


class LossCompareError(UserInputError):
    """Unusable input (missing run folder, malformed golden file, ...): one-line message."""


def deterministic_args(seed: int = 42) -> list[str]:
    """Options that make two runs comparable: fixed seed, deterministic kernels, and a
    TensorBoard loss scalar on every step."""
    return [
        "--training.seed",
        str(seed),
        "--training.deterministic",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
    ]


@dataclass
class Run:
    """A finished training launch."""

    returncode: int
    output: str
    dump_folder: Path

    def losses(self) -> dict[int, float]:
        return read_tb_losses(self.dump_folder / "tb")

    def check(self) -> Run:
        assert self.returncode == 0, (
            f"training failed (rc {self.returncode}):\n{_crash_lines(self.output)}"
            f"{self.output[-6000:]}"
        )
        return self


# What a rank that dies in native code prints before its signal (abort, segfault); the
# tail of the output is usually the other ranks' "connection closed" tracebacks instead.
_CRASH_MARKERS = (
    "terminate called",
    "what():",
    "Fatal Python error",
    "Segmentation fault",
    "double free",
    "corrupted",
    "free(): ",
    "Aborted",
)


def _crash_lines(output: str) -> str:
    """The lines (with two before each) where a rank reported a native crash, or ""."""
    lines = output.splitlines()
    keep = sorted(
        {
            j
            for i, line in enumerate(lines)
            if any(m in line for m in _CRASH_MARKERS)
            for j in range(max(0, i - 2), i + 1)
        }
    )
    if not keep:
        return ""
    return "native crash report:\n" + "\n".join(lines[j] for j in keep[:60]) + "\n...\n"


def run_training(
    nproc: int,
    args: list[str],
    dump_folder: str | Path,
    *,
    config_file: str | Path = DEBUG_TOML,
    timeout: float = 1800,
    env: dict[str, str] | None = None,
    inductor_cache: str | Path | None = None,
    forked: bool = False,
) -> Run:
    """Run `python -m torchtitan.train` on `nproc` ranks with `config_file` + `args`.

    No seed or metrics options are added; an option given more than once (defaults plus
    overrides) keeps its last value (`last_wins`), as the trainer refuses repeats. Each
    rank gets one OpenMP thread, so results do not depend on the machine's core count;
    `env` entries override the inherited environment. The combined output of all ranks
    is returned and also saved as `{dump_folder}/train.log`.

    `inductor_cache` keeps torch.compile's cache between launches (the ranks share it:
    `train.py` keeps each rank's compiled graphs apart); `forked`: see `rank_command`.
    """
    dump_folder = Path(dump_folder).resolve()  # the ranks run in the repo root
    dump_folder.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.setdefault("HF_DATASETS_OFFLINE", "1")
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    full_env.setdefault("PYTHONHASHSEED", "0")  # as run_train.sh: the same on every rank
    if inductor_cache is not None:
        full_env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(inductor_cache).resolve())
    full_env.update(env or {})
    cmd = rank_command(
        nproc,
        [
            "-m",
            "torchtitan.train",
            *last_wins(
                [
                    "--job.config_file",
                    str(Path(config_file).resolve()),
                    "--job.dump_folder",
                    str(dump_folder),
                    *args,
                ]
            ),
        ],
        forked=forked,
    )
    code, output = launch_and_wait(cmd, full_env, timeout, "loss_compare")
    (dump_folder / LOG_NAME).write_text(output)
    return Run(code, output, dump_folder)


def rank_command(
    nproc: int, target: list[str], *, forked: bool = False, preload: Sequence[str] = ()
) -> list[str]:
    """The command that runs `target` (`["-m", module, *args]` or `[script, *args]`) on
    `nproc` ranks of this machine: torchrun's standalone launch, or with `forked` one process
    that imports once (the target's top-level imports and `preload`) and forks the ranks
    (`torchtitan.tools.forked_ranks`, CPU only: no per-rank interpreter start, for short
    runs)."""
    if forked:
        loads = [f"--preload={name}" for name in preload]
        return [
            sys.executable,
            "-m",
            "torchtitan.tools.forked_ranks",
            f"--nproc={nproc}",
            *loads,
            *target,
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *target,
    ]


def launch_and_wait(cmd: list[str], env: dict, timeout: float, label: str) -> tuple[int, str]:
    """Run a torchrun command from the repo root; (exit code, stdout+stderr).  On timeout it
    is stopped (see `_stop`) and the code is 124; on any other interruption it is stopped too."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        return 124, _stop(proc) + f"\n[{label}] timed out after {timeout:.0f} s\n"
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> str:
    """End a torchrun launch and return its remaining output. SIGTERM lets torchrun stop
    its ranks (they live in their own sessions); SIGKILL only if it does not exit."""
    proc.terminate()
    try:
        return proc.communicate(timeout=60)[0] or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] or ""


def preflight(nproc: int, args: list[str], config_file: str | Path = DEBUG_TOML) -> str | None:
    """Check a configuration without starting ranks (`torchtitan.preflight`): the trainer's
    one-line complaint about it, or None when it is fine."""
    cmd = [
        sys.executable,
        "-m",
        "torchtitan.preflight",
        "--world-size",
        str(nproc),
        "--job.config_file",
        str(Path(config_file).resolve()),
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode == 0:
        return None
    lines = proc.stdout.strip().splitlines() or [f"preflight failed (rc {proc.returncode})"]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return (errors[-1] if errors else lines[-1]).removeprefix("error: ")


def read_tb_losses(tb_dir: str | Path, tag: str = LOSS_TAG) -> dict[int, float]:
    """{step: loss} from the TensorBoard event files under `tb_dir`."""
    from torchtitan.tools.tensorboard_io import read_scalars

    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        raise LossCompareError(f"{tb_dir}: no such TensorBoard folder")
    losses = read_scalars(tb_dir, tag)
    if not losses:
        raise LossCompareError(
            f"{tb_dir}: no {tag!r} scalars (was the run started with --metrics.enable_tensorboard?)"
        )
    return losses


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)")


def parse_log(text: str) -> dict[int, float]:
    """{step: loss} from trainer console output (`step:  2  loss:  8.1619 ...` lines).

    Colour codes and launcher prefixes are ignored; a step seen twice keeps its last value.
    """
    losses: dict[int, float] = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(_ANSI.sub("", line))
        if match:
            try:
                losses[int(match.group(1))] = float(match.group(2))
            except ValueError:
                continue
    return dict(sorted(losses.items()))


def read_log_losses(path: str | Path) -> dict[int, float]:
    losses = parse_log(_read_text(path))
    if not losses:
        raise LossCompareError(f"{path}: no 'step: N  loss: X' lines found")
    return losses


def read_golden(path: str | Path) -> dict[int, float]:
    """{step: loss} from a golden file; `#` lines and blank lines are skipped."""
    losses: dict[int, float] = {}
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            step, loss = int(parts[0]), float(parts[1])
        except ValueError:
            raise LossCompareError(f"{path}:{lineno}: expected 'STEP LOSS', got {line!r}") from None
        if step in losses:
            raise LossCompareError(f"{path}:{lineno}: step {step} appears twice")
        losses[step] = loss
    if not losses:
        raise LossCompareError(f"{path}: no 'STEP LOSS' lines")
    return dict(sorted(losses.items()))


def write_golden(path: str | Path, losses: dict[int, float], comments: Sequence[str] = ()) -> None:
    """Write `losses` as "step loss" lines (repr floats, exact round trip) after `# ` comments."""
    lines = [f"# {c}" for c in comments]
    lines += [f"{step} {float(losses[step])!r}" for step in sorted(losses)]
    Path(path).write_text("\n".join(lines) + "\n")


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise LossCompareError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:  # has no strerror
        raise LossCompareError(f"{path}: cannot read ({e})") from None


class Mismatch(NamedTuple):
    """One step where the curves disagree; a side is None when it lacks the step."""

    step: int
    baseline: float | None
    test: float | None

    def describe(self, rtol: float) -> str:
        if self.baseline is None or self.test is None:
            side = "baseline" if self.baseline is None else "test"
            return f"step {self.step}: missing in {side}"
        return (
            f"step {self.step}: test {self.test!r} vs baseline {self.baseline!r}, "
            f"rel diff {rel_diff(self.baseline, self.test):.3g} > rtol {rtol:g}"
        )


def rel_diff(baseline: float, test: float) -> float:
    """|test - baseline| / |baseline| (0 when equal, inf when baseline is 0 and test isn't)."""
    if test == baseline:
        return 0.0
    return abs(test - baseline) / abs(baseline) if baseline else math.inf


def compare(baseline: dict[int, float], test: dict[int, float], rtol: float) -> list[Mismatch]:
    """Steps (in order) where |test - baseline| > rtol·|baseline|, a side lacks the step, or a
    loss is NaN. rtol 0 demands exact equality."""
    if not rtol >= 0:
        raise LossCompareError(f"rtol must be >= 0, got {rtol}")
    bad = []
    for step in sorted(set(baseline) | set(test)):
        b, t = baseline.get(step), test.get(step)
        if b is None or t is None or not abs(t - b) <= rtol * abs(b):
            bad.append(Mismatch(step, b, t))
    return bad


def assert_losses_close(
    actual: dict[int, float], expected: dict[int, float], rtol: float, what: str = "losses"
) -> None:
    """Raise AssertionError naming the first step where `actual` strays from `expected`."""
    bad = compare(expected, actual, rtol)
    if bad:
        raise AssertionError(
            f"{what}: {len(bad)} of {len(set(expected) | set(actual))} steps differ; first "
            f"{bad[0].describe(rtol)}\n{format_table(expected, actual, ('expected', 'actual'))}"
        )


def format_table(
    baseline: dict[int, float],
    test: dict[int, float] | None = None,
    names: tuple[str, str] = ("baseline", "test"),
) -> str:
    """Aligned text table: step | baseline | test | rel diff (only baseline without test)."""
    header = ["step", names[0]] + ([names[1], "rel diff"] if test is not None else [])
    rows = [header]
    for step in sorted(set(baseline) | set(test or {})):
        b = baseline.get(step)
        row = [str(step), _fmt(b)]
        if test is not None:
            t = test.get(step)
            row += [_fmt(t), "-" if b is None or t is None else f"{rel_diff(b, t):.3e}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


def plot_losses(path: str | Path, curves: dict[str, dict[int, float]], title: str = "loss") -> None:
    """Save one line per {label: {step: loss}} to `path` (format from its extension)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise LossCompareError(f"{path}: cannot write plot ({e})") from None
    finally:
        plt.close(fig)
