"""Mixed precision as constraints: where a cast sits, communication must not."""

from __future__ import annotations

import torch

from ..cost.memory import chain_up
from ..graph.edge_keys import ConsumerEdge
from ..strategies.table import StrategyTable
from ..trace.joint import TracedGraph


def cast_edges(tg: TracedGraph, table: StrategyTable) -> set[ConsumerEdge]:
    """Edges that must not communicate: param -> its low-precision cast (gather after the
    cast), and the gradient's high-precision cast input (reduce after the cast)."""
    edges = set()
    casts = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    for pnode in tg.params.values():
        for user in pnode.users:
            if user.target in casts and user in table.nodes:
                edges.add(ConsumerEdge(user, 0))
    for g in tg.grads.values():
        if g is None or g.target not in casts or g not in table.nodes:
            continue
        # the single-input chain above the cast (t, view, ...) up to the op that made the
        # gradient: a reduction anywhere on it would run in low precision
        edges.update(ConsumerEdge(node, 0) for node in chain_up(table, g))
    return edges
