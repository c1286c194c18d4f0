"""The trainer's check that a model's `init_weights` set every parameter and buffer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def every_value_initialised(model: nn.Module, reduce: bool = True) -> Iterator[None]:
    """Around `init_weights` after `to_empty`: fill every floating parameter and buffer with
    NaN first, and afterwards raise naming those the init left untouched.  A model whose
    constructor sets a value that its `init_weights` does not (transformers' OpenAI-GPT
    `Conv1D`, Apertus' activation parameters) would otherwise train from whatever memory
    `to_empty` handed out — different on every run and every rank.  One all-reduce, so every
    rank names the same values (`reduce=False`: each rank checks its own, for ranks that
    hold different parameters, like pipeline stages)."""
    import torch.distributed as dist

    from torchtitan.errors import UserInputError

    named = [
        (n, t)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() or t.is_complex()
    ]
    with torch.no_grad():
        for _, t in named:
            t.fill_(float("nan"))
    yield
    now = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # init may reassign
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (now[n] for n, _ in named)]
    left = torch.tensor(
        [bool(torch.isnan(x).any()) for x in local],
        dtype=torch.uint8,
        device=local[0].device if local else "cpu",
    )
    if reduce and dist.is_available() and dist.is_initialized() and left.numel():
        dist.all_reduce(left, op=dist.ReduceOp.MAX)
    missing = [n for (n, _), flag in zip(named, left.tolist()) if flag]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserInputError(
            f"init_weights left {', '.join(missing[:3])}{more} uninitialised (still NaN after "
            "to_empty): the model's init must set every parameter and buffer"
        )
