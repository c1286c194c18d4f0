"""Bytes the forward leaves for the backward: hand-written vs planned, eager and compiled.

    .venv/bin/python benchmarks/saved_activations.py [--batch 8] [--seq-len 256]
        [--vocab 2048] [--layers 6] [--steps 3]

One process, one rank (a gloo group of one: the planned program has no collective), the
debug Llama 3 in fp32.  For each configuration, interleaved over `--steps` steps, the CPU
profiler's net allocation over the forward call (bytes allocated minus bytes freed while the
forward runs) is what the forward leaves alive: the values saved for the backward plus the
logits.  The logits are subtracted, the last step's figure is reported (the first compiles).
A count of bytes, not a time: it does not move with the machine's load.  The trainer's
per-step peak RSS (`benchmarks/auto_vs_manual.md`) also holds the parameters, gradients,
optimizer state and the process's heap; this isolates the activations.

Configurations: `hand-written` is the model as the trainer builds it for `llama3` (compiled:
each block `compile(fullgraph=True)`, as `parallelize_llama` does, so AOTAutograd's min-cut
partitioner chooses what to save); `planned` is `llama3_auto_parallel`'s program on a mesh of
one (compiled: the lowered graphs through inductor, executor.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB = 2**20
CONFIGS = ("hand-written eager", "planned eager", "hand-written compiled", "planned compiled")


def build(name: str, args, batch: int, seq: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.autoparallel import AutoParallel
    from torchtitan.models.llama3 import Transformer

    compiled = name.endswith("compiled")
    torch.manual_seed(0)
    if name.startswith("hand-written"):
        model = Transformer(args)
        model.init_weights()
        if compiled:
            for block in model.layers.values():
                block.compile(fullgraph=True)
        return model
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        meta = Transformer(args)
    example = lambda: torch.zeros(batch, seq, dtype=torch.long)  # noqa: E731
    with AutoParallel(meta, example, mesh) as autop:
        model = autop.apply_placement(autop.optimize_placement())
    model.to_empty(device="cpu")
    model.init_weights()
    if compiled:
        model.compile()
    return model


def forward_leaves(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    """(bytes the forward left allocated, bytes of its output); runs the backward after."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        out = model(tokens)
    net = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    local = out.to_local() if hasattr(out, "to_local") else out
    out_bytes = local.numel() * local.element_size()
    out.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return net, out_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    opts = ap.parse_args()

    import torch.distributed as dist

    from torchtitan.models.llama3 import llama3_configs

    args = dataclasses.replace(
        llama3_configs["debugmodel"],
        vocab_size=opts.vocab,
        max_seq_len=opts.seq_len,
        n_layers=opts.layers,
    )
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.seq_len))
    saved: dict[str, int] = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        models = {name: build(name, args, opts.batch, opts.seq_len) for name in CONFIGS}
        for _ in range(opts.steps):
            for name, model in models.items():
                net, out_bytes = forward_leaves(model, tokens)
                saved[name] = net - out_bytes
    finally:
        dist.destroy_process_group()
    print("| configuration | saved for the backward, MiB | planned / hand-written |")
    print("|---|---:|---:|")
    for name in CONFIGS:
        mode = name.split()[-1]
        ratio = saved[name] / saved[f"hand-written {mode}"]
        print(f"| {name} | {saved[name] / MiB:.1f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
