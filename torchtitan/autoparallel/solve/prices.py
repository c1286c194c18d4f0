"""What the placement program prices, for one traced graph, strategy table and cost model:
each strategy's compute time, the redistributions an edge may use and their time, and which
nodes are parameter-side (their communication overlaps compute).  Memoised: repeated layers
ask the same questions many times."""

from __future__ import annotations

import torch.fx as fx

from ..cost.memory import chain_up, param_chains
from ..cost.model import INF, Estimator
from ..graph.edge_keys import ConsumerEdge
from ..strategies.table import StrategyTable, resolve_source
from ..trace.joint import TracedGraph
from .redistributions import direct, source_value


class GraphPrices:
    """Prices of one graph's choices (`est`: the cost model on this mesh); `no_comm_edges`:
    consumer edges on which no redistribution may happen (mixed-precision casts)."""

    def __init__(
        self,
        tg: TracedGraph,
        table: StrategyTable,
        est: Estimator,
        no_comm_edges: frozenset[ConsumerEdge] = frozenset(),
    ):
        self.tg = tg
        self.table = table
        self.est = est
        self.mesh_shape = table.mesh_shape
        self.no_comm_edges = frozenset(no_comm_edges)
        self._compute: dict[tuple[fx.Node, int], float] = {}
        self._param_side: set | None = None
        self._grad_side: set = set()
        self._pair_memo: dict = {}
        self._allowed_memo: dict = {}

    def param_side_nodes(self) -> set:
        """Nodes on a parameter's single-input chain (param, cast, transpose, view) and on a
        gradient's single-input chain back from the gradient output.  Communication on edges
        out of the former / into the latter is parameter-side (overlappable with compute)."""
        if self._param_side is None:
            side = set(param_chains(self.tg, self.table))
            self._grad_side = set()
            for g in self.tg.grads.values():
                if g is not None:
                    self._grad_side.update(chain_up(self.table, resolve_source(g)[0]))
            self._param_side = side
        return self._param_side

    def grad_side_nodes(self) -> set:
        """Nodes on a gradient's single-input chain back from the gradient output."""
        self.param_side_nodes()
        return self._grad_side

    def compute_cost(self, node: fx.Node, s: int) -> float:
        key = (node, s)
        c = self._compute.get(key)
        if c is None:
            ns = self.table.nodes[node]
            st = ns.strategies[s]
            if node.op != "call_function":
                c = 0.0
            else:
                in_vals = [source_value(src) for src in ns.sources]
                v = node.meta["val"]
                out_vals = list(v) if isinstance(v, (list, tuple)) else [v]
                c = self.est.compute_us(
                    node.target, in_vals, list(st.ins), out_vals, list(st.out), node.args
                )
            self._compute[key] = c
        return c

    def pairs(
        self,
        emitted: tuple,
        required: tuple,
        shape: tuple,
        elem_size: int,
        frozen: bool,
        sink: bool = False,
        bucketed: bool = False,
    ) -> list:
        """(index into `emitted`, index into `required`, cost, whether the placement changes)
        of each redistribution an edge may use; memoised, as repeated layers ask the same
        question many times (indices, not placements: the program files each pair under
        both ends, and placements hash slowly).  Edges into a sink (a gradient
        leaving in its parameter's placement, an output in its pinned one) may take any
        number of steps: there are few of them, and a gradient that is partial on two mesh
        dims (a sequence-parallel norm's weight under FSDP) needs two collectives.
        `bucketed`: see `comm_us`."""
        key = (emitted, required, shape, elem_size, frozen, sink, bucketed)
        hit = self._pair_memo.get(key)
        if hit is None:
            comm = self.est.comm_us
            hit = self._pair_memo[key] = [
                (i, j, c, moves)
                for i, j, o, r, moves in self._allowed(emitted, required, frozen, sink)
                if (c := comm(o, r, shape, elem_size, bucketed)) != INF
            ]
        return hit

    def _allowed(self, emitted: tuple, required: tuple, frozen: bool, sink: bool) -> list:
        """(i, j, emitted[i], required[j], whether it moves) of the pairs an edge may use,
        whatever the value's shape: edges of different shapes ask about the same sets."""
        key = (emitted, required, frozen, sink)
        hit = self._allowed_memo.get(key)
        if hit is None:
            hit = self._allowed_memo[key] = [
                (i, j, o, r, o != r)
                for i, o in enumerate(emitted)
                for j, r in enumerate(required)
                if (o == r or not frozen) and (sink or direct(o, r))
            ]
        return hit

    def param_bytes(self, node: fx.Node) -> int:
        v = node.meta["val"]
        return v.numel() * v.element_size()
