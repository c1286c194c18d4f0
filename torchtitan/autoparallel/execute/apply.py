"""Stage 5: turn a plan into a runnable module with DTensor parameters.

The parallel module is a structural copy of the user's (meta) model whose parameters and
buffers are replaced, under their original FQNs, by meta DTensors with the planned
placements; its class is a dynamic subclass of the user's class, so `isinstance`, user
methods and `init_weights` keep working (`init_weights` runs under `exact_sharded_init`, so a
seed gives the same full tensors on any mesh).

`forward` runs the plan through the executor (executor.py): the joint graph lowered to local
forward and backward graphs with the plan's collectives, FSDP-bucketed.  The reference path,
`executor="dtensor"`, interprets the traced graph over DTensors instead: before each op every
tensor input is redistributed to the placement the plan chose for that op, then the ATen op
runs through DTensor; with `backward="plan"` (default) a custom autograd function runs the
joint graph's *backward* nodes the same way, with `backward="autograd"` DTensor autograd
derives the backward from the planned forward.  Either way gradients land in the parameters'
placements, outputs come back as local tensors in the planned output placement, and the
caller passes local inputs (per-rank shards of the global-shaped example inputs).

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

from torchtitan.exact_init import exact_sharded_init
from torchtitan.torch_private import compute_local_shape_and_global_offset, pytree

from ..errors import PlannerError
from ..graph import placements as P
from ..graph.nodes import is_getitem
from ..plan.plan import Plan, graph_fingerprint
from ..policies.recompute import check_policy, describe_policies
from ..policies.regather import check_reshard_policy
from ..policies.units import regathered_params, unit_of
from ..trace.joint import TracedGraph


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _ParamCast:
    """A parameter's low-precision cast, materialised per requested placement.

    `redistribute(forward_dtype=low, backward_dtype=reduce)` casts *before* the forward
    collective (gathers move low precision) and casts the gradient to the reduce dtype *before*
    the backward collective, returning it in the parameter's dtype (reductions in high
    precision, no extra rounding).  One collective per distinct placement, shared by consumers.
    """

    def __init__(self, param: DTensor, dtype: torch.dtype, reduce_dtype: torch.dtype | None):
        self.param, self.dtype, self.reduce_dtype = param, dtype, reduce_dtype
        self.cache: dict = {}

    def get(self, pl) -> DTensor:
        pl = tuple(pl) if pl is not None else tuple(self.param.placements)
        if pl not in self.cache:
            self.cache[pl] = self.param.redistribute(
                self.param.device_mesh,
                pl,
                forward_dtype=self.dtype,
                backward_dtype=self.reduce_dtype or self.param.dtype,
            )
        return self.cache[pl]


def _meta_dtensor(t: torch.Tensor, mesh: DeviceMesh, pl: P.Placements) -> DTensor:
    local_shape, _ = compute_local_shape_and_global_offset(t.shape, mesh, pl)
    local = torch.empty(local_shape, dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())


class GraphRunner:
    """Executes the forward part of the traced graph over DTensors following a plan."""

    def __init__(
        self,
        tg: TracedGraph,
        plan: Plan,
        mesh: DeviceMesh,
        reduce_dtype: torch.dtype | None = None,
        grad_reduction: str = "mean",
        backward: str = "plan",
        executor: str = "lowered",
        reshard_after_forward: bool | str = True,
        bucket: bool = True,
        units: list[str] | None = None,
    ):
        if plan.graph_fingerprint and plan.graph_fingerprint != graph_fingerprint(tg.gm):
            raise PlannerError(
                "plan was made for a different traced graph (fingerprint mismatch); if this "
                "happens on some ranks of one job, the model's forward traced differently on "
                "them, e.g. by iterating over a set of strings, whose order differs per process: "
                "set PYTHONHASHSEED to one value on every rank (run_train.sh sets 0)"
            )
        if list(plan.mesh_shape) != list(mesh.shape):
            raise PlannerError(f"plan is for mesh {plan.mesh_shape}, got mesh {list(mesh.shape)}")
        if grad_reduction not in ("mean", "sum"):
            raise PlannerError(f"grad_reduction must be 'mean' or 'sum', got '{grad_reduction}'")
        if backward not in ("plan", "autograd"):
            raise PlannerError(f"backward must be 'plan' or 'autograd', got '{backward}'")
        policy = check_reshard_policy(reshard_after_forward)
        if policy == "auto" and plan.regathered is None:
            raise PlannerError(
                "reshard_after_forward='auto' runs the plan's own choice, and this plan has "
                "none (made by an older planner): plan again"
            )
        if executor not in ("lowered", "dtensor"):
            raise PlannerError(f"executor must be 'lowered' or 'dtensor', got '{executor}'")
        self.tg, self.plan, self.mesh = tg, plan, mesh
        self.recompute = {b: check_policy(p) for b, p in plan.recompute.items() if p != "none"}
        if self.recompute and executor != "lowered":
            raise PlannerError(
                f"the plan recomputes activations ({describe_policies(self.recompute)}), which "
                "only executor='lowered' does"
            )
        self.backward = backward
        self.executor = executor
        self.reshard_policy, self.bucket = policy, bucket
        self.units = list(units or [])
        self.compile_kwargs: dict | None = None  # set by the module's compile()
        self._lowered: dict = {}  # input signature -> LoweredPlan (executor.py)
        self.reduce_dtype = reduce_dtype
        self.grad_reduction = grad_reduction
        self.order = [
            n for n in tg.gm.graph.nodes if n in tg.forward_nodes and n.op == "call_function"
        ]
        self.ins = {
            name: [P.parse(s) if s != "-" else None for s in d["ins"]]
            for name, d in plan.nodes.items()
        }
        missing = [
            n.name
            for n in self.order
            if not is_getitem(n)
            and n.name not in self.ins
            and isinstance(n.meta.get("val"), (torch.Tensor, list, tuple))
        ]
        if missing:
            raise PlannerError(f"plan has no entry for graph node '{missing[0]}'")
        self.backward_order = [
            n for n in tg.gm.graph.nodes if n.op == "call_function" and n not in tg.forward_nodes
        ]
        self.hubs = _hubs(tg, plan)
        self.grad_pls = {f: P.parse(s) for f, s in plan.grads.items()}
        self.input_pls = [P.parse(s) for s in plan.inputs]
        self.output_pls = [P.parse(s) for s in plan.outputs]
        self.param_of = {n: f for f, n in tg.params.items()}
        casts = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
        self.param_casts = {
            n: n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None)
            for n in self.order
            if n.target in casts
            and n.args
            and n.args[0] in self.param_of
            and set(n.kwargs) <= {"dtype"}
        }
        self.buffer_of = {n: f for f, n in tg.buffers.items()}
        # tensors the model's forward creates from Python values (`torch.tensor([-2])`) are
        # attributes of the traced graph: the same on every rank, so replicated
        self.constants = {
            n: getattr(tg.gm, n.target)
            for n in tg.gm.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(tg.gm, n.target), torch.Tensor)
        }
        # drop each value as soon as nothing later reads it (as autograd frees what it no
        # longer needs): otherwise every forward and backward value lives until the step ends
        outputs = set(tg.outputs)
        saved = {a for n in self.backward_order for a in n.all_input_nodes}
        self.release_forward = _release_schedule(self.order, outputs)
        self.release_joint_forward = _release_schedule(self.order, outputs | saved)
        self.release_backward = _release_schedule(
            self.backward_order, {g for g in tg.grads.values() if g is not None}
        )

    def _run_nodes(self, nodes: list, env: dict, device, param_casts: bool, release: dict) -> None:
        for node in nodes:
            self._exec(node, env, device, param_casts)
            for v in release.get(node, ()):
                env.pop(v, None)
                env.get(_REDISTRIBUTED, {}).pop(v, None)

    def kept_gathered(self) -> set[str] | None:
        """Parameters whose gathered values the forward keeps for the backward (None: all):
        as the plan chose (regather.py), or, for a plan without that choice, as the
        reshard-after-forward policy says."""

        if self.plan.regathered is not None:
            again = {u for u, yes in self.plan.regathered.items() if yes}
            return {f for f in self.tg.params if unit_of(f, self.units) not in again}
        if self.reshard_policy == "never":
            return None
        return set(self.tg.params) - regathered_params(
            self.tg.params, self.reshard_policy, self.units
        )

    def _local_meta(self, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Local shape and dtype of forward output i in its planned placement."""
        val = self.tg.outputs[i].meta["val"]
        shape, _ = compute_local_shape_and_global_offset(val.shape, self.mesh, self.output_pls[i])
        return tuple(shape), val.dtype

    def _batch_ranks(self) -> int:
        if not self.input_pls:
            return 1
        return math.prod(
            n for p, n in zip(self.input_pls[0], self.mesh.shape) if isinstance(p, Shard)
        )

    def _redistribute(self, v: DTensor, pl: P.Placements) -> DTensor:
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

    # ------------------------------------------------------------------ execution
    def _exec(self, node: fx.Node, env: dict, device, param_casts: bool) -> None:
        """Run one graph node: redistribute tensor inputs to the plan's placements, then the op."""
        if is_getitem(node):
            parent, idx = node.args
            env[node] = env[parent][idx]
            return
        if param_casts and node in self.param_casts and isinstance(env[node.args[0]], DTensor):
            env[node] = _ParamCast(env[node.args[0]], self.param_casts[node], self.reduce_dtype)
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
                if isinstance(v, _ParamCast):
                    return v.get(targets[k] if k is not None else None)
                if (
                    k is not None
                    and isinstance(v, DTensor)
                    and targets[k] is not None
                    and v.placements != targets[k]
                ):
                    # once per (value, placement), every consumer reusing it; through the
                    # value's hub where the plan has one (as the solver priced it)
                    cache = env.setdefault(_REDISTRIBUTED, {}).setdefault(a, {})
                    if targets[k] not in cache:
                        via = self.hubs.get(a)
                        if via is not None and via not in (v.placements, targets[k]):
                            if via not in cache:
                                cache[via] = self._redistribute(v, via)
                            v = cache[via]
                        cache[targets[k]] = self._redistribute(v, targets[k])
                    v = cache[targets[k]]
            return v

        args_ = tuple(fx.node.map_arg(node.args, convert))
        kwargs = dict(fx.node.map_arg(node.kwargs, convert))
        if not any(isinstance(x.meta.get("val"), torch.Tensor) for x in node.all_input_nodes):
            if "device" in kwargs and device is not None:
                kwargs["device"] = device
            out = node.target(*args_, **kwargs)
            if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
                rep = tuple(Replicate() for _ in self.mesh.shape)
                out = DTensor.from_local(out, self.mesh, rep, run_check=False)
        else:
            out = node.target(*args_, **kwargs)
        env[node] = out

    def _placeholders(self, module: nn.Module, flat: list) -> tuple[dict, Any]:
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

    @torch._dynamo.disable
    def run(self, module: nn.Module, args: tuple) -> Any:
        """Execute the plan on local inputs: as the lowered local graphs (executor.py; after
        `module.compile()` compiled by inductor), or with `executor="dtensor"` by
        interpreting the joint graph over DTensors (the reference path)."""
        tg = self.tg
        flat, _ = pytree.tree_flatten(args)
        if len(flat) != len(tg.inputs):
            raise PlannerError(f"expected {len(tg.inputs)} inputs, got {len(flat)}")
        env, device = self._placeholders(module, flat)
        if self.executor == "lowered" or self.compile_kwargs is not None:
            from .executor import run_lowered

            return self._finish(run_lowered(self, env, device, self.compile_kwargs))
        env.update(self.constant_values(device))
        joint = (
            self.backward == "plan"
            and torch.is_grad_enabled()
            and any(
                isinstance(env[n], torch.Tensor) and env[n].requires_grad
                for n in tg.params.values()
            )
        )
        if joint:
            keys = list(env)
            dts = _JointFunction.apply(self, device, keys, *[env[k] for k in keys])
        else:
            self._run_nodes(self.order, env, device, True, self.release_forward)
            dts = [
                self._redistribute(env[n], self.output_pls[i])
                if isinstance(env[n], DTensor)
                else env[n]
                for i, n in enumerate(tg.outputs)
            ]
        return self._finish(dts)

    def _finish(self, dts: list) -> Any:
        """Local outputs (with the mean-gradient scaling) in the user's output structure."""
        tg = self.tg
        outs = []
        scale = 1.0 / self._batch_ranks() if self.grad_reduction == "mean" else 1.0
        for v in dts:
            if isinstance(v, DTensor):
                v = v.to_local()
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


_REDISTRIBUTED = "redistributed"  # env key: node -> {placement: redistributed value}


def _hubs(tg: TracedGraph, plan: Plan) -> dict[fx.Node, P.Placements]:
    """Value node (a getitem for one output of a multi-output op) -> its planned hub."""
    out = {}
    for n in tg.gm.graph.nodes:
        producer, idx = (n.args[0], n.args[1]) if is_getitem(n) else (n, 0)
        hubs = plan.nodes.get(producer.name, {}).get("hubs")
        if hubs and idx < len(hubs) and hubs[idx] != "-":
            out[n] = P.parse(hubs[idx])
    return out


def _release_schedule(seq: list, keep: set) -> dict:
    """node -> the values (not in `keep`) that no node after it in `seq` reads."""
    last: dict = {}
    for n in seq:
        last.setdefault(n, n)  # a value nothing reads goes right after it is made
        for a in n.all_input_nodes:
            last[a] = n
    out: dict = {}
    for v, n in last.items():
        if v not in keep:
            out.setdefault(n, []).append(v)
    return out


class _JointFunction(torch.autograd.Function):
    """Forward and backward both follow the plan: the joint graph's backward nodes run in
    `backward`, with every redistribution (e.g. gradient reduce-scatters) the solver chose."""

    @staticmethod
    def forward(ctx, runner: GraphRunner, device, keys, *values):
        env = dict(zip(keys, values))
        with torch.no_grad():
            runner._run_nodes(runner.order, env, device, False, runner.release_joint_forward)
        ctx.runner, ctx.env, ctx.keys, ctx.device = runner, env, keys, device
        outs = []
        for i, n in enumerate(runner.tg.outputs):
            out = runner._redistribute(env[n], runner.output_pls[i])
            # Autograd gives each returned tensor this node as grad_fn; returning a tensor
            # ctx.env also holds would make a cycle (tensor -> node -> ctx.env -> tensor)
            # that only the garbage collector frees, and the trainer runs it rarely.
            outs.append(out.view_as(out) if out is env[n] else out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        runner, env, tg = ctx.runner, ctx.env, ctx.runner.tg
        with torch.no_grad():
            for i, t in enumerate(tg.tangents):
                if t is None:
                    continue
                g = grads[i]
                if g is None:
                    out = env[tg.outputs[i]]
                    g = DTensor.from_local(
                        torch.zeros_like(out.to_local()),
                        runner.mesh,
                        out.placements,
                        run_check=False,
                        shape=out.shape,
                        stride=out.stride(),
                    )
                if not isinstance(g, DTensor):
                    g = DTensor.from_local(g, runner.mesh, runner.output_pls[i], run_check=False)
                env[t] = runner._redistribute(g, runner.output_pls[i])
            runner._run_nodes(
                runner.backward_order, env, ctx.device, False, runner.release_backward
            )
            out = []
            for k in ctx.keys:
                fqn = runner.param_of.get(k)
                gnode = tg.grads.get(fqn) if fqn is not None else None
                if gnode is None:
                    out.append(None)
                    continue
                out.append(runner._redistribute(env[gnode], runner.grad_pls[fqn]))
        ctx.env = None
        return (None, None, None, *out)


def build_parallel_module(
    model: nn.Module, tg: TracedGraph, plan: Plan, mesh: DeviceMesh, runner: GraphRunner
) -> nn.Module:
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

    def compile(self, *args, **kwargs):
        """Run the plan's lowered local graphs compiled (executor.py); kwargs go to
        torch.compile."""
        self._ap_runner.compile_kwargs = dict(kwargs)

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
    object.__setattr__(pm, "_ap_runner", runner)
    object.__setattr__(pm, "plan", plan)
    return pm
