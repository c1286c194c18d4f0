"""Share solver variables between structurally identical nodes (repeated layers).

Transformer layers repeat, so the joint graph holds N copies of the same sub-graph.  We give
each node a structural signature — op, constant arguments, output shape, its candidate
strategies — and refine it a few rounds with the signatures of its producers (in argument
order) and consumers (as a multiset), Weisfeiler-Lehman style.  Parameters group only with
the same parameter of another layer (name pattern, below).  Nodes with equal signatures
share one set of solver variables (their costs add up), so the program stops growing with
depth.  Any grouping is *consistent* (edges between groups share variables exactly); it only
restricts the search to plans where identical nodes are sharded identically.

User inputs, tangents and pinned nodes are never grouped (they carry pins).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set

import torch
import torch.fx as fx

from ..trace.repeat import name_pattern
from .table import StrategyTable


def _const(a):
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("N",)
    if isinstance(a, (list, tuple)):
        return tuple(_const(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _const(v)) for k, v in a.items()))
    return repr(a)


def cluster_nodes(
    table: StrategyTable,
    rounds: int = 4,
    unique: Set[fx.Node] = frozenset(),
    names: dict[fx.Node, str] | None = None,
) -> dict[fx.Node, fx.Node]:
    """Map every strategy node to its group representative (the first member in graph order).

    Nodes in `unique` (e.g. pinned parameters) are never grouped with others.  `names` gives
    parameter/buffer placeholders their FQN: only those with the same `name_pattern` may
    group, so same-shaped weights of different roles (an attention block's wq and wo) are
    never forced to share a placement, while the same weight of repeated layers is."""
    names = names or {}
    nodes = list(table.nodes)
    strat_sig: dict[int, int] = {}
    sig: dict[fx.Node, int] = {}
    for n in nodes:
        ns = table.nodes[n]
        key = id(ns.strategies)
        if key not in strat_sig:
            strat_sig[key] = hash(tuple(ns.strategies))
        base: tuple
        if ns.role in ("input", "tangent") or n in unique:
            base = ("unique", n.name)
        else:
            base = (
                ns.role,
                str(n.target) if n.op == "call_function" else "ph",
                _const(n.args),
                _const(n.kwargs),
                name_pattern(names.get(n, "")),
            )
        sig[n] = hash((base, strat_sig[key]))
    users: dict[fx.Node, list[tuple[fx.Node, int]]] = defaultdict(list)
    for n in nodes:
        for k, (src, _idx) in enumerate(table.nodes[n].sources):
            users[src].append((n, k))
    for _ in range(rounds):
        new = {}
        for n in nodes:
            ns = table.nodes[n]
            ins = tuple((sig[s], i) for s, i in ns.sources)
            outs = tuple(sorted((sig[u], k) for u, k in users[n]))
            new[n] = hash((sig[n], ins, outs))
        sig = new
    first: dict[int, fx.Node] = {}
    rep: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        rep[n] = first.setdefault(sig[n], n)
    return rep
