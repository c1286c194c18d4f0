"""Stage 5: turn a plan into a runnable module with DTensor parameters.

The parallel module is a structural copy of the user's (meta) model whose parameters and
buffers are replaced, under their original FQNs, by meta DTensors with the planned
placements; its class is a dynamic subclass of the user's class, so `isinstance`, user
methods and `init_weights` keep working (`init_weights` runs under `exact_sharded_init`, so a
seed gives the same full tensors on any mesh).

`forward` runs the plan through the executor (executor.py): the joint graph lowered to local
forward and backward graphs with the plan's collectives, FSDP-bucketed.  Gradients land in the
parameters' placements, outputs come back as local tensors in the planned output placement,
and the caller passes local inputs (per-rank shards of the global-shaped example inputs).
The output gradients are divided by the number of ranks that split the batch, so a per-rank
mean loss yields the global-mean gradient (as DDP and FSDP do).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.exact_init import exact_sharded_init
from torchtitan.torch_private import compute_local_shape_and_global_offset

from ..graph import placements as P
from ..plan.plan import Plan
from ..policies.recompute import check_policy
from ..policies.units import unit_of
from ..trace.joint import TracedGraph
from .executor import LoweredExecutor
from .interpret import PlanInterpreter


class Executor(Protocol):
    def run(self, module: nn.Module, args: tuple) -> Any: ...

    def compile(self, options: dict | None = None) -> None: ...


def lowered_executor(
    tg: TracedGraph,
    plan: Plan,
    mesh: DeviceMesh,
    reduce_dtype: torch.dtype | None,
    units: list[str],
) -> LoweredExecutor:
    """The executor of `plan` on the whole model's graph `tg`: its placements, the units
    whose backward gathers again (`Plan.regathered`) and its recompute policies."""
    interp = PlanInterpreter(tg, plan, mesh, reduce_dtype)
    again = {u for u, yes in plan.regathered.items() if yes}
    kept = {f for f in tg.params if unit_of(f, units) not in again}
    recompute = {b: check_policy(p) for b, p in plan.recompute.items() if p != "none"}
    return LoweredExecutor(interp, kept, recompute, units)


def _meta_dtensor(t: torch.Tensor, mesh: DeviceMesh, pl: P.Placements) -> DTensor:
    local_shape, _ = compute_local_shape_and_global_offset(t.shape, mesh, pl)
    local = torch.empty(local_shape, dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())


def build_parallel_module(
    model: nn.Module, plan: Plan, mesh: DeviceMesh, executor: Executor
) -> nn.Module:
    """Copy `model` (on meta), swap in DTensor params/buffers, and route forward to
    `executor` (anything with `run(module, args)` and `compile(options)`)."""
    pm = copy.deepcopy(model)
    rep = tuple(Replicate() for _ in mesh.shape)
    # id(original tensor) -> placement, through every alias FQN
    pl_of: dict[int, P.Placements] = {}
    for fqn, p in pm.named_parameters(remove_duplicate=False):
        if fqn in plan.params:
            pl_of[id(p)] = P.parse(plan.params[fqn])
    for fqn, b in pm.named_buffers(remove_duplicate=False):
        if fqn in plan.buffers:
            pl_of[id(b)] = P.parse(plan.buffers[fqn])
    memo: dict[int, Any] = {}  # id of a meta tensor -> its DTensor (parameter)
    for mod in pm.modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            if id(param) not in memo:
                dt = _meta_dtensor(param.detach(), mesh, pl_of.get(id(param), rep))
                memo[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
            mod._parameters[name] = memo[id(param)]
        for name, buf in list(mod._buffers.items()):
            if buf is None:
                continue
            if id(buf) not in memo:
                memo[id(buf)] = _meta_dtensor(buf, mesh, pl_of.get(id(buf), rep))
            mod._buffers[name] = memo[id(buf)]

    user_cls = type(model)

    def forward(self, *args):
        return self._ap_executor.run(self, args)

    def compile(self, options: dict | None = None):
        """Run the plan's lowered local graphs compiled by inductor (executor.py); `options`
        are inductor config, as in `torch.compile(options=...)`."""
        self._ap_executor.compile(options)

    attrs: dict[str, Any] = {
        "forward": forward,
        "compile": compile,
        "__module__": user_cls.__module__,
    }
    if hasattr(user_cls, "init_weights"):

        def init_weights(self, *a, **kw):
            with exact_sharded_init(self):
                return user_cls.init_weights(self, *a, **kw)

        init_weights.__doc__ = getattr(user_cls.init_weights, "__doc__", None)
        attrs["init_weights"] = init_weights
    pm.__class__ = type(f"AutoParallel{user_cls.__name__}", (user_cls,), attrs)
    object.__setattr__(pm, "_ap_executor", executor)
    object.__setattr__(pm, "plan", plan)
    return pm
