"""Per-rank memory model: parameters, gradients, optimizer state, saved activations and the
activations a block recomputes.

Bytes per rank of a plan = sum over parameters of local bytes x (1 parameter + 1 gradient)
+ local numel x `optim_bytes_per_elem` (AdamW: two fp32 states = 8 bytes) + sum over saved
activations of their local bytes + the largest block's recomputed activations.

*Saved activations* are read off the joint graph under each block's recompute policy
(recompute.py): the forward values the backward reads, or, for a block that recomputes,
what its recomputation reads from outside the block; plus the forward outputs (the caller
holds them until its loss is done).  A saved view counts as its base, counted once.  When the
plan redistributes a tensor on its way into a saved view (the transpose of an all-gathered
weight, read by the backward for the input gradient), the view keeps that new copy alive: a
"copy" term, counted on the edge, in the placement the view receives.  Parameters the
executor re-gathers in the backward (`regathered`, its reshard-after-forward policy) keep
nothing of their chain alive: values computed on a parameter's single-input chain (its cast,
transpose, gathered copy) are recomputed, so they count for no saved bytes.

*Where the peak is.*  Without recomputation every saved value is alive at the
forward/backward boundary, and the step peaks there.  With it, block k's backward first makes
its recomputed values again ("recompute" terms: every non-view value the policy recomputes,
each at its local size) while the values saved by blocks before k are still alive.  So the
peak is at most  static + sum of all saved values + max over blocks of the block's
recomputed bytes:  the earlier blocks' saved values are a subset of all of them, and the
boundary (no recomputed value alive yet) is covered too.  It is attained by the last block
that recomputes when the blocks are alike.  Recomputed values all alive at once is an upper
bound too: the eager backward frees each after its last use.  Not counted: temporaries inside
one op, activation gradients of the backward, and communication buffers.

Every term is linear in the strategy choice of one node (and, for block terms, the block's
policy), so the budget is one linear row of the 0/1 program, plus one row per block bounding
the recompute peak.  In a shallow trace (repeat.py) a saved term counts once per block it
stands for (`TracedGraph.weight`); a recompute term counts once (one block at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from . import placements as P
from .recompute import block_label, block_recompute, split_saved
from .strategies import StrategyTable, resolve_source
from .trace import TracedGraph

ADAMW_BYTES_PER_ELEM = 8  # exp_avg + exp_avg_sq in fp32


@dataclass
class MemoryTerm:
    node: fx.Node  # strategy node whose choice decides the local size
    idx: int  # output index of that node
    full_bytes: float  # bytes of the global tensor, times the per-element multiplier
    kind: str  # "param" | "activation" | "copy" | "recompute"
    arg: int | None = None  # "copy": the view's input (index into its sources) whose copy is held

    @property
    def key(self) -> tuple:
        return (self.kind, self.node, self.idx, self.arg)

    @property
    def block(self) -> str | None:
        """The block whose policy decides this term (None: no block's alone)."""
        return block_label(self.node)


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


def _needed(tg: TracedGraph) -> list[tuple[fx.Node, str | None]]:
    """(forward value, block of the backward node reading it) for every read across the
    forward/backward boundary, and (output, None) for the forward outputs."""
    fwd = tg.forward_nodes
    out = []
    for node in tg.gm.graph.nodes:
        if node in fwd or node.op != "call_function":
            continue
        reader = block_label(node)
        out += [(a, reader) for a in node.all_input_nodes if a in fwd]
    out += [(o, None) for o in tg.outputs]
    return out


def _saved(tg: TracedGraph, policy: str) -> tuple[list, set[fx.Node]]:
    """(node, output index) of every saved forward tensor when every block follows `policy`,
    and the nodes the blocks recompute."""
    saved, recomputed = split_saved(_needed(tg), block_recompute(policy))
    return list(dict.fromkeys(resolve_source(n) for n in saved)), set(recomputed)


def saved_activations(
    tg: TracedGraph, table: StrategyTable, policy: str = "none"
) -> list[tuple[fx.Node, int]]:
    """(producer, output index) of every saved forward tensor (views -> base), see module doc."""
    params = set(tg.params.values()) | set(tg.buffers.values())
    seen: dict = {}
    for src in _saved(tg, policy)[0]:
        src = _base(src)
        if src[0] in params or src[0] not in table.nodes:
            continue
        v = src[0].meta.get("val")
        if isinstance(v, (list, tuple)):
            v = v[src[1]]
        if isinstance(v, torch.Tensor):
            seen[src] = True
    return list(seen)


def saved_view_inputs(
    tg: TracedGraph, table: StrategyTable, policy: str = "none"
) -> list[tuple[fx.Node, int]]:
    """(view node, source index) of every edge into a view on a saved tensor's chain to its
    base: a redistribution there makes the copy the saved view keeps alive."""
    edges: dict = {}
    for node, _idx in _saved(tg, policy)[0]:
        while _is_view(node) and node in table.nodes:
            ns = table.nodes[node]
            if not ns.sources:
                break
            edges[(node, 0)] = True
            node = ns.sources[0][0]
    return list(edges)


def recomputed_values(
    tg: TracedGraph, table: StrategyTable, policy: str
) -> list[tuple[fx.Node, int]]:
    """(node, output index) of every tensor the blocks make again under `policy` (views,
    which allocate nothing, left out)."""
    out = []
    for node in _saved(tg, policy)[1]:
        if node not in table.nodes or _is_view(node):
            continue
        v = node.meta.get("val")
        vals = list(v) if isinstance(v, (list, tuple)) else [v]
        out += [(node, i) for i, x in enumerate(vals) if isinstance(x, torch.Tensor)]
    return out


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
    policy: str = "none",
) -> list[MemoryTerm]:
    """Every term of the model when every block follows `policy` (module docstring)."""
    terms = []
    chain = param_chains(tg, table) if regathered else {}
    recomputed = lambda n: chain.get(n) in regathered  # noqa: E731
    for pnode in tg.params.values():
        v = pnode.meta["val"]
        per_elem = 2 * v.element_size() + optim_bytes_per_elem
        terms.append(MemoryTerm(pnode, 0, float(v.numel() * per_elem), "param"))
    for node, idx in saved_activations(tg, table, policy):
        if recomputed(node):
            continue
        v = _source_value((node, idx))
        terms.append(MemoryTerm(node, idx, float(v.numel() * v.element_size()), "activation"))
    for node, k in saved_view_inputs(tg, table, policy):
        if recomputed(node):
            continue
        v = _source_value(table.nodes[node].sources[k])
        terms.append(MemoryTerm(node, 0, float(v.numel() * v.element_size()), "copy", arg=k))
    if policy != "none":
        for node, idx in recomputed_values(tg, table, policy):
            v = _source_value((node, idx))
            terms.append(MemoryTerm(node, idx, float(v.numel() * v.element_size()), "recompute"))
    return terms


def mixed_terms(
    tg: TracedGraph,
    table: StrategyTable,
    counts: dict[str, dict[str, int]],
    optim_bytes_per_elem: int = ADAMW_BYTES_PER_ELEM,
    regathered: frozenset[str] = frozenset(),
) -> list[tuple[MemoryTerm, str | None, int]]:
    """(term, policy, multiplier) when the blocks a traced block stands for follow the policies
    `counts[block] = {policy: how many blocks}` (missing: "none" for all).  A term of a block
    counts once per block following a policy that keeps it (a "recompute" term once: one block
    at a time; `policy` groups them); a term of no block counts when any policy in use keeps it
    (an upper bound where they differ), with the traced multiplicity."""
    blocks = {block_label(n) for n in table.nodes} - {None}
    share = {b: counts.get(b) or {"none": block_multiplicity(tg, table, b)} for b in blocks}
    used = sorted({p for c in share.values() for p, k in c.items() if k} or {"none"})
    out: dict[tuple, tuple] = {}
    for p in used:
        for t in memory_terms(tg, table, optim_bytes_per_elem, regathered, p):
            b = t.block
            if b is None:
                if t.kind != "recompute":
                    out.setdefault(t.key, (t, None, tg.weight(t.node)))
            elif share[b].get(p):
                k = 1 if t.kind == "recompute" else share[b][p]
                out.setdefault(t.key + (p,), (t, p, k))
    return list(out.values())


def block_multiplicity(tg: TracedGraph, table: StrategyTable, block: str) -> int:
    """How many blocks of the whole model traced block `block` stands for."""
    return next(tg.weight(n) for n in table.nodes if block_label(n) == block)


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
    counts: dict[str, dict[str, int]] | None = None,
) -> dict[str, float]:
    """Predicted bytes per rank, by kind, for a solved choice (node -> strategy index) and
    the blocks' recompute policies (`counts`, as `mixed_terms` takes them)."""
    out = {
        "param_bytes_per_rank": 0.0,
        "grad_bytes_per_rank": 0.0,
        "optim_bytes_per_rank": 0.0,
        "activation_bytes_per_rank": 0.0,
    }
    recompute: dict[tuple, float] = {}
    for t, policy, k in mixed_terms(tg, table, counts or {}, optim_bytes_per_elem, regathered):
        if t.kind == "copy":
            ns = table.nodes[t.node]
            src_node, src_idx = ns.sources[t.arg]
            emitted = table.nodes[src_node].strategies[choice[src_node]].out[src_idx]
            required = ns.strategies[choice[t.node]].ins[t.arg]
            out["activation_bytes_per_rank"] += (
                t.full_bytes * copy_fraction(t, table, emitted, required) * k
            )
            continue
        f = term_fraction(t, table, choice[t.node]) * k
        if t.kind == "recompute":
            key = (t.block, policy)
            recompute[key] = recompute.get(key, 0.0) + t.full_bytes * f
        elif t.kind == "param":
            v = t.node.meta["val"]
            local = v.numel() * f
            out["param_bytes_per_rank"] += local * v.element_size()
            out["grad_bytes_per_rank"] += local * v.element_size()
            out["optim_bytes_per_rank"] += local * optim_bytes_per_elem
        else:
            out["activation_bytes_per_rank"] += t.full_bytes * f
    out["recompute_bytes_per_rank"] = max(recompute.values(), default=0.0)
    out["peak_bytes_per_rank"] = sum(out.values())
    return out
