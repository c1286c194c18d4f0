"""Under torchrun (4 ranks, gloo): llama3's debug model cut into two pipeline stages, each
stage planned by the auto-parallel planner on the mesh's other dims (the trainer's path:
`stage_io`, `split_stages`, the spec's `parallelize_fn` with `stage=`, the schedule's own
shape inference), trained 3 SGD steps against the whole model in one
process on every rank: every parameter's gradient at every step (rtol 1e-4) and each
microbatch's loss.

    torchrun --standalone --nproc_per_node=4 planned_pipeline_grads.py DUMP_FOLDER \
        pp2dp2 pp2tp2 pp2dp2zbv [compiled]

Prints `PASS <mesh>` per mesh; exits non-zero at the first mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from pipeline_grads import (
    ARGS,
    BATCH,
    SEQ,
    SPLIT,
    STEPS,
    assert_close,
    cross_entropy,
    initialised,
    reference_model,
)
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import plan_stages, split_stages, stage_io
from torchtitan.experiments.auto_parallel.parallelize import parallelize_llama_auto
from torchtitan.models.llama3 import Transformer

# the mesh's dims other than pp, and the schedule (the model, batch, steps, loss and init:
# the hand-written check's); ZBVZeroBubble runs a stage's backward twice (inputs' gradients,
# then the parameters')
MESHES = {
    "pp2dp2": (dict(dp_shard=2, tp=1), "1F1B"),
    "pp2tp2": (dict(dp_shard=1, tp=2), "1F1B"),
    "pp2dp2zbv": (dict(dp_shard=2, tp=1), "ZBVZeroBubble"),
}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(mesh_name: str, dump_folder: str, compiled: bool) -> None:
    degrees, schedule = MESHES[mesh_name]
    dims = ParallelDims(dp_replicate=1, **degrees, world_size=dist.get_world_size(), pp=2)
    dims.build_mesh("cpu")
    dp_mesh, pp_mesh = dims.dp_mesh(), dims.pp_mesh()
    assert pp_mesh is not None
    dp, dp_rank = dims.dp_degree, dp_mesh.get_local_rank() if dp_mesh is not None else 0
    job = JobConfig()
    job.job.dump_folder = os.path.join(dump_folder, mesh_name)
    job.training.seq_len, job.training.local_batch_size = SEQ, BATCH // dp
    job.compile.enable = compiled
    job.activation_checkpoint.mode = "none"

    with torch.device("meta"):
        model = Transformer(ARGS)
    reference = reference_model()
    plan = plan_stages(ARGS.n_layers, 2, schedule, None, BATCH // dp, 1, "llama3 debugmodel")
    io = stage_io(model, SPLIT, plan, torch.zeros(1, SEQ, dtype=torch.long), 2)
    stages = split_stages(model, SPLIT, plan, pp_mesh.get_local_rank(), 2)
    for i, stage_id in enumerate(stages.stage_ids):
        part = parallelize_llama_auto(stages.parts[i], dims, job, stage=io[stage_id])
        stages.parts[i] = part
        part.to_empty(device="cpu")
        with torch.random.fork_rng(), stages.whole_model(i, torch.device("cpu")) as whole:
            initialised(whole)
    stages.start(torch.device("cpu"), pp_mesh.get_group(), cross_entropy)

    params = [p for part in stages.parts for p in part.parameters()]
    ours, theirs = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    local = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=data)
        labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=data)
        theirs.zero_grad()
        ours.zero_grad()
        cross_entropy(reference(tokens), labels).backward()
        losses = stages.step(tokens[local], labels[local])
        if losses:  # this rank's microbatches (one sequence each), against one process's
            with torch.no_grad():
                expected = [
                    cross_entropy(reference(tokens[i : i + 1]), labels[i : i + 1])
                    for i in range(BATCH)[local]
                ]
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
        grads = {name: p.grad for name, p in reference.named_parameters()}
        for part in stages.parts:
            for name, p in part.named_parameters():
                assert p.grad is not None, f"{mesh_name} step {step} {name}: no gradient"
                assert_close(
                    full(p.grad),
                    grads[name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name, s=step: f"{mesh_name} step {s} {n}: {m}",
                )
        ours.step()
        theirs.step()
    mode = "compiled" if compiled else "eager"
    # one write per line: ranks share the pipe, and an unbuffered print writes the newline apart
    sys.stdout.write(f"PASS {mesh_name} rank {dist.get_rank()}: stages {stages.stage_ids} {mode}\n")
    sys.stdout.flush()


def main() -> int:
    dist.init_process_group("gloo")
    dump_folder, *names = sys.argv[1:]
    compiled = "compiled" in names
    for name in names:
        if name != "compiled":
            check(name, dump_folder, compiled)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in teardown after all work is done


if __name__ == "__main__":
    sys.exit(main())
