"""Stage 5c: run a plan as its lowered local graphs — the same program eager and compiled.

Per input signature (local shapes and dtypes of parameters, buffers and inputs) the plan is
lowered once (lower.py), partitioned into a forward and a backward graph, and its collectives
grouped FSDP-style (buckets.py).  Eager mode calls the two `fx.GraphModule`s directly: plain
ATen ops and functional collectives, no DTensor dispatch.  After `module.compile()` the *same*
two graphs are handed to `torch.compile`.  The eager backward takes its inputs as one list it
empties (saved values die at their last use); the compiled one holds them until it returns.  A
custom autograd function connects them: the forward graph returns the outputs and the saved
values, the backward graph maps those and the output gradients to parameter gradients in their
planned placements.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .buckets import bucket_collectives
from .lower import lower_joint, partition

log = logging.getLogger(__name__)


class LoweredPlan:
    """The forward and backward local graphs of one input signature, ready to call."""

    def __init__(
        self,
        runner,
        keys: list[fx.Node],
        placements: list,
        locals_: list,
        device,
        compile_kwargs: dict | None,
    ):
        tg = runner.tg
        out_vals = [runner._local_meta(i) for i in range(len(tg.outputs))]
        tangent_keys, tangent_pls, tangent_locals = [], [], []
        self.tangent_slots = []
        for i, t in enumerate(tg.tangents):
            if t is None:
                continue
            shape, dtype = out_vals[i]
            tangent_keys.append(t)
            tangent_pls.append(runner.output_pls[i])
            tangent_locals.append(torch.empty(shape, dtype=dtype, device=device))
            self.tangent_slots.append(i)
        self.out_like = out_vals
        joint = lower_joint(
            runner, keys + tangent_keys, placements + tangent_pls, locals_ + tangent_locals, device
        )
        part = partition(joint, runner.kept_gathered(), runner.recompute)
        self.stats = bucket_collectives(part, runner.units, enabled=runner.bucket)
        log.info(
            "lowered graphs%s: collectives forward %s, backward %s",
            " (to compile)" if compile_kwargs is not None else "",
            _counts(self.stats["fwd"]),
            _counts(self.stats["bwd"]),
        )
        self.partition = part
        self.n_out = part.n_outputs
        # the backward graph returns one gradient per parameter that gets one, in this order
        slot_of = {runner.param_of.get(k): i for i, k in enumerate(keys) if k in runner.param_of}
        self.grad_slots = [slot_of[f] for f in part.grad_names]
        self.n_in = len(keys)
        if compile_kwargs is None:
            self.fwd, self.bwd = part.fwd, _boxed(part.bwd)
        else:
            self.fwd = torch.compile(part.fwd, **compile_kwargs)
            bwd = torch.compile(part.bwd, **compile_kwargs)
            self.bwd = lambda args: bwd(*args)


class _PlanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp: LoweredPlan, *locals_):
        res = lp.fwd(*locals_)
        ctx.lp, ctx.saved = lp, res[lp.n_out :]
        # outputs that are also saved would make autograd see a tensor it returns as an input
        # of its own backward; hand out views instead
        return tuple(o.view_as(o) for o in res[: lp.n_out])

    @staticmethod
    def backward(ctx, *grads):
        lp = ctx.lp
        tangents = []
        for i in lp.tangent_slots:
            g = grads[i]
            if g is None:
                shape, dtype = lp.out_like[i]
                g = torch.zeros(
                    shape, dtype=dtype, device=ctx.saved[0].device if ctx.saved else None
                )
            tangents.append(g.contiguous())
        args = [*ctx.saved, *tangents]
        ctx.saved = tangents = None
        out = lp.bwd(args)  # eager: the graph empties `args`, freeing each input after last use
        res: list = [None] * lp.n_in
        for slot, g in zip(lp.grad_slots, out):
            res[slot] = g
        return (None, *res)


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


def run_lowered(runner, env: dict, device, compile_kwargs: dict | None) -> list[torch.Tensor]:
    """Run the plan through its (lazily lowered) local graphs; returns local outputs."""
    keys = list(env)
    values = [env[k] for k in keys]
    locals_ = [v.to_local() for v in values]
    sig = (compile_kwargs is not None, tuple((tuple(x.shape), x.dtype, x.device) for x in locals_))
    lp = runner._lowered.get(sig)
    if lp is None:
        lp = runner._lowered[sig] = LoweredPlan(
            runner,
            keys,
            [v.placements for v in values],
            [x.detach() for x in locals_],
            device,
            compile_kwargs,
        )
    if not torch.is_grad_enabled():
        return list(lp.fwd(*locals_)[: lp.n_out])
    # to_local keeps autograd: gradients of the local shards flow back into the DTensor params
    return list(_PlanFunction.apply(lp, *locals_))
