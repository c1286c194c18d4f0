"""llama3_auto_parallel vs llama3 (hand-written) on the same meshes, 4 CPU ranks, one run.

    .venv/bin/python benchmarks/auto_vs_manual.py [--steps 10] [--rounds 2] [--no-compile]

Rows: dp4, tp4 and dp2×tp2 on the debug model (seq 256, global batch 8), eager and with
`--compile.enable`, plus dp4 on `debugmodel_large` (dim 512, 8 layers, seq 512, global
batch 4), where compute weighs more than per-op overhead.  Every configuration is run once
per round, rounds interleaved, so machine noise hits both specs alike.  Step 3's collectives
are counted with torch.profiler (`--metrics.count_collectives_step 3`) and that step is left
out of the tps median.  Planning and compiling happen before step 2, so they are not in tps
(the wall column includes them).  The planned rows hold each rank to FSDP's share of the
parameters (`--autoparallel.max_parameter_fraction fsdp`), so both specs keep the same
parameter memory and the comparison is of sharding on one mesh; the planner's default
(replicate where memory allows) is measured against every hand-written configuration in
benchmarks/best_config.py.  Writes the table with the auto/manual ratios into
benchmarks/auto_vs_manual.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, pipe_table, write_table  # noqa: E402

DEBUG = ["--training.seq_len", "256"]
MESHES = {
    "dp4": ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"],
    "tp4": ["--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8"],
    "dp2 x tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
}
LARGE = {
    "dp4 large": [
        "--model.flavor",
        "debugmodel_large",
        "--training.seq_len",
        "512",
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--training.local_batch_size",
        "1",
    ]
}
COMPILE = ["--compile.enable"]
FSDP_SHARE = [
    "--job.custom_config_module",
    "torchtitan.experiments.auto_parallel.job_config",
    "--autoparallel.max_parameter_fraction",
    "fsdp",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    args = parser.parse_args()
    rows = {f"{m}": DEBUG + o for m, o in MESHES.items()}
    if not args.no_compile:
        rows.update({f"{m} compiled": DEBUG + o + COMPILE for m, o in MESHES.items()})
    rows.update(LARGE)
    configs = []
    for row, opts in rows.items():
        configs.append(Config(f"{row} manual", ["--model.name", "llama3", *opts]))
        configs.append(
            Config(f"{row} auto", ["--model.name", "llama3_auto_parallel", *opts, *FSDP_SHARE])
        )
    cache = Path(__file__).resolve().parent.parent / ".cache" / "bench-inductor"
    results = measure(
        configs,
        args.steps,
        args.rounds,
        skip_steps=3,
        extra_args=["--metrics.count_collectives_step", "3"],
        inductor_cache=cache,
    )
    ratios = []
    for i in range(0, len(results), 2):
        manual, auto = results[i], results[i + 1]
        ratios.append(
            [
                manual.config.name.removesuffix(" manual"),
                f"{auto.median_tps / manual.median_tps:.2f}x",
                f"{auto.max_peak_gib / manual.max_peak_gib:.2f}x",
                f"{auto.collectives:.0f} / {manual.collectives:.0f}",
            ]
        )
    header = ["row", "auto/manual tps", "auto/manual peak memory", "collectives auto / manual"]
    table = markdown_table(results) + "\n\n" + pipe_table(header, ratios)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)


if __name__ == "__main__":
    main()
