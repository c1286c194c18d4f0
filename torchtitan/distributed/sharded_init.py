"""Initialise sharded (DTensor) parameters exactly as a single process would.

DTensor's own random-number support covers CUDA-like devices only; on CPU each rank
would draw its shard from its own generator stream, so a model initialised on 4 ranks
would start from different weights than the same model on 1 rank.  Loss-curve tests
(and users comparing meshes) need the opposite: the same seed gives the same full
tensors on every mesh.

`exact_sharded_init()` is a dispatch mode: while it is active, an in-place random fill
(`uniform_`, `normal_`, ...) whose target is a DTensor draws the *full* tensor from the
ordinary global generator — exactly the draw a single process would make, in the same
order — and keeps only this rank's shard.  Every rank holds the same generator state
(same seed), so no communication is needed.  The cost is one full-size temporary per
parameter, released right after; deterministic fills (`ones_`, `zero_`, arithmetic
after the draw) run through DTensor unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# In-place fills that consume the random generator.
_RANDOM_FILLS = {
    _aten.uniform_,
    _aten.normal_,
    _aten.bernoulli_,
    _aten.exponential_,
    _aten.geometric_,
    _aten.log_normal_,
    _aten.cauchy_,
    _aten.random_,
}


class _FullDrawThenShard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func.overloadpacket not in _RANDOM_FILLS or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        local = target._local_tensor
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **kwargs)
        # src_data_rank=None: slice locally, no scatter — every rank drew the same values.
        shard = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        )
        local.copy_(shard._local_tensor)
        return target


@contextlib.contextmanager
def exact_sharded_init() -> Iterator[None]:
    """Run a model's `init_weights` so sharded parameters get single-process values."""
    with _FullDrawThenShard():
        yield
