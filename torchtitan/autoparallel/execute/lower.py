"""Stage 5a: lower a plan to local graphs — plain ATen ops and functional collectives.

The joint graph (forward and backward over global shapes) is interpreted once over DTensors
that wrap this rank's *local* tensors, following the plan's placements op by op, under
`make_fx`.  DTensor dispatch disappears from the result: what remains is local compute plus
`_c10d_functional` collectives (`all_gather_into_tensor`, `reduce_scatter_tensor`,
`all_reduce`, `wait_tensor`, ...) — one local joint graph per input signature.  Every
parameter, buffer, input and tangent is a graph input; the lowering fails if the result holds
a tensor constant that the model's own graph did not (a captured activation would be reused,
silently, on every later call).

`partition` then cuts the local joint graph into the forward graph, `(params, buffers,
inputs) -> (outputs, saved)`, and the backward graph, `(saved, tangents) -> parameter
gradients, then input gradients` (an input gets one when it requires one: a pipeline stage's
hidden states, in the input's placement). A value the backward reads is *saved* — unless it
is computed from parameters and buffers alone (a gathered weight, its cast and transpose)
and reshard after forward applies to those parameters: then the backward recomputes it from
the sharded parameters (the re-gather of FSDP's reshard after forward), and the forward
frees it after its last forward use. For graphs inductor compiles, a saved value that
pointwise ops, views and casts make from values the backward has anyway is recomputed there
instead (`recompute_fusible`): inductor fuses the recompute into the kernels that read it,
as AOTAutograd's min-cut partitioner does for a hand-written compiled module.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan.torch_private import make_graph_module

from ..errors import PlannerError
from ..graph.nodes import param_side
from ..policies.recompute import (
    backward_schedule,
    block_label,
    recompute_fusible,
    recompute_rule,
    split_saved,
)
from ..trace.repeat import LABEL_KEY
from .interpret import PlanInterpreter
from .local_shards import rank_free_shards

PARAM, BUFFER, INPUT, TANGENT = "param", "buffer", "input", "tangent"


@dataclass
class LocalJoint:
    """The lowered joint graph; `kinds[i]`/`names[i]` describe placeholder i."""

    gm: fx.GraphModule
    kinds: list[str]
    names: list[str | None]  # parameter/buffer FQN, else None
    n_outputs: int  # the first `n_outputs` graph outputs are forward outputs
    grad_names: list[str]  # FQN of each next output (a parameter gradient)
    input_grads: list[int]  # the input (index among the traced inputs) of each last output


@dataclass
class Partition:
    """Forward and backward local graphs.  `saved_names[i]` is the FQN when saved value i is a
    parameter or buffer placeholder (kept for the backward's recompute), else None."""

    fwd: fx.GraphModule
    bwd: fx.GraphModule
    n_outputs: int
    grad_names: list[str]
    input_grads: list[int]
    fwd_names: list[str | None]
    saved_names: list[str | None] = field(default_factory=list)


def _wrap(local: torch.Tensor, mesh, pl, val: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, mesh, pl, run_check=False, shape=val.shape, stride=val.stride()
    )


def lower_joint(
    interp: PlanInterpreter,
    keys: list[fx.Node],
    placements: list,
    locals_: list[torch.Tensor],
    device,
) -> LocalJoint:
    """Trace the joint graph, run by `interp`, over local tensors (one per `keys` node, in
    the given placements; tangents last) into a local joint graph."""
    tg, mesh = interp.tg, interp.mesh
    param_of, buffer_of = interp.param_of, interp.buffer_of
    grad_fqns = [f for f in tg.params if tg.grads.get(f) is not None]
    input_grads = [i for i, g in enumerate(tg.input_grads) if g is not None]
    nodes = [n for n in tg.gm.graph.nodes if n.op == "call_function"]
    consts = interp.constant_values(device)

    def joint(*ls):
        env = {k: _wrap(x, mesh, pl, k.meta["val"]) for k, x, pl in zip(keys, ls, placements)}
        env.update(consts)
        for node in nodes:
            lab = block_label(node)
            if lab is None:
                interp.run_node(node, env, device)
                continue
            # the local ops (collectives included) made for this node carry its block label
            with fx_traceback.annotate({LABEL_KEY: lab}):
                interp.run_node(node, env, device)
        outs = [
            interp.redistribute(env[n], interp.output_pls[i]).to_local()
            for i, n in enumerate(tg.outputs)
        ]
        grads = [
            interp.redistribute(env[tg.grads[f]], interp.grad_pls[f]).to_local() for f in grad_fqns
        ]
        grads += [
            interp.redistribute(env[tg.input_grads[i]], interp.input_pls[i]).to_local()
            for i in input_grads
        ]
        return outs + grads

    with torch.no_grad(), fx_traceback.preserve_node_meta(), rank_free_shards():
        gm = make_fx(joint, tracing_mode="fake")(*locals_)
    _check_constants(gm, {id(c._local_tensor) for c in consts.values()})
    kinds = [
        PARAM
        if k in param_of
        else BUFFER
        if k in buffer_of
        else TANGENT
        if k in tg.tangents
        else INPUT
        for k in keys
    ]
    names = [param_of.get(k, buffer_of.get(k)) for k in keys]
    return LocalJoint(gm, kinds, names, len(tg.outputs), grad_fqns, input_grads)


def _check_constants(gm: fx.GraphModule, allowed: set[int]) -> None:
    """Raise if the lowered graph captured a tensor that is not a constant of the model."""
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        v = getattr(gm, n.target, None)
        if isinstance(v, torch.Tensor) and id(v) not in allowed and v.numel() > 1:
            raise PlannerError(
                f"lowering captured tensor constant '{n.target}' of shape {tuple(v.shape)}: a "
                "value that must be a graph input was closed over (executor bug)"
            )


def partition(
    joint: LocalJoint,
    keep: set[str] | None = None,
    policies: dict[str, str] | None = None,
    fuse_recompute: bool = False,
) -> Partition:
    """Split the local joint graph into forward and backward graphs (see module docstring).
    Values computed from parameters/buffers alone are recomputed in the backward unless they
    read one named in `keep` (None: keep them all).  `policies` (block label -> recompute
    policy, recompute.py) makes blocks recompute their activations in the backward: each
    recomputed value is made again just before the first backward op that needs it.
    `fuse_recompute` (for graphs inductor compiles): pointwise values, views and casts made
    from values the backward has anyway are recomputed rather than saved
    (`recompute_fusible`)."""
    graph = joint.gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    kind = dict(zip(phs, joint.kinds))
    name = dict(zip(phs, joint.names))
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    fwd_outs, grad_outs = outs[: joint.n_outputs], outs[joint.n_outputs :]

    # the forward computes what the outputs need; everything else runs in the backward, also
    # what needs no tangent (a norm's 2 * x): made there from saved inputs, not saved itself
    forward: set[fx.Node] = set()
    stack = [o for o in fwd_outs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in forward:
            forward.add(n)
            stack.extend(n.all_input_nodes)
    # an item of a forward op's tuple result is a forward value: the backward saves the items
    # it reads, never a whole tuple (graphs take and return flat tensors)
    forward |= {
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in forward
    }
    backward = {
        n
        for n in graph.nodes
        if kind.get(n) == TANGENT or (n.op == "call_function" and n not in forward)
    }
    params = {p for p in phs if kind[p] in (PARAM, BUFFER)}
    regather: set[fx.Node] = set()
    if keep is not None:
        regather = param_side(graph.nodes, {p for p in params if name[p] not in keep})
    of_params = param_side(graph.nodes, params)
    rule = recompute_rule(policies or {}, of_params, regather.__contains__)

    # forward values the backward reads (a gradient that is a forward value counts as read)
    needed = [
        (a, block_label(n))
        for n in graph.nodes
        if n in backward
        for a in n.all_input_nodes
        if a not in backward
    ]
    needed += [(g, None) for g in grad_outs if isinstance(g, fx.Node) and g not in backward]
    saved, recomputed = split_saved(needed, rule)
    if fuse_recompute:
        exempt = of_params | {o for o in fwd_outs if isinstance(o, fx.Node)}
        saved, recomputed = recompute_fusible(list(graph.nodes), saved, recomputed, exempt)
    order = {n: i for i, n in enumerate(graph.nodes)}
    saved.sort(key=order.__getitem__)

    fwd = _subgraph(joint.gm, [p for p in phs if kind[p] != TANGENT], fwd_outs + saved)
    tangents = [p for p in phs if kind[p] == TANGENT]
    body = _backward_body(graph, backward, tangents, set(recomputed), regather, grad_outs)
    bwd = _subgraph(joint.gm, saved + tangents, grad_outs, body)
    return Partition(
        fwd,
        bwd,
        joint.n_outputs,
        joint.grad_names,
        joint.input_grads,
        fwd_names=[name[p] for p in phs if kind[p] != TANGENT],
        saved_names=[name.get(s) for s in saved],
    )


def _backward_body(
    graph: fx.Graph, backward: set, tangents: list, recomputed: set, regather: set, grads: list
) -> list[fx.Node]:
    """The backward graph's nodes in execution order: re-gathered parameters first (the
    bucketing pass schedules them), then the ops that read a tangent, each preceded by what
    it is the first to need of the rest: values recomputed for it and backward ops that need
    no tangent.  So a block's activations are made again only when the backward reaches it."""
    body = [n for n in graph.nodes if n in recomputed and n in regather]
    lazy = (recomputed - regather) | backward
    return body + backward_schedule(list(graph.nodes), backward, tangents, lazy, set(body), grads)


def _subgraph(
    gm: fx.GraphModule, inputs: list[fx.Node], outputs: list, body: list[fx.Node] | None = None
) -> fx.GraphModule:
    """A graph with `inputs` as placeholders computing `outputs`; `body` (default: every
    ancestor of the outputs) is copied in the original order."""
    if body is None:
        need: set[fx.Node] = set()
        stack = [o for o in outputs if isinstance(o, fx.Node)]
        stop = set(inputs)
        while stack:
            n = stack.pop()
            if n in need or n in stop:
                continue
            need.add(n)
            stack.extend(n.all_input_nodes)
        body = [n for n in gm.graph.nodes if n in need]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in_{i}_{n.name}")
        env[n].meta = dict(n.meta)
    for n in body:
        if n in env or n.op == "placeholder":
            if n not in env:
                raise PlannerError(f"partition: '{n.name}' is neither an input nor computed")
            continue
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    g.lint()
    return make_graph_module(gm, g)
