"""Under torchrun (2 ranks, gloo): llama3's debug model cut into pipeline stages over the
two ranks, trained 3 steps with SGD under several schedules, against the whole model in
one process on every rank: every parameter's gradient at every step (rtol 1e-4) and the
loss.  Prints `PASS <schedule>` per schedule; exits non-zero at the first mismatch."""

from __future__ import annotations

import copy
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.distributed.pipeline import PipelineSplit, plan_stages, split_stages
from torchtitan.exact_init import exact_sharded_init
from torchtitan.models.llama3 import Transformer, llama3_configs

ARGS = llama3_configs["debugmodel"]
SPLIT = PipelineSplit(first=("tok_embeddings",), blocks="layers", last=("norm", "output"))
STEPS, BATCH, SEQ = 3, 4, 16


def cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())


def initialised(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad(), exact_sharded_init(model):
        model.init_weights()


@functools.cache
def _initialised_reference() -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    initialised(model)
    return model


def reference_model() -> torch.nn.Module:
    """The whole model in one process, initialised as the stages are: made once per process
    (the init is most of a check's time), a fresh copy per check."""
    return copy.deepcopy(_initialised_reference())


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, msg: Any
) -> None:
    """`torch.testing.assert_close` with a fast path for the common case: same shape, dtype
    and device and `torch.allclose` (the same elementwise rule) passes; otherwise its check
    and message."""
    same_kind = (actual.shape, actual.dtype, actual.device) == (
        expected.shape,
        expected.dtype,
        expected.device,
    )
    if not (same_kind and torch.allclose(actual, expected, rtol=rtol, atol=atol)):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)


def check(schedule: str, rank: int) -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    reference = reference_model()
    plan = plan_stages(ARGS.n_layers, 2, schedule, None, BATCH, 1, "llama3 debugmodel")
    stages = split_stages(model, SPLIT, plan, rank, 2)
    for i, part in enumerate(stages.parts):
        part.to_empty(device="cpu")
        with torch.random.fork_rng(), stages.whole_model(i, torch.device("cpu")) as whole:
            initialised(whole)
    stages.start(torch.device("cpu"), dist.group.WORLD, cross_entropy)
    params = [p for part in stages.parts for p in part.parameters()]
    ours, theirs = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=data)
        labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=data)
        theirs.zero_grad()
        ours.zero_grad()
        expected_loss = cross_entropy(reference(tokens), labels)
        expected_loss.backward()
        losses = stages.step(tokens, labels)
        if losses:
            torch.testing.assert_close(torch.stack(losses).mean(), expected_loss.detach())
        grads = {name: p.grad for name, p in reference.named_parameters()}
        for part in stages.parts:
            for name, p in part.named_parameters():
                assert_close(
                    p.grad, grads[name], rtol=1e-4, atol=1e-7, msg=f"{schedule} step {step} {name}"
                )
        ours.step()
        theirs.step()
    # one write per line: ranks share the pipe, and an unbuffered print writes the newline apart
    sys.stdout.write(f"PASS {schedule} rank {rank}: stages {stages.stage_ids}\n")
    sys.stdout.flush()


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for schedule in sys.argv[1:]:
        check(schedule, rank)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in teardown after all work is done


if __name__ == "__main__":
    sys.exit(main())
