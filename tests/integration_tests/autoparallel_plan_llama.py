"""Dry-run the planner on a Llama3 flavor and a fake mesh in one process (no GPUs, no memory).

    python tests/integration_tests/autoparallel_plan_llama.py --flavor 8B --mesh 8,8 \
        --batch 8 --seq 2048 --device h100 [--save plan.json]

Prints the plan table (parameter placements, predicted compute/communication, stage timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.autoparallel import AutoParallel
from torchtitan.models.llama3.args import llama3_configs
from torchtitan.models.llama3.model import Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--mesh", default="8,8")
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--high", type=float, default=None, help="parameter memory budget (fraction)")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--save", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    shape = tuple(int(x) for x in a.mesh.split(","))
    names = ("dp", "tp")[: len(shape)] if len(shape) <= 2 else tuple(f"d{i}" for i in range(len(shape)))
    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    over = {"max_seq_len": a.seq}
    if a.vocab:
        over["vocab_size"] = a.vocab
    if a.layers:
        over["n_layers"] = a.layers
    args = dataclasses.replace(llama3_configs[a.flavor], **over)
    with torch.device("meta"):
        model = Transformer(args)
    vocab = args.vocab_size
    t0 = time.perf_counter()
    with AutoParallel(model, lambda: torch.randint(0, vocab, (a.batch, a.seq)), mesh,
                      cost_model=a.device, solver_time_limit=a.time_limit) as autop:
        autop.add_parameter_memory_constraint(high=a.high)
        pin = tuple(Shard(0) if i == 0 else Replicate() for i in range(len(shape)))
        autop.add_input_constraints([pin])
        autop.add_output_constraints([pin])
        plan = autop.optimize_placement()
    print(plan.table())
    print(f"total planning wall time {time.perf_counter() - t0:.1f}s; "
          f"peak RSS {__import__('resource').getrusage(0).ru_maxrss / 1e6:.2f} GB")
    if a.save:
        plan.save(a.save)


if __name__ == "__main__":
    main()
