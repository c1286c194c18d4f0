"""llama3_auto_parallel vs llama3 (hand-written) on the same meshes, 4 CPU ranks, one run.

    .venv/bin/python benchmarks/auto_vs_manual.py [--steps 12] [--rounds 2]

For dp4, tp4 and dp2×tp2 both specs train the debug model on the same global batch;
configurations are interleaved round by round.  Writes the table with the auto/manual
ratios into benchmarks/auto_vs_manual.md (between the markers) and prints it.  Planning
happens before step 1, so it is not in tps (the wall column includes it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, write_table  # noqa: E402

MESHES = {
    "dp4": ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"],
    "tp4": ["--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8"],
    "dp2 x tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    configs = []
    for mesh, opts in MESHES.items():
        configs.append(Config(f"{mesh} manual", ["--model.name", "llama3", *opts]))
        configs.append(Config(f"{mesh} auto", ["--model.name", "llama3_auto_parallel", *opts]))
    results = measure(configs, args.steps, args.rounds)
    lines = [markdown_table(results), "", "| mesh | auto/manual tps | auto/manual peak memory |",
             "|---|---|---|"]
    for i in range(0, len(results), 2):
        manual, auto = results[i], results[i + 1]
        mesh = manual.config.name.removesuffix(" manual")
        lines.append(f"| {mesh} | {auto.median_tps / manual.median_tps:.2f}x | "
                     f"{auto.max_peak_gib / manual.max_peak_gib:.2f}x |")
    table = "\n".join(lines)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)

if __name__ == "__main__":
    main()
