"""A pass over the strategy table before the program is built: drop strategies no producer
can feed with one collective."""

from __future__ import annotations

from collections.abc import Set

from ..cost.model import Estimator
from ..graph import placements as P
from ..graph.edge_keys import ConsumerEdge
from ..strategies.table import Source, StrategyTable
from .redistributions import direct, finite


def prune_unreachable(
    table: StrategyTable, est: Estimator, no_comm_edges: Set[ConsumerEdge] = frozenset()
) -> int:
    """Drop strategies whose inputs no live producer placement can reach with one collective.

    Works in graph order so pruning propagates forward; returns the number of strategies
    removed.  Placeholders keep all their options.
    """
    removed = 0
    # Repeated layers repeat the same strategy lists and the same producer sets, so every
    # answer is memoised across nodes: emitted placement sets per (strategy list, output),
    # reachability per (emitted set, requirement, frozen), and the surviving list per
    # (strategy list, emitted sets, frozen flags) — identical nodes keep sharing one list.
    keep: list = []  # keeps memoised lists alive so their ids stay unique
    emitted_memo: dict = {}
    ok_memo: dict = {}
    live_memo: dict = {}

    def emitted_of(src: Source) -> frozenset:
        ns_src = table.nodes[src[0]]
        key = (id(ns_src.strategies), src[1])
        e = emitted_memo.get(key)
        if e is None:
            keep.append(ns_src.strategies)
            e = emitted_memo[key] = frozenset(
                pl for pl in ns_src.out_placements(src[1]) if pl is not None
            )
        return e

    def ok(e: frozenset, r: P.Placements | None, frozen: bool) -> bool:
        if r is None:
            return True
        key = (e, r, frozen)
        hit = ok_memo.get(key)
        if hit is None:
            hit = ok_memo[key] = any(
                o == r or (not frozen and direct(o, r) and finite(o, r)) for o in e
            )
        return hit

    for node, ns in table.nodes.items():
        if not ns.sources:
            continue
        emitted = tuple(emitted_of(src) for src in ns.sources)
        frozen = tuple(ConsumerEdge(node, k) in no_comm_edges for k in range(len(ns.sources)))
        key = (id(ns.strategies), emitted, frozen)
        live = live_memo.get(key)
        if live is None:
            keep.append(ns.strategies)
            live = [
                st
                for st in ns.strategies
                if all(ok(emitted[k], r, frozen[k]) for k, r in enumerate(st.ins))
            ]
            if len(live) == len(ns.strategies):
                live = ns.strategies
            live_memo[key] = live
        if live is not ns.strategies:
            removed += len(ns.strategies) - len(live)
            ns.strategies = live
    return removed
