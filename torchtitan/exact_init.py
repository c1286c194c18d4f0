"""Initialise sharded (DTensor) parameters exactly as a single process would.

A leaf like `torch_private`: it knows torch only, so both the trainer and the planner
library use it.

DTensor's own random-number support covers CUDA-like devices only; on CPU each rank
would draw its shard from its own generator stream, so a model initialised on 4 ranks
would start from different weights than the same model on 1 rank.  Loss-curve tests
(and users comparing meshes) need the opposite: the same seed gives the same full
tensors on every mesh.  Real `init_weights` / `_init_weights` / `reset_parameters` also
write into parameters in ways DTensor alone gets wrong or refuses:

* **random fills** (`uniform_`, `normal_`, ...) on a DTensor draw the *full* tensor from the
  ordinary global generator — exactly the draw a single process makes, in the same order —
  and keep only this rank's shard (every rank holds the same generator state, so no
  communication is needed; the cost is one full-size temporary per parameter);
* **plain tensors written into DTensors** (`inv_freq.copy_(computed)`, `w.fill_(t)`) count as
  replicated, so each rank keeps its slice of the plain value;
* **writes through a view** (`weight[padding_idx].zero_()`, `w[:, 0] = 1`): when DTensor can
  only build the view by redistributing (a row of a row-sharded embedding), the view would be
  a temporary and the write silently lost.  Such a view is taken of the gathered full tensor
  instead, and every in-place op on it is copied back into the parameter's shard;
* **in-place ops DTensor refuses** (they would change the target's placement, e.g. an
  indexed write into a sharded dim) run on the full tensor and are copied back likewise.

Anything else that mixes plain tensors and DTensors fails as DTensor fails, with the
parameter's name added.  `exact_sharded_init()` is the dispatch mode doing this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from torchtitan.torch_private import (
    TorchDispatchMode,
    compute_local_shape_and_global_offset,
    get_current_dispatch_mode_stack,
    pytree,
)

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


def _is_inplace(func) -> bool:
    schema = func._schema
    return (
        bool(schema.arguments)
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.is_write
    )


def _local_slice(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _storage(t: DTensor) -> int:
    return t._local_tensor.untyped_storage().data_ptr()


def _shares_storage(a: DTensor, b: DTensor) -> bool:
    return _storage(a) == _storage(b)


class _ExactShardedInit(TorchDispatchMode):
    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names  # local storage of a DTensor -> parameter/buffer name, for messages
        # plain views of gathered full tensors -> (the full tensor, the DTensor it stands for)
        self.views: dict[int, tuple[torch.Tensor, DTensor]] = {}

    def _name(self, t: DTensor) -> str:
        return self.names.get(_storage(t), f"a sharded tensor of shape {tuple(t.shape)}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func.overloadpacket in _RANDOM_FILLS and isinstance(target, DTensor):
            return self._draw_full(func, target, args, kwargs)
        if (
            isinstance(target, torch.Tensor)
            and not isinstance(target, DTensor)
            and id(target) in self.views
        ):
            return self._on_full_view(func, target, args, kwargs)
        if not pytree.tree_any(lambda a: isinstance(a, DTensor), (args, kwargs)):
            return func(*args, **kwargs)
        try:
            with implicit_replication():
                out = func(*args, **kwargs)
        except Exception:
            if isinstance(target, DTensor) and _is_inplace(func):
                try:
                    return self._inplace_on_full(func, target, args, kwargs)
                except Exception as e_full:
                    e = e_full
            culprit = (
                target
                if isinstance(target, DTensor)
                else next(a for a in args if isinstance(a, DTensor))
            )
            raise RuntimeError(
                f"sharded init: {func} on '{self._name(culprit)}' failed: {e}"
            ) from e
        if (
            func.is_view
            and isinstance(target, DTensor)
            and isinstance(out, DTensor)
            and not _shares_storage(out, target)
        ):
            # DTensor redistributed to build this view: a write into it would be lost
            full = target.full_tensor()
            view = func(
                full, *pytree.tree_map_only(DTensor, lambda d: d.full_tensor(), args[1:]), **kwargs
            )
            self.views[id(view)] = (full, target)
            return view
        return out

    def _draw_full(self, func, target: DTensor, args, kwargs):
        full = torch.empty(target.shape, dtype=target.dtype, device=target._local_tensor.device)
        func(full, *args[1:], **kwargs)
        # src_data_rank=None: slice locally, no scatter — every rank drew the same values.
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target._local_tensor.copy_(shard._local_tensor)
        return target

    def _on_full_view(self, func, view: torch.Tensor, args, kwargs):
        full, target = self.views[id(view)]
        out = func(*args, **kwargs)
        if func.is_view and isinstance(out, torch.Tensor):
            self.views[id(out)] = (full, target)  # a view of the view writes back too
        if _is_inplace(func):
            target._local_tensor.copy_(_local_slice(full, target))
        return out

    def _inplace_on_full(self, func, target: DTensor, args, kwargs):
        full = target.full_tensor()
        rest = pytree.tree_map_only(DTensor, lambda d: d.full_tensor(), (args[1:], kwargs))
        func(full, *rest[0], **rest[1])
        target._local_tensor.copy_(_local_slice(full, target))
        return target


def _dispatch_modes() -> list:
    return list(get_current_dispatch_mode_stack())


@contextlib.contextmanager
def exact_sharded_init(model: nn.Module | None = None) -> Iterator[None]:
    """Run a model's `init_weights` so sharded parameters get single-process values.
    `model` (materialised, e.g. after `to_empty`) only serves to name parameters in errors."""
    if any(isinstance(m, _ExactShardedInit) for m in _dispatch_modes()):
        yield  # already inside one (the trainer's, around a model's own wrapper)
        return
    names: dict[int, str] = {}
    if model is not None:
        for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
            if isinstance(t, DTensor) and t.device.type != "meta":
                names.setdefault(_storage(t), fqn)
    with _ExactShardedInit(names):
        yield
