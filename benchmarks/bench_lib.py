"""Measure training configurations side by side on this machine: tokens/s and peak memory.

Each configuration runs as a real torchrun job (the debug Llama 3 on CPU ranks) through
`torchtitan.tools.loss_compare.run_training`.  Configurations are interleaved over several
rounds (A B C, A B C, ...) so that machine noise hits all of them alike; a configuration's
figure is the median over rounds of its median steady-state step (step 1 and compile
warm-up excluded).  Memory is rank 0's peak RSS (CPU) or device peak (GPU) as the trainer
logs it per step: "steady" is the largest over the steady-state steps, "lifetime" includes
step 1 (planning, lowering, compiling).
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.tools.loss_compare import DEBUG_TOML, run_training
from torchtitan.tools.tensorboard_io import read_scalars

COMMON = [
    "--training.seed",
    "42",
    "--metrics.enable_tensorboard",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
]


@dataclass
class Config:
    name: str
    args: list[str]
    nproc: int = 4
    config_file: Path = DEBUG_TOML


@dataclass
class Result:
    config: Config
    tps: list[float] = field(default_factory=list)
    peak_gib: list[float] = field(default_factory=list)  # steady-state steps
    lifetime_gib: list[float] = field(default_factory=list)  # incl. planning and compiling
    final_loss: float = float("nan")
    wall_s: list[float] = field(default_factory=list)
    collectives: float = float("nan")  # per step, where the run counted them
    comm_calls: dict[str, float] = field(default_factory=dict)  # per kind, counted step
    comm_elements: dict[str, float] = field(default_factory=dict)  # sent per kind
    plan_s: list[float] = field(default_factory=list)  # auto-parallel specs: planning time

    @property
    def median_tps(self) -> float:
        return statistics.median(self.tps) if self.tps else float("nan")

    @property
    def max_peak_gib(self) -> float:
        return max(self.peak_gib) if self.peak_gib else float("nan")


def measure(
    configs: list[Config],
    steps: int,
    rounds: int,
    skip_steps: int = 2,
    extra_args: list[str] = (),
    inductor_cache: Path | None = None,
) -> list[Result]:
    results = [Result(c) for c in configs]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for r in range(rounds):
            for i, result in enumerate(results):
                c = result.config
                folder = Path(tmp) / f"{i}-{r}"
                t0 = time.perf_counter()
                run = run_training(
                    c.nproc,
                    [*COMMON, "--training.steps", str(steps), *extra_args, *c.args],
                    folder,
                    inductor_cache=inductor_cache,
                    config_file=c.config_file,
                )
                result.wall_s.append(time.perf_counter() - t0)
                run.check()
                tb = folder / "tb"
                tps = read_scalars(tb, "throughput(tps)")
                steady = [v for s, v in tps.items() if s > skip_steps]
                result.tps.append(statistics.median(steady))
                mem = read_scalars(tb, "memory/peak_GiB")
                result.peak_gib.append(max(v for s, v in mem.items() if s > skip_steps))
                result.lifetime_gib.append(max(mem.values()))
                result.final_loss = run.losses()[steps]
                planned = re.search(r"auto-parallel planning took ([0-9.]+)s", run.output)
                if planned:
                    result.plan_s.append(float(planned.group(1)))
                counted = read_scalars(tb, "comm/collectives")
                if counted:
                    result.collectives = next(iter(counted.values()))
                for kind in (
                    "all_to_all",
                    "all_gather_into_tensor",
                    "reduce_scatter_tensor",
                    "send",
                    "recv",
                ):
                    calls = read_scalars(tb, f"comm/{kind}")
                    elements = read_scalars(tb, f"comm_elements/{kind}")
                    result.comm_calls[kind] = next(iter(calls.values()), 0.0)
                    result.comm_elements[kind] = next(iter(elements.values()), 0.0)
                print(
                    f"round {r + 1}/{rounds} {c.name}: tps {result.tps[-1]:.0f}, "
                    f"peak {result.peak_gib[-1]:.2f} GiB, wall {result.wall_s[-1]:.0f}s",
                    flush=True,
                )
    return results


def pipe_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of `header` and `rows` (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(results: list[Result]) -> str:
    """The measured figures of `results`, one row per configuration."""
    header = ["config", "tps (median)", "peak memory GiB (steady)", "peak GiB (lifetime)"]
    header += ["collectives per step", "loss at last step", "wall s (median)"]
    rows = [
        [
            r.config.name,
            f"{r.median_tps:,.0f}",
            f"{r.max_peak_gib:.2f}",
            f"{max(r.lifetime_gib):.2f}",
            "-" if r.collectives != r.collectives else f"{r.collectives:.0f}",
            f"{r.final_loss:.4f}",
            f"{statistics.median(r.wall_s):.0f}",
        ]
        for r in results
    ]
    return pipe_table(header, rows)


def write_table(markdown_file: Path, table: str) -> None:
    """Replace what stands between `<!-- table -->` and `<!-- /table -->` in the file."""
    text = markdown_file.read_text()
    start, end = "<!-- table -->", "<!-- /table -->"
    head = text[: text.index(start) + len(start)]
    markdown_file.write_text(head + "\n" + table + "\n" + text[text.index(end) :])
