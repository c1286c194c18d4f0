"""A reference executor for the numerics checks: the plan run op by op over DTensors.

The product runs a plan as lowered local graphs (`execute/executor.py`).  This runs the same
joint graph with the same interpreter (`execute/interpret.py`) eagerly instead: the forward
nodes in the forward, the joint graph's backward nodes in a custom autograd function's
backward, every redistribution the plan chose on the way (gradient reductions included).
Comparing both against one process separates a lowering bug from a planning one.  No
recompute, no bucketing, no compile.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torchtitan.autoparallel.execute.executor import LoweredExecutor, _ScaleGrad
from torchtitan.autoparallel.execute.interpret import PlanInterpreter


def use_reference_executor(pm) -> None:
    """Make the parallel module `pm` (from `apply_placement`) run the reference."""
    lowered = pm._ap_executor
    if lowered.recompute:
        raise ValueError("the DTensor reference does not recompute; plan without recompute")
    object.__setattr__(pm, "_ap_executor", DTensorReference(lowered.interp))


class DTensorReference(LoweredExecutor):
    """Same inputs and outputs as the lowered executor (wrapping; the outputs' gradients
    scaled by 1 / batch ranks, which the lowered executor does inside its backward), the
    plan interpreted over DTensors in between."""

    def __init__(self, interp: PlanInterpreter):
        super().__init__(interp, kept=None, recompute={}, units=[])
        tg = interp.tg
        self.order = [n for n in tg.gm.graph.nodes if n in tg.forward_nodes and _is_op(n)]
        self.backward_order = [
            n for n in tg.gm.graph.nodes if _is_op(n) and n not in tg.forward_nodes
        ]

    def compile(self, **kwargs) -> None:
        raise NotImplementedError("the DTensor reference runs eagerly only")

    def _run_lowered(self, env: dict, device) -> list[torch.Tensor]:
        interp, tg = self.interp, self.interp.tg
        env.update(interp.constant_values(device))
        if torch.is_grad_enabled() and any(
            isinstance(env[n], torch.Tensor) and env[n].requires_grad for n in tg.params.values()
        ):
            keys = list(env)
            outs = _Joint.apply(self, device, keys, *[env[k] for k in keys])
        else:
            self.run_nodes(self.order, env, device)
            outs = [
                interp.redistribute(env[n], interp.output_pls[i]) for i, n in enumerate(tg.outputs)
            ]
        outs = [o.to_local() if isinstance(o, DTensor) else o for o in outs]
        scale = 1.0 / interp.batch_ranks()
        return [_ScaleGrad.apply(o, scale) if scale != 1.0 and o.requires_grad else o for o in outs]

    def run_nodes(self, nodes: list[fx.Node], env: dict, device) -> None:
        for node in nodes:
            self.interp.run_node(node, env, device)


def _is_op(n: fx.Node) -> bool:
    return n.op == "call_function"


class _Joint(torch.autograd.Function):
    """Forward and backward both follow the plan: the joint graph's backward nodes run in
    `backward`, with every redistribution the solver chose (e.g. gradient reduce-scatters)."""

    @staticmethod
    def forward(ctx, ref: DTensorReference, device, keys, *values):
        interp = ref.interp
        env = dict(zip(keys, values))
        with torch.no_grad():
            ref.run_nodes(ref.order, env, device)
        ctx.ref, ctx.env, ctx.keys, ctx.device = ref, env, keys, device
        outs = []
        for i, n in enumerate(interp.tg.outputs):
            out = interp.redistribute(env[n], interp.output_pls[i])
            outs.append(out.view_as(out) if out is env[n] else out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ref, env = ctx.ref, ctx.env
        interp, tg = ref.interp, ref.interp.tg
        with torch.no_grad():
            for i, t in enumerate(tg.tangents):
                if t is None:
                    continue
                g = grads[i]
                if g is None:
                    out = env[tg.outputs[i]]
                    g = DTensor.from_local(
                        torch.zeros_like(out.to_local()),
                        interp.mesh,
                        out.placements,
                        run_check=False,
                        shape=out.shape,
                        stride=out.stride(),
                    )
                if not isinstance(g, DTensor):
                    g = DTensor.from_local(g, interp.mesh, interp.output_pls[i], run_check=False)
                env[t] = interp.redistribute(g, interp.output_pls[i])
            ref.run_nodes(ref.backward_order, env, ctx.device)
            out = []
            for k in ctx.keys:
                fqn = interp.param_of.get(k)
                gnode = tg.grads.get(fqn) if fqn is not None else None
                out.append(
                    None if gnode is None else interp.redistribute(env[gnode], interp.grad_pls[fqn])
                )
        ctx.env = None
        return (None, None, None, *out)
