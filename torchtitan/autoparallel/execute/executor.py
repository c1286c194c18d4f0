"""Stage 5c: run a plan as its lowered local graphs — the same program eager and compiled.

`LoweredExecutor.run` is the parallel module's forward: it wraps the module's parameters and
the local inputs (interpret.py), looks up or makes the lowered graphs of their signature, and
runs them.  It owns the lowered graphs; nothing else keeps execution state.

Per input signature (local shapes and dtypes of parameters, buffers and inputs) the plan is
lowered once (lower.py), partitioned into a forward and a backward graph, and its collectives
grouped FSDP-style (buckets.py).  Eager mode calls the two `fx.GraphModule`s directly: plain
ATen ops and functional collectives, no DTensor dispatch, each sum written into an operand
that dies at it (in_place.py).  After `module.compile()` the *same*
two graphs are compiled by inductor (through AOTAutograd's decompositions, without dynamo: they
are ATen graphs already).  Both modes call the graphs boxed, as AOTAutograd calls its compiled
backward: the inputs come as one list the graph empties, so each saved value dies at its last
use.  A custom autograd function connects them: the forward graph returns the outputs and the
saved values, the backward graph maps those and the output gradients to parameter gradients in
their planned placements.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.torch_private import (
    FakeTensorMode,
    GmWrapper,
    TracingContext,
    compute_global_tensor_info,
    counters,
    pytree,
    tracing,
    use_lazy_graph_module,
)

from ..child_process import can_fork, run_in_child
from ..errors import PlannerError
from .buckets import bucket_collectives
from .in_place import accumulate_in_place, reduce_in_place
from .interpret import PlanInterpreter
from .lower import Partition, lower_joint, partition
from .shared_compile import name_groups_by_role, one_compile_at_a_time
from .shared_lowering import lowered_once, lowering_key

log = logging.getLogger(__name__)


class LoweredPlan:
    """The forward and backward local graphs of one input signature, ready to call."""

    def __init__(
        self,
        executor: LoweredExecutor,
        keys: list[fx.Node],
        placements: list,
        locals_: list,
        device,
    ):
        interp, compile_options = executor.interp, executor.compile_options
        tg = interp.tg
        out_vals = [interp.local_output_meta(i) for i in range(len(tg.outputs))]
        tangent_keys, tangent_pls, tangent_locals = [], [], []
        self.tangent_slots = []
        for i, t in enumerate(tg.tangents):
            if t is None:
                continue
            shape, dtype = out_vals[i]
            tangent_keys.append(t)
            tangent_pls.append(interp.output_pls[i])
            tangent_locals.append(torch.empty(shape, dtype=dtype, device=device))
            self.tangent_slots.append(i)
        self.out_like = out_vals
        keys, placements = keys + tangent_keys, placements + tangent_pls
        locals_ = locals_ + tangent_locals
        compiled = compile_options is not None
        settings = {
            "compiled": compiled,
            "kept": sorted(executor.kept) if executor.kept is not None else None,
            "recompute": executor.recompute,
            "units": executor.units,
        }
        part, self.stats = lowered_once(
            lowering_key(interp, keys, placements, locals_, settings),
            lambda: _lower(executor, keys, placements, locals_, device),
        )
        log.info(
            "lowered graphs%s: collectives forward %s, backward %s",
            " (to compile)" if compiled else "",
            _counts(self.stats["fwd"]),
            _counts(self.stats["bwd"]),
        )
        self.partition = part
        self.n_out = part.n_outputs
        # the backward graph returns one gradient per parameter that gets one, in this order,
        # then one per input that requires one
        slot_of = {interp.param_of.get(k): i for i, k in enumerate(keys) if k in interp.param_of}
        self.grad_slots = [slot_of[f] for f in part.grad_names]
        self.grad_slots += [keys.index(tg.inputs[i]) for i in part.input_grads]
        self.n_in = len(keys) - len(tangent_keys)
        self.fwd: Callable[[list], Any]
        self.bwd: Callable[[list], Any]
        if compile_options is None:
            log.info(
                "lowered graphs: %d sums and %d all-reduces written into an operand that "
                "dies at them",
                self.stats["in_place"],
                self.stats["reduced_in_place"],
            )
            self.fwd, self.bwd = _boxed(part.fwd), _boxed(part.bwd)
        else:
            self.fwd = InductorOnFirstCall(part.fwd, compile_options)
            self.bwd = InductorOnFirstCall(part.bwd, compile_options)


def _lower(
    executor: LoweredExecutor, keys: list[fx.Node], placements: list, locals_: list, device
) -> tuple[Partition, dict]:
    """The plan lowered for these local values: forward and backward graphs, collectives
    bucketed (and, for eager mode, sums and all-reduces written in place), groups named by
    their role in the mesh; and counts of what was done."""
    interp = executor.interp
    # the joint graph and the passes' intermediate graphs are never called: their Python
    # code is generated only for the two graphs that run, on their first call
    with use_lazy_graph_module(True):
        joint = lower_joint(interp, keys, placements, locals_, device)
        part = partition(
            joint,
            executor.kept,
            executor.recompute,
            fuse_recompute=executor.compile_options is not None,
        )
        stats = bucket_collectives(part, executor.units)
    if executor.compile_options is None:
        stats["in_place"] = accumulate_in_place(part.fwd) + accumulate_in_place(part.bwd)
        stats["reduced_in_place"] = reduce_in_place(part.fwd) + reduce_in_place(part.bwd)
    for gm in (part.fwd, part.bwd):  # the same code on every rank running this program
        name_groups_by_role(gm, interp.mesh)
    return part, stats


class _PlanFunction(torch.autograd.Function):
    """The lowered graphs as one autograd node.  Its inputs are the plan's values as the
    module holds them (DTensor parameters, the inputs wrapped by the interpreter): the
    forward reads their local tensors and the backward hands each DTensor input its gradient
    as a DTensor of the same layout, so no parameter passes through a `to_local` autograd
    node of its own each step."""

    @staticmethod
    def forward(ctx, lp: LoweredPlan, scale: float, *values):
        locals_ = [_local(v) for v in values]
        ctx.specs = [v._spec if isinstance(v, DTensor) else None for v in values]
        res = lp.fwd(locals_)
        ctx.lp, ctx.scale, ctx.saved = lp, scale, res[lp.n_out :]
        # an output that is also saved would make autograd see a tensor it returns as an
        # input of its own backward; hand out a view of it instead (and the others as they
        # are: a pipeline schedule detaches a stage's outputs in place, which a view refuses)
        saved = {id(t) for t in ctx.saved}
        return tuple(o.view_as(o) if id(o) in saved else o for o in res[: lp.n_out])

    @staticmethod
    def backward(ctx, *grads):
        lp = ctx.lp
        if ctx.saved is None:
            return (None, None, *_weight_step(ctx, grads))
        tangents = []
        for i in lp.tangent_slots:
            g = grads[i]
            if g is None:
                shape, dtype = lp.out_like[i]
                g = torch.zeros(
                    shape, dtype=dtype, device=ctx.saved[0].device if ctx.saved else None
                )
            tangents.append((g if ctx.scale == 1.0 else g * ctx.scale).contiguous())
        args = [*ctx.saved, *tangents]
        ctx.saved = tangents = None
        out = lp.bwd(args)  # the graph empties `args`, freeing each input after its last use
        res: list = [None] * lp.n_in
        for slot, g in zip(lp.grad_slots, out):
            spec = ctx.specs[slot]
            res[slot] = g if spec is None else _as_dtensor(g, spec)
        ctx.grads = ctx.weight_grads = None
        if lp.partition.input_grads:  # a pipeline stage: a weight step may follow (below)
            ctx.grads, ctx.weight_grads = grads, list(res)
            for slot in lp.grad_slots[len(lp.partition.grad_names) :]:
                ctx.weight_grads[slot] = None
        return (None, None, *res)


def _local(v: Any) -> Any:
    return v._local_tensor if isinstance(v, DTensor) else v


def _as_dtensor(grad: torch.Tensor, spec: Any) -> DTensor:
    """`grad`, a local gradient, as the gradient of a DTensor with `spec`: what DTensor's own
    `to_local` backward hands back (a partial placement's gradient is replicated)."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    _, stride = compute_global_tensor_info(grad, spec.mesh, placements)
    if placements == spec.placements and tuple(stride) == spec.tensor_meta.stride:
        return DTensor(grad, copy.copy(spec), requires_grad=False)
    return DTensor.from_local(
        grad, spec.mesh, placements, run_check=False, shape=spec.shape, stride=tuple(stride)
    )


def _weight_step(ctx, grads: tuple) -> list:
    """The backward run again on a retained graph: a zero-bubble schedule's weight step
    (`torch.distributed.pipelining`: one pass for the inputs' gradients, a later one from
    the same output gradients for the parameters').  The lowered backward computed both
    in the first pass; this hands back its parameters' gradients, once, and refuses any
    other second pass (other output gradients would need the saved values, freed).  Only
    a module that returns an input's gradient (a pipeline stage) keeps them for it: any
    other would hold its output gradients as long as its outputs live."""
    same = ctx.weight_grads is not None and all(
        (a is None) == (b is None) and (a is None or a is b or torch.equal(a, b))
        for a, b in zip(grads, ctx.grads)
    )
    if not same:
        raise RuntimeError(
            "a planned module's backward ran twice: its saved values are freed after the "
            "first (only a zero-bubble pipeline schedule's weight step, with the same "
            "output gradients, may run it again)"
        )
    weight_grads, ctx.weight_grads, ctx.grads = ctx.weight_grads, None, None
    return weight_grads


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def _boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` taking one list of inputs that it empties on entry (torch.fx's boxed calling
    convention), so each saved activation is freed after its last use in the backward rather
    than when the whole backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


class InductorOnFirstCall:
    """`gm` compiled by inductor when first called (its example inputs are the first call's),
    then called boxed: the list of inputs is emptied as the compiled code runs.

    The example inputs are fake tensors of static shapes in a tracing context whose fake
    mode has a shape env, as dynamo hands them to inductor: without one, inductor's FX graph
    cache bypasses every graph ("No shape env") and a warm start generates all code again.
    The cache key holds the graph's code, process-group names included: ranks whose graphs
    name their groups by role (shared_compile.py) compile a graph once per machine.

    `generated`: graphs whose code inductor generated for this process so far (here, or in
    a child process compiling for it), not read from its cache."""

    generated = 0

    def __init__(self, gm: fx.GraphModule, options: dict):
        self.gm, self.options = gm, options
        self.compiled: Callable[[list], Any] | None = None

    def __call__(self, args: list) -> Any:
        if self.compiled is None:
            self.compiled = self._compile(args)
        return self.compiled(args)

    def _compile(self, args: list) -> Callable[[list], Any]:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        examples = [
            fake_mode.from_tensor(a.detach(), static_shapes=True)
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        ]
        with (
            one_compile_at_a_time(self.gm, examples, self.options) as first,
            torch.no_grad(),
            tracing(TracingContext(fake_mode)),
        ):
            if first and can_fork():
                made = run_in_child(lambda: self._generate(examples), task="compile")
                InductorOnFirstCall.generated += int(made)
            misses = _cache_misses()
            compiled = self._inductor(examples)
            InductorOnFirstCall.generated += _cache_misses() - misses
        assert callable(compiled), compiled
        return compiled

    def _inductor(self, examples: list) -> Any:
        """Inductor's compiled graph for these example inputs (from its cache when there)."""
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(GmWrapper(self.gm, list), examples, config_patches=self.options or None)

    def _generate(self, examples: list) -> str:
        """Compile the graph into inductor's cache, in a forked child process (`_compile`
        then reads it from there): generating the code leaves a heap behind — inductor's
        IR, its caches, the kernels' sources — that the process keeps as resident memory for
        the rest of the job (a planned dp_shard 4 rank that compiled: about 0.1 GiB more
        than the ranks that read it).  The kernels are built in the child itself, not by
        a pool of workers forked from it."""
        from torch._inductor import config

        misses = _cache_misses()
        with config.patch(compile_threads=1):
            self._inductor(examples)
        return str(_cache_misses() - misses)


def _cache_misses() -> int:
    """Graphs inductor generated code for in this process (FX graph cache misses)."""
    return counters["inductor"]["fxgraph_cache_miss"]


class _OnMeta(torch.autograd.Function):
    """On meta inputs the plan runs nothing: its outputs (and in the backward, the inputs'
    gradients) are meta tensors of the local shapes the plan gives them.  This is what a
    pipeline schedule's shape inference runs a stage on."""

    @staticmethod
    def forward(ctx, executor: LoweredExecutor, *inputs):
        ctx.like = [x if isinstance(x, torch.Tensor) else None for x in inputs]
        interp = executor.interp
        metas = [interp.local_output_meta(i) for i in range(len(interp.tg.outputs))]
        return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in metas)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[1:]
        return (None, *(torch.zeros_like(x) if n else None for x, n in zip(ctx.like, needs)))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient (1 / ranks splitting the batch, so a
    per-rank mean loss gives the global-mean gradient, as DDP and FSDP do)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class LoweredExecutor:
    """Runs a plan through its lowered graphs, made on first use per input signature.

    `kept`: parameters whose gathered values the forward keeps for the backward (None: all);
    `recompute`: block label -> activation recompute policy; `units`: the FSDP units whose
    collectives are bucketed together.  `compile(options)` has inductor compile the same
    graphs from the next call on (`options`: inductor config, as `torch.compile(options=...)`)."""

    def __init__(
        self,
        interp: PlanInterpreter,
        kept: set[str] | None,
        recompute: dict[str, str],
        units: list[str],
    ):
        self.interp, self.kept, self.recompute, self.units = interp, kept, recompute, units
        self.compile_options: dict | None = None
        self.lowered: dict[tuple, LoweredPlan] = {}  # input signature -> its graphs

    def compile(self, options: dict | None = None) -> None:
        self.compile_options = dict(options or {})

    @torch._dynamo.disable
    def run(self, module: nn.Module, args: tuple) -> Any:
        """Execute the plan on local inputs; local outputs in the user's output structure."""
        tg = self.interp.tg
        flat, _ = pytree.tree_flatten(args)
        if len(flat) != len(tg.inputs):
            raise PlannerError(f"expected {len(tg.inputs)} inputs, got {len(flat)}")
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
            return self._finish(list(_OnMeta.apply(self, *flat)))
        # the outputs' gradients are scaled by 1 / batch ranks (`_PlanFunction`); an input's
        # gradient leaves unscaled, the gradient of this rank's own loss, as a stage of a
        # pipeline hands it to the stage before, which scales it again
        ranks = self.interp.batch_ranks()
        flat = [
            _ScaleGrad.apply(x, float(ranks))
            if ranks != 1 and isinstance(x, torch.Tensor) and x.requires_grad
            else x
            for x in flat
        ]
        env, device = self.interp.placeholders(module, flat)
        return self._finish(self._run_lowered(env, device))

    def _run_lowered(self, env: dict, device) -> list[torch.Tensor]:
        keys = list(env)
        values = [env[k] for k in keys]
        locals_ = [_local(v) for v in values]
        compiled = self.compile_options is not None
        sig = (compiled, tuple((tuple(x.shape), x.dtype, x.device) for x in locals_))
        lp = self.lowered.get(sig)
        if lp is None:
            placements = [v.placements for v in values]
            detached = [x.detach() for x in locals_]
            lp = self.lowered[sig] = LoweredPlan(self, keys, placements, detached, device)
        if not torch.is_grad_enabled():
            return list(lp.fwd(locals_)[: lp.n_out])
        # the outputs' gradients are scaled by 1 / batch ranks (mean loss: DDP's, FSDP's)
        scale = 1.0 / self.interp.batch_ranks()
        return list(_PlanFunction.apply(lp, scale, *values))

    def _finish(self, outs: list[torch.Tensor]) -> Any:
        """Local outputs in the user's output structure."""

        spec = self.interp.tg.output_spec
        spec = getattr(spec, "spec", spec)
        if spec is not None:
            try:
                return pytree.tree_unflatten(outs, spec)
            except Exception:
                pass
        return outs[0] if len(outs) == 1 else tuple(outs)
