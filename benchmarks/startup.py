"""Start-up of an eager job: the planned spec next to the hand-written one on the same mesh,
and the planner with its own mesh next to the best hand-written configuration (DDP here,
`best_config.md`), 4 CPU ranks, one interleaved run.

    .venv/bin/python benchmarks/startup.py [--rounds 3]

Debug Llama 3, seq 64, local batch 2, fp32, gloo, a job of one step: wall seconds from the
launch to the end of step 1 and the exit (imports, process group, model, planning and
lowering for the planned spec, the step itself), median over rounds.  Writes the table into
benchmarks/startup.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import write_table  # noqa: E402

from torchtitan.tools.loss_compare import deterministic_args, run_training  # noqa: E402


def _spec(model: str, replicate: str, shard: str, tp: str) -> list[str]:
    return [
        "--model.name",
        model,
        "--parallelism.data_parallel_replicate_degree",
        replicate,
        "--parallelism.data_parallel_shard_degree",
        shard,
        "--parallelism.tensor_parallel_degree",
        tp,
    ]


SPECS = {
    "hand-written FSDP 4": _spec("llama3", "1", "4", "1"),
    "planned dp_shard 4": _spec("llama3_auto_parallel", "1", "4", "1"),
    "hand-written DDP 4": _spec("llama3", "4", "1", "1"),
    "planned, mesh searched": _spec("llama3_auto_parallel", "auto", "-1", "auto"),
}
# (planned, hand-written) pairs whose ratio the table gives
RATIOS = [
    ("planned dp_shard 4", "hand-written FSDP 4"),
    ("planned, mesh searched", "hand-written DDP 4"),
]
ARGS = [
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--training.steps",
    "1",
    *deterministic_args(seed=42),
]


def launch(args: list[str], folder: Path) -> float:
    start = time.perf_counter()
    run_training(4, [*args, *ARGS], folder).check()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    walls: dict[str, list[float]] = {name: [] for name in SPECS}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for r in range(opts.rounds):
            for name, args in SPECS.items():
                wall = launch(args, Path(tmp) / f"{r}-{len(walls[name])}-{args[1]}")
                walls[name].append(wall)
                print(f"round {r + 1}/{opts.rounds} {name}: {wall:.1f}s", flush=True)
    median = {name: statistics.median(w) for name, w in walls.items()}
    rows = ["| spec | launch to end of step 1, s (median) | rounds, s |", "|---|---|---|"]
    for name, w in walls.items():
        rows.append(f"| {name} | {median[name]:.1f} | {' / '.join(f'{x:.1f}' for x in w)} |")
    rows += ["", "| comparison | start-up ratio |", "|---|---|"]
    rows += [f"| {p} / {h} | {median[p] / median[h]:.2f}x |" for p, h in RATIOS]
    table = "\n".join(rows)
    write_table(Path(__file__).with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
