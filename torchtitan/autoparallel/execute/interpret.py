"""Stage 5 (interpret): the traced joint graph run op by op over DTensors, as the plan says.

Before each op every tensor input is redistributed to the placement the plan chose for that
op (once per value and placement, through the value's hub where the plan has one, as the
solver priced it), then the ATen op runs through DTensor.  The lowering (lower.py) traces
exactly this over DTensors that wrap local tensors, so what it records are local ops and the
plan's collectives.  The interpreter holds only what the plan and the graph fix; it keeps no
state between calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.torch_private import compute_local_shape_and_global_offset

from ..errors import PlannerError
from ..graph import placements as P
from ..graph.nodes import is_getitem
from ..ops.collective_ops import COLLECTIVE_OPS
from ..plan.plan import Plan, graph_fingerprint
from ..trace.joint import TracedGraph

REDISTRIBUTED = "redistributed"  # env key: node -> {placement: redistributed value}


class PlanInterpreter:
    """Runs nodes of `tg` over DTensors with the placements of `plan` on `mesh`; with
    `reduce_dtype` a low-precision value's gradient is redistributed in that dtype."""

    def __init__(
        self,
        tg: TracedGraph,
        plan: Plan,
        mesh: DeviceMesh,
        reduce_dtype: torch.dtype | None = None,
    ):
        _check_plan_fits(tg, plan, mesh)
        self.tg, self.plan, self.mesh, self.reduce_dtype = tg, plan, mesh, reduce_dtype
        self.ins = {
            name: [P.parse(s) if s != "-" else None for s in d["ins"]]
            for name, d in plan.nodes.items()
        }
        self.outs = {
            name: [P.parse(s) if s != "-" else None for s in d.get("out", [])]
            for name, d in plan.nodes.items()
        }
        self.hubs = _hubs(tg, plan)
        self.grad_pls = {f: P.parse(s) for f, s in plan.grads.items()}
        self.input_pls = [P.parse(s) for s in plan.inputs]
        self.output_pls = [P.parse(s) for s in plan.outputs]
        self.param_of = {n: f for f, n in tg.params.items()}
        self.buffer_of = {n: f for f, n in tg.buffers.items()}
        # tensors the model's forward creates from Python values (`torch.tensor([-2])`) are
        # attributes of the traced graph: the same on every rank, so replicated
        self.constants = {
            n: getattr(tg.gm, n.target)
            for n in tg.gm.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(tg.gm, n.target), torch.Tensor)
        }
        missing = [
            n.name
            for n in tg.gm.graph.nodes
            if n in tg.forward_nodes
            and n.op == "call_function"
            and not is_getitem(n)
            and n.name not in self.ins
            and isinstance(n.meta.get("val"), (torch.Tensor, list, tuple))
        ]
        if missing:
            raise PlannerError(f"plan has no entry for graph node '{missing[0]}'")

    # ------------------------------------------------------------------ values
    def placeholders(self, module: nn.Module, flat: list) -> tuple[dict[fx.Node, Any], Any]:
        """The graph's inputs as DTensors: `module`'s parameters and buffers (a plain buffer
        counts as replicated) and this rank's local inputs; and the device they are on."""
        tg = self.tg
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
        return env, device

    def constant_values(self, device) -> dict[fx.Node, DTensor]:
        """The graph's constant tensors as replicated DTensors on `device`."""
        rep = tuple(Replicate() for _ in self.mesh.shape)
        return {
            n: DTensor.from_local(c.to(device), self.mesh, rep, run_check=False)
            for n, c in self.constants.items()
        }

    def local_output_meta(self, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Local shape and dtype of forward output i in its planned placement."""
        val = self.tg.outputs[i].meta["val"]
        shape, _ = compute_local_shape_and_global_offset(val.shape, self.mesh, self.output_pls[i])
        return tuple(shape), val.dtype

    def batch_ranks(self) -> int:
        """How many ranks split the batch (the first input's sharded mesh dims)."""
        if not self.input_pls:
            return 1
        return math.prod(
            n for p, n in zip(self.input_pls[0], self.mesh.shape) if isinstance(p, Shard)
        )

    def _wrap_input(self, i: int, x: Any, node: fx.Node) -> DTensor:
        val = node.meta["val"]
        if not isinstance(x, torch.Tensor):
            raise PlannerError(f"input {i} must be a tensor, got {type(x).__name__}")
        if isinstance(x, DTensor):
            return (
                x.redistribute(self.mesh, self.input_pls[i])
                if x.placements != self.input_pls[i]
                else x
            )
        pl = self.input_pls[i]
        expect, _ = compute_local_shape_and_global_offset(val.shape, self.mesh, pl)
        if tuple(x.shape) != tuple(expect):
            raise PlannerError(
                f"input {i} has local shape {tuple(x.shape)}, expected {tuple(expect)} "
                f"(global {tuple(val.shape)} with placement {P.fmt(pl)}; pass this rank's shard)"
            )
        return DTensor.from_local(
            x, self.mesh, pl, run_check=False, shape=val.shape, stride=val.stride()
        )

    # ------------------------------------------------------------------ ops
    def redistribute(self, v: DTensor, pl: P.Placements) -> DTensor:
        """`v` in placement `pl` (a low-precision value's gradient reduced in the reduce
        dtype)."""
        if v.placements == pl:
            return v
        if any(p.is_partial() and q != p for p, q in zip(pl, v.placements)):
            return v  # never created by the plan; let DTensor decide
        bwd = None
        if (
            self.reduce_dtype is not None
            and v.dtype.is_floating_point
            and v.dtype.itemsize < self.reduce_dtype.itemsize
        ):
            bwd = self.reduce_dtype
        return v.redistribute(self.mesh, pl, backward_dtype=bwd)

    def run_node(self, node: fx.Node, env: dict, device) -> None:
        """Run one graph node: redistribute tensor inputs to the plan's placements, then the
        op; its value goes into `env`."""
        if is_getitem(node):
            parent, idx = node.args
            env[node] = env[parent][idx]
            return
        targets = self.ins.get(node.name, [])
        counter = iter(range(len(targets)))

        def convert(a: fx.Node):
            # Not recursive (fx.map_arg walks nested args): a self-referencing closure
            # would form a reference cycle holding `env`, i.e. every activation, until
            # the garbage collector ran.
            v = env[a]
            if isinstance(a.meta.get("val"), torch.Tensor):
                k = next(counter, None)
                target = targets[k] if k is not None else None
                if target is not None and isinstance(v, DTensor):
                    v = self._placed(a, v, target, env)
            return v

        op = cast(Callable[..., Any], node.target)  # a call_function node's callable
        args_ = tuple(fx.node.map_arg(node.args, convert))
        kwargs = dict(fx.node.map_arg(node.kwargs, convert))
        if not any(isinstance(x.meta.get("val"), torch.Tensor) for x in node.all_input_nodes):
            if "device" in kwargs and device is not None:
                kwargs["device"] = device
            out = op(*args_, **kwargs)
            if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
                rep = tuple(Replicate() for _ in self.mesh.shape)
                out = DTensor.from_local(out, self.mesh, rep, run_check=False)
        else:
            out = self._collective(node, args_) if node.target in COLLECTIVE_OPS else None
            if out is None:
                out = op(*args_, **kwargs)
        env[node] = out

    def _collective(self, node: fx.Node, args: tuple) -> Any:
        """An op with a collective inside (ops/collective_ops.py) in a strategy that uses
        it: run on local tensors; None for its other strategies (DTensor runs those)."""
        val = node.meta["val"]
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        outs = COLLECTIVE_OPS[node.target].run_local(args, vals, self.outs[node.name], self.mesh)
        if outs is None:
            return None
        return outs if isinstance(val, (list, tuple)) else outs[0]

    def _placed(self, a: fx.Node, v: DTensor, target: P.Placements, env: dict) -> DTensor:
        """Value `v` of node `a` in `target`: redistributed once per (value, placement) and
        reused by every consumer, through the value's hub where the plan has one."""
        if v.placements == target:
            return v
        cache = env.setdefault(REDISTRIBUTED, {}).setdefault(a, {})
        if target not in cache:
            via = self.hubs.get(a)
            if via is not None and via not in (v.placements, target):
                if via not in cache:
                    cache[via] = self.redistribute(v, via)
                v = cache[via]
            cache[target] = self.redistribute(v, target)
        return cache[target]


def _check_plan_fits(tg: TracedGraph, plan: Plan, mesh: DeviceMesh) -> None:
    if plan.graph_fingerprint and plan.graph_fingerprint != graph_fingerprint(tg.gm):
        raise PlannerError(
            "plan was made for a different traced graph (fingerprint mismatch); if this "
            "happens on some ranks of one job, the model's forward traced differently on "
            "them, e.g. by iterating over a set of strings, whose order differs per process: "
            "set PYTHONHASHSEED to one value on every rank (run_train.sh sets 0)"
        )
    if list(plan.mesh_shape) != list(mesh.shape):
        raise PlannerError(f"plan is for mesh {plan.mesh_shape}, got mesh {list(mesh.shape)}")


def _hubs(tg: TracedGraph, plan: Plan) -> dict[fx.Node, P.Placements]:
    """Value node (a getitem for one output of a multi-output op) -> its planned hub."""
    out = {}
    for n in tg.gm.graph.nodes:
        producer, idx = (n.args[0], n.args[1]) if is_getitem(n) else (n, 0)
        hubs = plan.nodes.get(producer.name, {}).get("hubs")
        if hubs and idx < len(hubs) and hubs[idx] != "-":
            out[n] = P.parse(hubs[idx])
    return out
