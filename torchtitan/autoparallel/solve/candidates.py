"""One mesh's candidate strategies, ready to be solved over: the strategy table (stage 2),
pruned of what no producer can feed, priced (prices.py), and grouped per set of pins."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from ..cost.model import CostModel, Estimator
from ..strategies.cluster import cluster_nodes
from ..strategies.table import StrategyTable, build_strategies
from ..trace.joint import TracedGraph
from .precision import cast_edges
from .prices import GraphPrices
from .prune import prune_unreachable

log = logging.getLogger(__name__)


@dataclass
class Candidates:
    table: StrategyTable
    prices: GraphPrices
    timings: dict[str, float]
    _groups: dict[frozenset, dict[fx.Node, fx.Node]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tg: TracedGraph,
        mesh: DeviceMesh,
        cost_model: CostModel,
        param_dtype: torch.dtype | None,
        memo: dict | None = None,
    ) -> Candidates:
        """`memo`: `build_strategies`'s, shared by the meshes of one shape."""
        t = time.perf_counter()
        table = build_strategies(tg, mesh, memo)
        timings = {"strategies": time.perf_counter() - t}
        log.info(
            "%d nodes; strategies in %.2fs (memo %d hits / %d misses)",
            len(tg.gm.graph.nodes),
            timings["strategies"],
            table.memo_hits,
            table.memo_misses,
        )
        t = time.perf_counter()
        est = Estimator(cost_model, tuple(mesh.shape))
        no_comm = cast_edges(tg, table) if param_dtype is not None else frozenset()
        removed = prune_unreachable(table, est, no_comm)
        timings["prune"] = time.perf_counter() - t
        log.info("pruned %d unreachable strategies", removed)
        return cls(table, GraphPrices(tg, table, est, frozenset(no_comm)), timings)

    def clustered(self, pinned: frozenset[fx.Node], tg: TracedGraph) -> dict[fx.Node, fx.Node]:
        """Node -> the representative whose variables it shares (cluster.py), pinned nodes
        kept apart so a pin never lands on a group shared with an unpinned node."""
        if pinned not in self._groups:
            names = {n: f for f, n in {**tg.params, **tg.buffers}.items()}
            rep = cluster_nodes(self.table, unique=pinned, names=names)
            log.info(
                "%d nodes share %d variable groups", len(self.table.nodes), len(set(rep.values()))
            )
            self._groups[pinned] = rep
        return self._groups[pinned]
