"""A Hugging Face Llama through the planner vs our Llama 3 of the same shape, 4 CPU ranks.

    .venv/bin/python benchmarks/hf_vs_llama3.py [--steps 10] [--rounds 2]

`hf_auto_parallel` with `tests/assets/hf_llama_debug` (transformers' LlamaForCausalLM: dim
256, 6 layers, 16 heads, FFN 768, vocab 2000) against `llama3_auto_parallel` with the debug
flavor (the same shape), on dp4, tp4 and dp2×tp2 (seq 256, global batch 8), eager.  Both
are planned by the same planner from a fresh cache (planning time from the trainer's log)
and run by the same executor; configurations interleave over rounds.  Writes the table into
benchmarks/hf_vs_llama3.md between the markers and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, write_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODELS = {
    "llama3": ["--model.name", "llama3_auto_parallel"],
    "hf llama": [
        "--model.name",
        "hf_auto_parallel",
        "--model.flavor",
        str(REPO / "tests/assets/hf_llama_debug"),
    ],
}
MESHES = {
    "dp4": ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"],
    "tp4": ["--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8"],
    "dp2 x tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    configs = [
        Config(f"{mesh} {model}", ["--training.seq_len", "256", *m_opts, *opts])
        for mesh, opts in MESHES.items()
        for model, m_opts in MODELS.items()
    ]
    results = measure(
        configs,
        args.steps,
        args.rounds,
        skip_steps=3,
        extra_args=["--metrics.count_collectives_step", "3"],
    )
    lines = [
        markdown_table(results),
        "",
        "| mesh | planning s llama3 / hf | hf/llama3 tps | collectives llama3 / hf |",
        "|---|---|---|---|",
    ]
    for i in range(0, len(results), 2):
        ours, hf = results[i], results[i + 1]
        mesh = ours.config.name.removesuffix(" llama3")
        lines.append(
            f"| {mesh} | {statistics.median(ours.plan_s):.1f} / "
            f"{statistics.median(hf.plan_s):.1f} | "
            f"{hf.median_tps / ours.median_tps:.2f}x | "
            f"{ours.collectives:.0f} / {hf.collectives:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)


if __name__ == "__main__":
    main()
