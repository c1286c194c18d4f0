"""The AdamW step of the trainer's parameters, by implementation: foreach against fused.

    .venv/bin/python benchmarks/optimizer_step.py [--rounds 3] [--steps 10] [--layers 6]

One process per parameter layout, the debug Llama 3's parameters (fp32) as one rank of each
holds them: plain tensors (one rank, DDP); FSDP over 4 ranks (DTensors, dim 0 split); the
planner's own plans on dp_shard 4 and dp 2 x tp 2 (DTensors in the plan's placements) and on
a mesh of one.  The 4-rank worlds are fake process groups (an optimizer step communicates
nothing).  Each run is a fresh process (DTensor's caches empty): the trainer's AdamW
(`components/optimizer.py`), random gradients, the first step and `--steps` more; rounds
interleave every layout and implementation.  Reported: the first step's milliseconds
and the sharding propagations DTensor computed for it (cache misses; counted, so they do not
move with the machine's load), the median later step and the propagations per later step.

A foreach step is a dozen multi-tensor ops over lists of DTensors; DTensor propagates the
sharding of each such op over the whole list the first time it sees the list's placements.
The fused step is one op.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_lib import pipe_table, write_table  # noqa: E402

LAYOUTS = {
    "one rank / DDP (plain tensors)": None,
    "FSDP dp_shard 4 (DTensor)": None,
    "planned dp_shard 4 (DTensor)": ((4,), ("dp",)),
    "planned dp 2 x tp 2 (DTensor)": ((2, 2), ("dp", "tp")),
    "planned, mesh of one (DTensor)": ((1,), ("dp",)),
}
IMPLEMENTATIONS = ("foreach", "fused")  # the trainer's former default, and its default


def _parameters(layout: str, layers: int) -> list[torch.nn.Parameter]:
    """The parameters rank 0 of `layout` holds, materialised and initialised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.autoparallel import AutoParallel
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.model import Transformer

    vocab = HuggingFaceTokenizer(str(REPO / "tests/assets/tokenizer")).vocab_size
    args = dataclasses.replace(
        llama3_configs["debugmodel"], n_layers=layers, max_seq_len=256, vocab_size=vocab
    )
    if layout.startswith("one rank"):
        model = Transformer(args)
        model.init_weights()
        return list(model.parameters())
    fsdp = layout.startswith("FSDP")
    shape, names = ((4,), ("dp",)) if fsdp else LAYOUTS[layout]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if fsdp:
        model = Transformer(args)
        model.init_weights()
        chunks = [p.detach().chunk(4)[0].clone() for p in model.parameters()]
        return [
            torch.nn.Parameter(DTensor.from_local(c, mesh, (Shard(0),), run_check=False))
            for c in chunks
        ]
    with torch.device("meta"):
        model = Transformer(args)
    batch = 8 if shape != (2, 2) else 4
    with AutoParallel(model, lambda: torch.zeros(batch, 256, dtype=torch.long), mesh) as autop:
        planned = autop.apply_placement(autop.optimize_placement())
    planned.to_empty(device="cpu")
    planned.init_weights()
    return list(planned.parameters())


class _CountPropagations:
    """Counts DTensor's sharding propagations that miss its cache."""

    def __init__(self) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self.count = 0
        original = ShardingPropagator.propagate_op_sharding_non_cached

        def counted(prop, op_schema):
            self.count += 1
            return original(prop, op_schema)

        ShardingPropagator.propagate_op_sharding_non_cached = counted


def measure(layout: str, impl: str, steps: int, layers: int) -> dict:
    """One fresh process's first AdamW step and `steps` more, `impl` on `layout`."""
    from torch.distributed.tensor import DTensor

    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig

    torch.set_num_threads(1)
    params = _parameters(layout, layers)
    counter = _CountPropagations()
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
        g = torch.randn(p.to_local().shape if isinstance(p, DTensor) else p.shape, generator=gen)
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    cfg = JobConfig()
    cfg.optimizer.implementation = impl
    opt = build_optimizers([module], cfg)
    t = time.perf_counter()
    opt.step()
    first_ms, first_props = (time.perf_counter() - t) * 1e3, counter.count
    later, counter.count = [], 0
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        later.append((time.perf_counter() - t) * 1e3)
    return {
        "first_ms": first_ms,
        "first_propagations": first_props,
        "later_ms": statistics.median(later),
        "later_propagations": counter.count / steps,
    }


def table(results: dict[str, dict]) -> str:
    """The figures per layout and implementation, then the fused / foreach ratios; a count
    that differs between rounds is given per round, in round order."""
    header = ["parameters", "implementation", "first step ms (median)"]
    header += ["sharding propagations, first step", "later step ms (median)"]
    header += ["sharding propagations per later step"]
    rows, ratios = [], []
    for layout, per_impl in results.items():
        med = {}
        for impl, runs in per_impl.items():
            first = statistics.median(r["first_ms"] for r in runs)
            later = statistics.median(r["later_ms"] for r in runs)
            med[impl] = (first, later)
            props = dict.fromkeys(r["first_propagations"] for r in runs)
            per_step = dict.fromkeys(r["later_propagations"] for r in runs)
            rows.append(
                [
                    layout,
                    impl,
                    f"{first:,.1f}",
                    "/".join(map(str, props)),
                    f"{later:,.1f}",
                    "/".join(f"{x:g}" for x in per_step),
                ]
            )
        fused, foreach = med["fused"], med["foreach"]
        ratios.append([layout, f"{fused[0] / foreach[0]:.2f}x", f"{fused[1] / foreach[1]:.2f}x"])
    ratio_header = ["parameters", "fused / foreach, first step", "fused / foreach, later step"]
    return pipe_table(header, rows) + "\n\n" + pipe_table(ratio_header, ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--layout", help=argparse.SUPPRESS)  # a child process: one run
    parser.add_argument("--implementation", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.layout:
        print(json.dumps(measure(opts.layout, opts.implementation, opts.steps, opts.layers)))
        return 0
    results: dict[str, dict[str, list]] = {
        layout: {impl: [] for impl in IMPLEMENTATIONS} for layout in LAYOUTS
    }
    for r in range(opts.rounds):
        for layout in LAYOUTS:
            for impl in IMPLEMENTATIONS:
                cmd = [sys.executable, __file__, "--layout", layout, "--implementation", impl]
                cmd += ["--steps", str(opts.steps), "--layers", str(opts.layers)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if out.returncode != 0:
                    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"error: {layout}, {impl}: {last}", file=sys.stderr)
                    return 1
                results[layout][impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}: {layout}, {impl}: done", file=sys.stderr)
    text = table(results)
    print(text)
    write_table(REPO / "benchmarks" / "optimizer_step.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
