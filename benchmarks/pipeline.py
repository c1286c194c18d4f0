"""Pipeline parallelism on 4 CPU ranks: each stage planned by the planner
(`llama3_auto_parallel`) next to the hand-written stages (`llama3`: FSDP / TP per stage),
one interleaved run.

    .venv/bin/python benchmarks/pipeline.py [--steps 8] [--rounds 2]

Debug Llama 3, seq 256, global batch 8, microbatches of one sequence, fp32, eager, gloo.
Four meshes and schedules: pp 2 x FSDP 2 (1F1B), pp 2 x TP 2 (Interleaved1F1B, two
stages a rank), pp 4 (GPipe), pp 2 x TP 2 (ZBVZeroBubble, V-shaped: two stages a rank);
and the planner choosing the pipeline degree, the schedule, the microbatch size and the
other degrees itself (`auto`; the mesh search's table is in its log).  Per
configuration: tokens/s (median over rounds of the
median steady step), rank 0's steady peak RSS, and rank 0's collectives at step 3 counted
with torch.profiler: the pipeline's point-to-point sends and receives, and all of them.
Writes the table into benchmarks/pipeline.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, measure, write_table  # noqa: E402

SEARCHED = "planned, pp / schedule / microbatch / tp auto"
MESHES = [
    ("pp2 x dp2, 1F1B", ["2", "1F1B", "2", "1", "4"]),
    ("pp2 x tp2, Interleaved1F1B", ["2", "Interleaved1F1B", "1", "2", "8"]),
    ("pp4, GPipe", ["4", "GPipe", "1", "1", "8"]),
    ("pp2 x tp2, ZBVZeroBubble", ["2", "ZBVZeroBubble", "1", "2", "8"]),
]


def args(model: str, pp: str, schedule: str, shard: str, tp: str, local_batch: str) -> list:
    return [
        "--model.name",
        model,
        "--parallelism.pipeline_parallel_degree",
        pp,
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.data_parallel_shard_degree",
        shard,
        "--parallelism.tensor_parallel_degree",
        tp,
        "--training.local_batch_size",
        local_batch,
        "--training.seq_len",
        "256",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    configs = [
        Config(f"{who} {mesh}", args(model, *options))
        for mesh, options in MESHES
        for who, model in (("hand-written", "llama3"), ("planned", "llama3_auto_parallel"))
    ]
    configs.append(
        Config(
            SEARCHED,
            [
                *args("llama3_auto_parallel", "auto", "auto", "-1", "auto", "2"),
                *("--parallelism.pipeline_parallel_microbatch_size", "auto"),
            ],
        )
    )
    results = measure(
        configs,
        opts.steps,
        opts.rounds,
        skip_steps=3,
        extra_args=["--metrics.count_collectives_step", "3"],
    )
    lines = [
        "| config | tps (median) | peak RSS GiB (steady) | sends / step | receives / step "
        "| collectives / step | loss at last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.config.name} | {r.median_tps:,.0f} | {r.max_peak_gib:.2f} | "
            f"{r.comm_calls.get('send', 0):.0f} | {r.comm_calls.get('recv', 0):.0f} | "
            f"{r.collectives:.0f} | {r.final_loss:.4f} |"
        )
    lines += ["", "| mesh | planned / hand-written tps | peak RSS |", "|---|---|---|"]
    for i, (mesh, _options) in enumerate(MESHES):
        manual, planned = results[2 * i], results[2 * i + 1]
        lines.append(
            f"| {mesh} | {planned.median_tps / manual.median_tps:.2f}x | "
            f"{planned.max_peak_gib / manual.max_peak_gib:.2f}x |"
        )
    fastest = max(results[: 2 * len(MESHES) : 2], key=lambda r: r.median_tps)
    searched = results[-1]
    lines += [
        "",
        f"{SEARCHED} / the fastest hand-written pipeline ({fastest.config.name}): "
        f"{searched.median_tps / fastest.median_tps:.2f}x tps, "
        f"{searched.max_peak_gib / fastest.max_peak_gib:.2f}x peak RSS",
    ]
    table = "\n".join(lines)
    write_table(Path(__file__).with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
