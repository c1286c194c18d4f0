"""Start-up of a compiled job, cold and warm: the planned spec (`llama3_auto_parallel`,
whose lowered graphs go to inductor without dynamo) next to the hand-written one (`llama3`,
torch.compile per block), on dp_shard 4, one interleaved run.

    .venv/bin/python benchmarks/compile_cache.py [--rounds 2]

Debug Llama 3, seq 64, local batch 2, 2 steps, fp32, 4 CPU ranks (gloo).  Per round and spec:
a launch with an empty inductor cache (cold), then the same launch again on the cache it
filled (warm: a restart).  Wall seconds from launch to exit, median over rounds; with two
steps the start-up is nearly all of it.  Writes the table into benchmarks/compile_cache.md
(between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import pipe_table, write_table  # noqa: E402

from torchtitan.tools.loss_compare import deterministic_args, run_training  # noqa: E402

SPECS = {"hand-written FSDP 4": "llama3", "planned dp_shard 4": "llama3_auto_parallel"}
ARGS = [
    "--parallelism.data_parallel_shard_degree",
    "4",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--training.steps",
    "2",
    "--compile.enable",
    *deterministic_args(seed=42),
]


def launch(model: str, folder: Path, cache: Path) -> float:
    start = time.perf_counter()
    run = run_training(4, ["--model.name", model, *ARGS], folder, inductor_cache=cache)
    run.check()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    walls: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for r in range(opts.rounds):
            for name, model in SPECS.items():
                cache = Path(tmp) / f"inductor-{model}-{r}"
                for state in ("cold", "warm"):
                    wall = launch(model, Path(tmp) / f"{model}-{r}-{state}", cache)
                    walls.setdefault((name, state), []).append(wall)
                    print(f"round {r + 1}/{opts.rounds} {name} {state}: {wall:.1f}s", flush=True)
    rows = []
    for name in SPECS:
        cold = statistics.median(walls[(name, "cold")])
        warm = statistics.median(walls[(name, "warm")])
        rows.append([name, f"{cold:.1f}", f"{warm:.1f}", f"{warm / cold:.2f}"])
    table = pipe_table(["spec", "cold s", "warm s", "warm / cold"], rows)
    write_table(Path(__file__).with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
