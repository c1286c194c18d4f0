"""Throughput and memory of the hand-written parallelisms on 4 CPU ranks (debug Llama 3).

    .venv/bin/python benchmarks/manual_parallel.py [--steps 12] [--rounds 2]

Writes the table into benchmarks/manual_parallel.md (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, write_table  # noqa: E402

DP4 = ["--training.local_batch_size", "2"]
CONFIGS = [
    Config("dp4 (FSDP)", DP4),
    Config("dp4 (FSDP) + full AC", DP4 + ["--activation_checkpoint.mode", "full"]),
    Config(
        "tp4 (TP+SP, loss parallel)",
        ["--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8"],
    ),
    Config(
        "dp2 x tp2 (FSDP+TP)",
        ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
    Config(
        "HSDP 2x2",
        DP4
        + [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    ),
    Config(
        "DDP 4",
        DP4
        + [
            "--parallelism.data_parallel_replicate_degree",
            "4",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = measure(CONFIGS, args.steps, args.rounds)
    table = markdown_table(results)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)


if __name__ == "__main__":
    main()
