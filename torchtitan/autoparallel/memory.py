"""Per-rank memory model: parameters, gradients, optimizer state and saved activations.

Bytes per rank of a plan = sum over parameters of local bytes x (1 parameter + 1 gradient)
+ local numel x `optim_bytes_per_elem` (AdamW: two fp32 states = 8 bytes) + sum over saved
activations of their local bytes.  Saved activations are read off the joint graph: the
outputs of forward nodes consumed by a backward node (what autograd keeps alive between
forward and backward), and the forward outputs (the caller holds them until its loss is
done); a saved view counts as its base, counted once.  When the plan redistributes a tensor
on its way into a saved view (the transpose of an all-gathered weight, read by the backward
for the input gradient), the view keeps that new copy alive: a "copy" term, counted on the
edge, in the placement the view receives.  All of them are
assumed alive at once (the forward/backward boundary), which is where a training step
without activation checkpointing peaks.  Temporary buffers inside one op are not counted.
Parameters the executor re-gathers in the backward (`regathered`, its reshard-after-forward
policy) keep nothing of their chain alive: values computed on a parameter's single-input chain
(its cast, transpose, gathered copy) are recomputed, so they count for no saved bytes.

Every term is linear in the strategy choice of one node, so the budget is one linear row
of the 0/1 program.  In a shallow trace (repeat.py) a term counts once per block it stands
for (`TracedGraph.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from . import placements as P
from .strategies import StrategyTable, resolve_source
from .trace import TracedGraph

ADAMW_BYTES_PER_ELEM = 8  # exp_avg + exp_avg_sq in fp32


@dataclass
class MemoryTerm:
    node: fx.Node  # strategy node whose choice decides the local size
    idx: int  # output index of that node
    full_bytes: float  # bytes of the global tensor, times the per-element multiplier
    kind: str  # "param" | "activation" | "copy"
    arg: int | None = None  # "copy": the view's input (index into its sources) whose copy is held


def _base(src):
    node, idx = src
    while _is_view(node):
        node, idx = resolve_source(node.args[0])
    return node, idx


def _is_view(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
    )


def _saved(tg: TracedGraph) -> list[tuple[fx.Node, int]]:
    """(node, output index) of every forward tensor the backward reads, and the outputs."""
    fwd = tg.forward_nodes
    seen: dict = {}
    for node in tg.gm.graph.nodes:
        if node in fwd or node.op != "call_function":
            continue
        for a in node.all_input_nodes:
            if a in fwd:
                seen[resolve_source(a)] = True
    for out in tg.outputs:
        seen[resolve_source(out)] = True
    return list(seen)


def saved_activations(tg: TracedGraph, table: StrategyTable) -> list[tuple[fx.Node, int]]:
    """(producer, output index) of every saved forward tensor (views -> base), see module doc."""
    params = set(tg.params.values()) | set(tg.buffers.values())
    seen: dict = {}
    for src in _saved(tg):
        src = _base(src)
        if src[0] in params or src[0] not in table.nodes:
            continue
        v = src[0].meta.get("val")
        if isinstance(v, (list, tuple)):
            v = v[src[1]]
        if isinstance(v, torch.Tensor):
            seen[src] = True
    return list(seen)


def saved_view_inputs(tg: TracedGraph, table: StrategyTable) -> list[tuple[fx.Node, int]]:
    """(view node, source index) of every edge into a view on a saved tensor's chain to its
    base: a redistribution there makes the copy the saved view keeps alive."""
    edges: dict = {}
    for node, _idx in _saved(tg):
        while _is_view(node) and node in table.nodes:
            ns = table.nodes[node]
            if not ns.sources:
                break
            edges[(node, 0)] = True
            node = ns.sources[0][0]
    return list(edges)


def param_chains(tg: TracedGraph, table: StrategyTable) -> dict[fx.Node, str]:
    """Nodes on a parameter's single-input chain (the parameter, its cast, transpose, views)
    -> the parameter's FQN."""
    owner: dict[fx.Node, str] = {}
    for fqn, pnode in tg.params.items():
        frontier = [pnode]
        while frontier:
            n = frontier.pop()
            owner[n] = fqn
            for u in n.users:
                ns = table.nodes.get(u)
                if ns is not None and len(ns.sources) == 1 and u not in owner:
                    frontier.append(u)
    return owner


def chain_up(table: StrategyTable, start: fx.Node) -> list[fx.Node]:
    """`start` and the producers above it while each has exactly one input (a gradient's
    cast, transpose, views back to the op that made it)."""
    chain, node = [], start
    while node in table.nodes and len(table.nodes[node].sources) == 1 and node not in chain:
        chain.append(node)
        node = table.nodes[node].sources[0][0]
    return chain


def memory_terms(
    tg: TracedGraph,
    table: StrategyTable,
    optim_bytes_per_elem: int = ADAMW_BYTES_PER_ELEM,
    regathered: frozenset[str] = frozenset(),
) -> list[MemoryTerm]:
    terms = []
    chain = param_chains(tg, table) if regathered else {}
    recomputed = lambda n: chain.get(n) in regathered  # noqa: E731
    for pnode in tg.params.values():
        v = pnode.meta["val"]
        per_elem = 2 * v.element_size() + optim_bytes_per_elem
        terms.append(MemoryTerm(pnode, 0, float(v.numel() * per_elem), "param"))
    for node, idx in saved_activations(tg, table):
        if recomputed(node):
            continue
        v = node.meta["val"]
        if isinstance(v, (list, tuple)):
            v = v[idx]
        terms.append(MemoryTerm(node, idx, float(v.numel() * v.element_size()), "activation"))
    for node, k in saved_view_inputs(tg, table):
        if recomputed(node):
            continue
        v = _source_value(table.nodes[node].sources[k])
        terms.append(MemoryTerm(node, 0, float(v.numel() * v.element_size()), "copy", arg=k))
    return terms


def _source_value(src) -> torch.Tensor:
    v = src[0].meta["val"]
    return v[src[1]] if isinstance(v, (list, tuple)) else v


def copy_fraction(term: MemoryTerm, table: StrategyTable, emitted, required) -> float:
    """Local fraction held by a "copy" term when its edge goes emitted -> required."""
    if required is None or emitted == required:
        return 0.0
    v = _source_value(table.nodes[term.node].sources[term.arg])
    return P.shard_fraction(v.shape, required, table.mesh_shape)


def term_fraction(term: MemoryTerm, table: StrategyTable, s: int) -> float:
    """Local fraction of a "param"/"activation" term when its node uses strategy s."""
    st = table.nodes[term.node].strategies[s]
    pl = st.out[term.idx] if term.idx < len(st.out) else None
    if pl is None:
        return 1.0
    v = term.node.meta["val"]
    if isinstance(v, (list, tuple)):
        v = v[term.idx]
    return P.shard_fraction(v.shape, pl, table.mesh_shape)


def plan_memory(
    tg: TracedGraph,
    table: StrategyTable,
    choice: dict,
    optim_bytes_per_elem: int = ADAMW_BYTES_PER_ELEM,
    regathered: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """Predicted bytes per rank, by kind, for a solved choice (node -> strategy index)."""
    out = {
        "param_bytes_per_rank": 0.0,
        "grad_bytes_per_rank": 0.0,
        "optim_bytes_per_rank": 0.0,
        "activation_bytes_per_rank": 0.0,
    }
    for t in memory_terms(tg, table, optim_bytes_per_elem, regathered):
        if t.kind == "copy":
            ns = table.nodes[t.node]
            src_node, src_idx = ns.sources[t.arg]
            emitted = table.nodes[src_node].strategies[choice[src_node]].out[src_idx]
            required = ns.strategies[choice[t.node]].ins[t.arg]
            out["activation_bytes_per_rank"] += (
                t.full_bytes * copy_fraction(t, table, emitted, required) * tg.weight(t.node)
            )
            continue
        f = term_fraction(t, table, choice[t.node]) * tg.weight(t.node)
        if t.kind == "param":
            v = t.node.meta["val"]
            local = v.numel() * f
            out["param_bytes_per_rank"] += local * v.element_size()
            out["grad_bytes_per_rank"] += local * v.element_size()
            out["optim_bytes_per_rank"] += local * optim_bytes_per_elem
        else:
            out["activation_bytes_per_rank"] += t.full_bytes * f
    out["peak_bytes_per_rank"] = sum(out.values())
    return out
