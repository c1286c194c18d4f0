"""When each activation of the joint graph is alive, in the order the executor runs it.

The executor (lower.py) runs the forward graph, then the backward graph: the backward's ops in
graph order, each preceded by the values recomputed for it (recompute.py), every value freed
after its last use, except the outputs' gradients (the caller's autograd holds them until the
backward returns) and the parameters' gradients (unreduced until their unit's reduction, after
the unit's backward).  `snapshots` replays that order on the planner's joint graph, under one
recompute policy for every block, and reports the moments the memory model (memory.py) needs:

* `"boundary"`: the backward's start.  Every saved value, the forward outputs (the caller's
  loss still holds them) and their gradients (the tangents) are alive.
* one per block, and one for the rest (`None`: the head, the loss's backward, glue): the moment
  in that part of the backward when the most bytes are alive, at global size (a proxy: the
  shardings are what the solver decides).

A snapshot lists the values alive then as (node, output index) of the strategy nodes whose
choice sets their local size, split into *saved* (forward values kept for the backward) and
*transient* (made in the backward: gradients and recomputed values).  Views share their base's
storage and count as the base; parameters and buffers are not listed (memory.py counts them
as static terms, and the reduced gradients apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph.nodes import arg_node, getitem_source, is_getitem, is_view, param_side
from ..policies.recompute import backward_schedule, block_label, recompute_rule, split_saved
from ..trace.joint import TracedGraph

BOUNDARY = "boundary"


@dataclass
class Snapshot:
    where: str | None  # BOUNDARY, a block label, or None (the backward outside the blocks)
    saved: list[tuple[fx.Node, int]] = field(default_factory=list)
    transient: list[tuple[fx.Node, int]] = field(default_factory=list)


def _nbytes(node: fx.Node, idx: int) -> int:
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = v[idx] if idx < len(v) else None
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def backward_reads(tg: TracedGraph) -> list[tuple[fx.Node, str | None]]:
    """(forward value, block of the backward node reading it) for every read across the
    forward/backward boundary, and (output, None) for the forward outputs."""
    fwd = tg.forward_nodes
    out = []
    for node in tg.gm.graph.nodes:
        if node.op == "call_function" and node not in fwd:
            out += [(a, block_label(node)) for a in node.all_input_nodes if a in fwd]
    return out + [(o, None) for o in tg.outputs]


def parameter_valued(tg: TracedGraph) -> set[fx.Node]:
    """Nodes of the joint graph computed from parameters and buffers alone."""
    return param_side(tg.gm.graph.nodes, set(tg.params.values()) | set(tg.buffers.values()))


def snapshots(tg: TracedGraph, policy: str, regathered=None) -> list[Snapshot]:
    """The moments of the step's backward (module docstring) with every block following
    `policy`; `regathered(node)`: whether a parameter-valued node is made again in the
    backward (its parameters are gathered again, regather.py)."""
    grads = {g for g in tg.grads.values() if g is not None}
    rule = recompute_rule(policy, parameter_valued(tg), regathered or (lambda n: False))
    _saved, recomputed = split_saved(backward_reads(tg), rule)
    events, first_backward = _events(tg, set(recomputed), grads)
    born, last = _lifetimes(tg, events, first_backward, set(recomputed), grads)
    values = [k for k in born if _nbytes(k[0], k[1])]

    def split(t: int, where) -> Snapshot:
        snap = Snapshot(where)
        for k in values:
            if born[k] <= t <= last[k]:
                forward_value = born[k] < first_backward and not k[2]
                (snap.saved if forward_value else snap.transient).append((k[0], k[1]))
        return snap

    weight = lambda k: tg.weight(k[0]) if born[k] < first_backward and not k[2] else 1  # noqa: E731
    best = _busiest_per_block(events, values, born, last, weight)
    out = [split(first_backward, BOUNDARY)]
    out += [split(t, where) for where, (_b, t) in best.items()]
    return out


def _value_key(a: fx.Node, backward: bool, recomputed: set) -> tuple:
    """The value `a` reads: (node, output index, recomputed?), a view as its base."""
    idx = 0
    while True:
        if is_getitem(a):
            a, idx = getitem_source(a)
            continue
        if is_view(a):
            a = arg_node(a)
            continue
        break
    return (a, idx, backward and a in recomputed)


def _events(tg: TracedGraph, recomputed: set, grads: set) -> tuple[list, int]:
    """The step's ops in the executor's order, each with whether it runs in the backward,
    and the index of the first backward op."""
    graph, fwd = tg.gm.graph, tg.forward_nodes
    events: list[tuple[fx.Node, bool]] = [  # (node, runs in the backward)
        (n, False) for n in graph.nodes if n in fwd and n.op == "call_function"
    ]
    first_backward = len(events)
    # as lower.py orders the backward: the ops reading a tangent in graph order, each after
    # the recomputed values and tangent-free backward ops it is the first to need
    backward = {n for n in graph.nodes if n.op == "call_function" and n not in fwd}
    tangents = [t for t in tg.tangents if t is not None]
    schedule = backward_schedule(
        list(graph.nodes), backward, tangents, recomputed | backward, set(), list(grads)
    )
    return events + [(n, True) for n in schedule], first_backward


def _lifetimes(
    tg: TracedGraph, events: list, first_backward: int, recomputed: set, grads: set
) -> tuple[dict[tuple, int], dict[tuple, int]]:
    """When each value (`_value_key`) is made and last read, as event indices; parameters,
    inputs and gradients are not counted (the memory model holds them apart)."""
    static = set(tg.params.values()) | set(tg.buffers.values()) | set(tg.inputs)
    born: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for t, (n, backward) in enumerate(events):
        for a in n.all_input_nodes:
            k = _value_key(a, backward, recomputed)
            if k[0] in static:
                continue
            last[k] = t
            born.setdefault(k, first_backward if k[0].op == "placeholder" else t)
        if not (is_view(n) or is_getitem(n)):
            v = n.meta.get("val")
            outs = len(v) if isinstance(v, (list, tuple)) else 1
            for i in range(outs):
                k = (n, i, backward and n in recomputed)
                born.setdefault(k, t)
                last.setdefault(k, t)
    for o in tg.outputs:  # held by the caller until its loss's backward starts
        k = _value_key(o, False, recomputed)
        last[k] = max(last.get(k, 0), first_backward)
    end = len(events) - 1
    for tangent in tg.tangents:  # the caller's autograd holds them until the backward returns
        if tangent is not None:
            last[_value_key(tangent, True, recomputed)] = end
    block_end = {block_label(n): i for i, (n, backward) in enumerate(events) if backward}
    for g in grads:  # unreduced until its unit's reduction, after the unit's backward
        k = _value_key(g, True, recomputed)
        if k in born:
            last[k] = max(last[k], block_end.get(block_label(g), end) if block_label(g) else end)
    return born, last


def _busiest_per_block(events: list, values: list, born: dict, last: dict, weight) -> dict:
    """Per block label (None outside blocks): (bytes, event index) of its busiest backward
    moment."""
    best: dict = {}
    total = 0
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}
    for k in values:
        starts.setdefault(born[k], []).append(k)
        ends.setdefault(last[k], []).append(k)
    for t, (n, backward) in enumerate(events):
        for k in starts.get(t, ()):
            total += _nbytes(k[0], k[1]) * weight(k)
        if backward:
            where = block_label(n)
            if where not in best or total > best[where][0]:
                best[where] = (total, t)
        for k in ends.get(t, ()):
            total -= _nbytes(k[0], k[1]) * weight(k)
    return best
