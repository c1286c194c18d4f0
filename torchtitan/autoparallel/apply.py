"""Stage 5: turn a plan into a runnable module with DTensor parameters.

The parallel module is a structural copy of the user's (meta) model whose parameters and
buffers are replaced, under their original FQNs, by meta DTensors with the planned
placements; its class is a dynamic subclass of the user's class, so `isinstance`, user
methods and `init_weights` keep working (`init_weights` runs under `exact_sharded_init`, so a
seed gives the same full tensors on any mesh).

`forward` interprets the traced *forward* graph over DTensors: before each op, every tensor
input is redistributed to the placement the plan chose for that op (these are the plan's
collectives), then the ATen op runs through DTensor.  Autograd through DTensor produces the
backward (gradients arrive in the parameters' placements).  Outputs are redistributed to the
planned output placement and returned as local tensors; the caller passes local inputs
(per-rank shards of the global-shaped example inputs).

With `grad_reduction="mean"` (default, like DDP/FSDP) the output gradients are divided by the
number of ranks that split the batch, so a per-rank mean loss yields the global-mean gradient.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import _pytree as pytree

from . import placements as P
from .errors import PlannerError
from .plan import Plan, graph_fingerprint
from .trace import TracedGraph, is_getitem


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _meta_dtensor(t: torch.Tensor, mesh: DeviceMesh, pl: P.Placements) -> DTensor:
    local_shape, _ = compute_local_shape_and_global_offset(t.shape, mesh, pl)
    local = torch.empty(local_shape, dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())


class GraphRunner:
    """Executes the forward part of the traced graph over DTensors following a plan."""

    def __init__(self, tg: TracedGraph, plan: Plan, mesh: DeviceMesh,
                 reduce_dtype: torch.dtype | None = None, grad_reduction: str = "mean"):
        if plan.graph_fingerprint and plan.graph_fingerprint != graph_fingerprint(tg.gm):
            raise PlannerError("plan was made for a different traced graph (fingerprint mismatch)")
        if list(plan.mesh_shape) != list(mesh.shape):
            raise PlannerError(f"plan is for mesh {plan.mesh_shape}, got mesh {list(mesh.shape)}")
        if grad_reduction not in ("mean", "sum"):
            raise PlannerError(f"grad_reduction must be 'mean' or 'sum', got '{grad_reduction}'")
        self.tg, self.plan, self.mesh = tg, plan, mesh
        self.reduce_dtype = reduce_dtype
        self.grad_reduction = grad_reduction
        self.order = [n for n in tg.gm.graph.nodes
                      if n in tg.forward_nodes and n.op == "call_function"]
        self.ins = {name: [P.parse(s) if s != "-" else None for s in d["ins"]]
                    for name, d in plan.nodes.items()}
        missing = [n.name for n in self.order if not is_getitem(n) and n.name not in self.ins
                   and isinstance(n.meta.get("val"), (torch.Tensor, list, tuple))]
        if missing:
            raise PlannerError(f"plan has no entry for graph node '{missing[0]}'")
        self.input_pls = [P.parse(s) for s in plan.inputs]
        self.output_pls = [P.parse(s) for s in plan.outputs]
        self.param_of = {n: f for f, n in tg.params.items()}
        self.buffer_of = {n: f for f, n in tg.buffers.items()}

    def _batch_ranks(self) -> int:
        if not self.input_pls:
            return 1
        return math.prod(n for p, n in zip(self.input_pls[0], self.mesh.shape) if isinstance(p, Shard))

    def _redistribute(self, v: DTensor, pl: P.Placements) -> DTensor:
        if v.placements == pl:
            return v
        if any(p.is_partial() and q != p for p, q in zip(pl, v.placements)):
            return v  # never created by the plan; let DTensor decide
        bwd = None
        if self.reduce_dtype is not None and v.dtype.is_floating_point and \
                v.dtype.itemsize < self.reduce_dtype.itemsize:
            bwd = self.reduce_dtype
        return v.redistribute(self.mesh, pl, backward_dtype=bwd)

    def _wrap_input(self, i: int, x: Any, node: fx.Node) -> DTensor:
        val = node.meta["val"]
        if not isinstance(x, torch.Tensor):
            raise PlannerError(f"input {i} must be a tensor, got {type(x).__name__}")
        if isinstance(x, DTensor):
            return x.redistribute(self.mesh, self.input_pls[i]) if x.placements != self.input_pls[i] else x
        pl = self.input_pls[i]
        expect, _ = compute_local_shape_and_global_offset(val.shape, self.mesh, pl)
        if tuple(x.shape) != tuple(expect):
            raise PlannerError(
                f"input {i} has local shape {tuple(x.shape)}, expected {tuple(expect)} "
                f"(global {tuple(val.shape)} with placement {P.fmt(pl)}; pass this rank's shard)")
        return DTensor.from_local(x, self.mesh, pl, run_check=False, shape=val.shape,
                                  stride=val.stride())

    def run(self, module: nn.Module, args: tuple) -> Any:
        tg = self.tg
        flat, _ = pytree.tree_flatten(args)
        if len(flat) != len(tg.inputs):
            raise PlannerError(f"expected {len(tg.inputs)} inputs, got {len(flat)}")
        env: dict[fx.Node, Any] = {}
        device = None
        for fqn, node in tg.params.items():
            p = module.get_parameter(fqn)
            env[node] = p
            device = device or (p.to_local().device if isinstance(p, DTensor) else p.device)
        rep = tuple(Replicate() for _ in self.mesh.shape)
        for fqn, node in tg.buffers.items():
            b = module.get_buffer(fqn)
            if not isinstance(b, DTensor):
                b = DTensor.from_local(b, self.mesh, rep, run_check=False)
            env[node] = b
        for i, (x, node) in enumerate(zip(flat, tg.inputs)):
            env[node] = self._wrap_input(i, x, node)
            device = device or x.device

        for node in self.order:
            if is_getitem(node):
                parent, idx = node.args
                env[node] = env[parent][idx]
                continue
            targets = self.ins.get(node.name, [])
            counter = iter(range(len(targets)))

            def conv(a):
                if isinstance(a, fx.Node):
                    v = env[a]
                    if isinstance(a.meta.get("val"), torch.Tensor):
                        k = next(counter, None)
                        if k is not None and isinstance(v, DTensor) and targets[k] is not None:
                            v = self._redistribute(v, targets[k])
                    return v
                if isinstance(a, (list, tuple)):
                    return type(a)(conv(x) for x in a)
                return a

            args_ = tuple(conv(a) for a in node.args)
            kwargs = {k: conv(v) for k, v in node.kwargs.items()}
            has_tensor_input = any(isinstance(x.meta.get("val"), torch.Tensor) for x in node.all_input_nodes)
            if not has_tensor_input:
                if "device" in kwargs and device is not None:
                    kwargs["device"] = device
                out = node.target(*args_, **kwargs)
                if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
                    out = DTensor.from_local(out, self.mesh, rep, run_check=False)
            else:
                out = node.target(*args_, **kwargs)
            env[node] = out

        outs = []
        scale = 1.0 / self._batch_ranks() if self.grad_reduction == "mean" else 1.0
        for i, node in enumerate(tg.outputs):
            v = env[node]
            if isinstance(v, DTensor):
                v = self._redistribute(v, self.output_pls[i]).to_local()
            if scale != 1.0 and v.requires_grad:
                v = _ScaleGrad.apply(v, scale)
            outs.append(v)
        spec = tg.output_spec
        spec = getattr(spec, "spec", spec)
        if spec is not None:
            try:
                return pytree.tree_unflatten(outs, spec)
            except Exception:
                pass
        return outs[0] if len(outs) == 1 else tuple(outs)


def build_parallel_module(model: nn.Module, tg: TracedGraph, plan: Plan, mesh: DeviceMesh,
                          runner: GraphRunner) -> nn.Module:
    """Copy `model` (on meta), swap in DTensor params/buffers, and route forward to `runner`."""
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
    memo: dict[int, torch.Tensor] = {}
    for mod in pm.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                dt = _meta_dtensor(p.detach(), mesh, pl_of.get(id(p), rep))
                memo[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = _meta_dtensor(b, mesh, pl_of.get(id(b), rep))
            mod._buffers[name] = memo[id(b)]

    user_cls = type(model)

    def forward(self, *args):
        return self._ap_runner.run(self, args)

    attrs: dict[str, Any] = {"forward": forward, "__module__": user_cls.__module__}
    if hasattr(user_cls, "init_weights"):
        def init_weights(self, *a, **kw):
            from torchtitan.distributed.sharded_init import exact_sharded_init
            with exact_sharded_init():
                return user_cls.init_weights(self, *a, **kw)
        init_weights.__doc__ = getattr(user_cls.init_weights, "__doc__", None)
        attrs["init_weights"] = init_weights
    pm.__class__ = type(f"AutoParallel{user_cls.__name__}", (user_cls,), attrs)
    object.__setattr__(pm, "_ap_runner", runner)
    object.__setattr__(pm, "plan", plan)
    return pm
