"""Compiled execution of a plan: one local graph for the forward, one for the backward.

`module.compile()` on a parallel module lands here.  On the first call we trace the plan's
interpreter (the same one eager mode runs) with `make_fx` over this rank's *local* tensors:
DTensor dispatch disappears and what remains is plain ATen compute plus functional collectives
(`_c10d_functional.all_gather_into_tensor`, `wait_tensor`, ...) — exactly the graph Inductor's
comms passes (bucketing, reordering) work on.  The forward graph returns the outputs and the
values the backward needs; the backward graph maps them and the output gradients to parameter
gradients (in their planned placements).  Both are then compiled with `torch.compile`.

Shapes, placements and dtypes are static; a call with different local input shapes retraces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx


def _wrap(local: torch.Tensor, mesh, meta) -> DTensor:
    pl, shape, stride = meta
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=shape, stride=stride)


class CompiledJoint:
    """Traced and compiled forward/backward local graphs for one input signature."""

    def __init__(self, runner, keys: list[fx.Node], metas: list, locals_: list[torch.Tensor],
                 device, compile_kwargs: dict):
        self.runner, self.keys, self.metas = runner, keys, metas
        tg, mesh = runner.tg, runner.mesh
        bwd_nodes = set(runner.backward_order)
        needed = {a for n in runner.backward_order for a in n.all_input_nodes if a not in bwd_nodes}
        # forward values (placeholders included) that backward nodes read
        self.saved = list(dict.fromkeys(n for n in list(keys) + runner.order if n in needed))
        saved_meta: dict[fx.Node, Any] = {}

        def fwd(*ls):
            env = {k: _wrap(x, mesh, m) for k, x, m in zip(keys, ls, metas)}
            for node in runner.order:
                runner._exec(node, env, device, param_casts=False)
            outs = [runner._redistribute(env[n], runner.output_pls[i])
                    for i, n in enumerate(tg.outputs)]
            saved = []
            for n in self.saved:
                v = env[n]
                if isinstance(v, DTensor):
                    saved_meta[n] = (v.placements, v.shape, v.stride())
                    v = v.to_local()
                else:
                    saved_meta[n] = None
                saved.append(v)
            self.out_meta = [(o.placements, o.shape, o.stride()) for o in outs]
            return [o.to_local() for o in outs] + saved

        with torch.no_grad():
            fwd_gm = make_fx(fwd)(*locals_)
            example = fwd_gm(*locals_)
        n_out = len(tg.outputs)
        saved_examples = example[n_out:]
        tangent_examples = [torch.zeros_like(o) for o in example[:n_out]]
        grad_keys = [(k, runner.param_of.get(k)) for k in keys]

        def bwd(*ls):
            saved_l, tans = ls[:len(self.saved)], ls[len(self.saved):]
            env = {}
            for n, x in zip(self.saved, saved_l):
                m = saved_meta[n]
                env[n] = _wrap(x, mesh, m) if m is not None else x
            for i, t in enumerate(tg.tangents):
                if t is not None:
                    env[t] = _wrap(tans[i], mesh, self.out_meta[i])
            for node in runner.backward_order:
                runner._exec(node, env, device, param_casts=False)
            grads = []
            for _k, fqn in grad_keys:
                g = tg.grads.get(fqn) if fqn is not None else None
                if g is None:
                    continue
                grads.append(runner._redistribute(env[g], runner.grad_pls[fqn]).to_local())
            return grads

        with torch.no_grad():
            bwd_gm = make_fx(bwd)(*saved_examples, *tangent_examples)
        self.grad_slots = [i for i, (_k, fqn) in enumerate(grad_keys)
                           if fqn is not None and tg.grads.get(fqn) is not None]
        self.fwd_graph, self.bwd_graph = fwd_gm, bwd_gm
        self.fwd = torch.compile(fwd_gm, **compile_kwargs)
        self.bwd = torch.compile(bwd_gm, **compile_kwargs)
        self.n_out = n_out
        self.out_like = [(o.shape, o.dtype) for o in example[:n_out]]


class _CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cj: CompiledJoint, *locals_):
        res = cj.fwd(*locals_)
        ctx.cj, ctx.saved, ctx.n_in = cj, res[cj.n_out:], len(locals_)
        return tuple(res[:cj.n_out])

    @staticmethod
    def backward(ctx, *grads):
        cj = ctx.cj
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype)
                 for g, (shape, dtype) in zip(grads, cj.out_like)]
        out = cj.bwd(*ctx.saved, *[g.contiguous() for g in grads])
        ctx.saved = None
        res: list = [None] * ctx.n_in
        for slot, g in zip(cj.grad_slots, out):
            res[slot] = g
        return (None, *res)


def run_compiled(runner, env: dict, device, compile_kwargs: dict) -> list[torch.Tensor]:
    """Run the plan through the (lazily built) compiled graphs; returns local outputs."""
    keys = list(env)
    metas = [(v.placements, v.shape, v.stride()) for v in env.values()]
    sig = tuple((tuple(v.to_local().shape), v.dtype) for v in env.values())
    cj = runner._compiled.get(sig)
    if cj is None:
        cj = runner._compiled[sig] = CompiledJoint(
            runner, keys, metas, [v.to_local().detach() for v in env.values()], device, compile_kwargs)
    # to_local keeps autograd: gradients of the local shards flow back into the DTensor params
    return list(_CompiledFunction.apply(cj, *[v.to_local() for v in env.values()]))
