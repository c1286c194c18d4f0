"""What a training step does besides computing, one rank: the planned spec against hand-written.

    .venv/bin/python benchmarks/step_overhead.py [--rounds 2] [--steps 3]

On one rank no configuration communicates, so what the planned step does beyond the
hand-written one is bookkeeping: the lowered graphs' autograd node, the DTensors its
parameters are, the wrapping of inputs.  Each spec trains the debug Llama 3 (seq 256, local
batch 8, fp32, one OpenMP thread) through `torchtitan.train` in a fresh process; after three
warm-up steps torch.profiler records `--steps` steps.  Reported per step: the calls of
DTensor's `to_local` and `from_local` autograd functions and the DTensors made
(`PythonSubclass`) — counted, so they do not move with the machine's load — the profiled
CPU time of every event, and the median step.  Rounds interleave the specs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_lib import pipe_table, write_table  # noqa: E402

SPECS = {"hand-written": "llama3", "planned": "llama3_auto_parallel"}
WARMUP = 3
COUNTED = {
    "to_local (autograd function)": "_ToTorchTensor",
    "to_local backward": "_ToTorchTensorBackward",
    "from_local (autograd function)": "_FromTorchTensor",
    "DTensors made (PythonSubclass)": "PythonSubclass",
}


def child(out: Path, steps: int) -> None:
    """Run the trainer (arguments from sys.argv), profiling steps WARMUP+1 .. WARMUP+steps."""
    import torch

    import torchtitan.train as train

    original = train.Trainer.train_step
    seen: dict = {"n": 0, "times": []}

    def train_step(self, data_iter):
        seen["n"] += 1
        if seen["n"] == WARMUP + 1:
            seen["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            seen["prof"].__enter__()
        start = time.perf_counter()
        result = original(self, data_iter)
        if seen["n"] > WARMUP:
            seen["times"].append(time.perf_counter() - start)
        if seen["n"] == WARMUP + steps:
            prof = seen.pop("prof")
            prof.__exit__(None, None, None)
            events = {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}
            out.write_text(json.dumps({"events": events, "times": seen["times"]}))
        return result

    train.Trainer.train_step = train_step
    train.main()


def run(spec: str, steps: int, folder: Path) -> dict:
    folder.mkdir(parents=True)
    out = folder / "events.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        __file__,
        "--child",
        str(out),
        "--steps",
        str(steps),
        "--job.config_file",
        str(REPO / "torchtitan/models/llama3/train_configs/debug_model.toml"),
        "--model.name",
        spec,
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        str(WARMUP + steps),
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(folder),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        sys.exit(f"error: {spec} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child is not None:
        sys.argv = [sys.argv[0], *rest]
        child(args.child, args.steps)
        return
    results: dict[str, list[dict]] = {name: [] for name in SPECS}
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        for r in range(args.rounds):
            for name, spec in SPECS.items():
                results[name].append(run(spec, args.steps, Path(tmp) / f"{name}-{r}"))
    header = ["spec", *COUNTED, "profiled CPU ms", "step ms (median)"]
    rows = []
    for name, runs in results.items():
        per_step = []
        for key in COUNTED.values():
            # one figure when the rounds agree, else one per round in round order
            counts = dict.fromkeys(run["events"].get(key, (0, 0))[0] / args.steps for run in runs)
            per_step.append(" / ".join(f"{c:g}" for c in counts))
        cpu = [sum(t for _, t in run["events"].values()) / 1e3 / args.steps for run in runs]
        steps_ms = [1e3 * statistics.median(run["times"]) for run in runs]
        rows.append(
            [
                name,
                *per_step,
                " / ".join(f"{c:.0f}" for c in cpu),
                " / ".join(f"{t:.0f}" for t in steps_ms),
            ]
        )
    table = pipe_table(header, rows)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)


if __name__ == "__main__":
    main()
