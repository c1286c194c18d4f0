"""The planner with its default memory bound against the best hand-written configuration,
4 CPU ranks, one interleaved run; and one rank, where no configuration communicates.

    .venv/bin/python benchmarks/best_config.py [--steps 10] [--rounds 2] [--no-compile]

Rows on 4 ranks (debug Llama 3, seq 256, global batch 8, fp32, eager): hand-written FSDP,
DDP, TP, FSDP × TP and HSDP, and `llama3_auto_parallel` on dp_shard 4 and with its own mesh
(`data_parallel_replicate_degree auto`, `tensor_parallel_degree auto`).  Neither the
planned rows nor the hand-written ones set a memory budget: the planner's default is what a
rank has (the machine's RAM shared by the ranks, less 10%), which every row here fits.  Then
one rank, hand-written and planned, eager and with `--compile.enable`.  Every configuration
runs once per round, rounds interleaved; step 3's collectives are counted with
torch.profiler and left out of the tps median.  Writes the table and the ratios into
benchmarks/best_config.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, pipe_table, write_table  # noqa: E402

DEBUG = ["--training.seq_len", "256"]
PARALLELISM = "--parallelism."


def _degrees(replicate: str, shard: str, tp: str, local_batch: int) -> list[str]:
    return [
        f"{PARALLELISM}data_parallel_replicate_degree",
        replicate,
        f"{PARALLELISM}data_parallel_shard_degree",
        shard,
        f"{PARALLELISM}tensor_parallel_degree",
        tp,
        "--training.local_batch_size",
        str(local_batch),
    ]


HAND_WRITTEN = {
    "FSDP 4": _degrees("1", "4", "1", 2),
    "DDP 4": _degrees("4", "1", "1", 2),
    "TP 4": _degrees("1", "1", "4", 8),
    "FSDP 2 x TP 2": _degrees("1", "2", "2", 4),
    "HSDP 2 x 2": _degrees("2", "2", "1", 2),
}
PLANNED = {
    "planned dp_shard 4": _degrees("1", "4", "1", 2),
    "planned, mesh searched": _degrees("auto", "-1", "auto", 2),
}
ONE_RANK = _degrees("1", "1", "1", 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="no compiled one-rank rows")
    args = parser.parse_args()
    configs = [
        Config(f"hand-written {n}", ["--model.name", "llama3", *DEBUG, *o])
        for n, o in HAND_WRITTEN.items()
    ]
    configs += [
        Config(n, ["--model.name", "llama3_auto_parallel", *DEBUG, *o]) for n, o in PLANNED.items()
    ]
    modes = {"eager": []} if args.no_compile else {"eager": [], "compiled": ["--compile.enable"]}
    for mode, extra in modes.items():
        for label, spec in (("hand-written", "llama3"), ("planned", "llama3_auto_parallel")):
            opts = ["--model.name", spec, *DEBUG, *ONE_RANK, *extra]
            configs.append(Config(f"one rank {mode} {label}", opts, nproc=1))
    cache = Path(__file__).resolve().parent.parent / ".cache" / "bench-inductor"
    results = measure(
        configs,
        args.steps,
        args.rounds,
        skip_steps=3,
        extra_args=["--metrics.count_collectives_step", "3"],
        inductor_cache=cache,
    )
    by_name = {r.config.name: r for r in results}
    best = max(
        (r for r in results if r.config.name.startswith("hand-written")), key=lambda r: r.median_tps
    )
    ratios = []
    for name in PLANNED:
        ratio = by_name[name].median_tps / best.median_tps
        ratios.append([f"{name} / best hand-written ({best.config.name})", f"{ratio:.2f}x"])
    for mode in modes:
        planned = by_name[f"one rank {mode} planned"]
        hand = by_name[f"one rank {mode} hand-written"]
        ratio = planned.median_tps / hand.median_tps
        ratios.append([f"one rank {mode}: planned / hand-written", f"{ratio:.2f}x"])
    table = markdown_table(results) + "\n\n" + pipe_table(["comparison", "tps ratio"], ratios)
    write_table(Path(__file__).with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
