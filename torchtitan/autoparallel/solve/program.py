"""The placement program: one 0/1 program for one traced graph, built one constraint family
per method (`PlacementProgram.add_*`, formula in each docstring).

Variables
* `x[n, s]` (binary): node n uses strategy s.  One-hot per node.
* `y[e, o, r]` (continuous, 0..1): on edge e, the producer emits placement o and the consumer
  needs placement r.  Tight ("marginal") formulation: for every o, sum_r y = sum of x over the
  producer's strategies emitting o; for every r, sum_o y = sum of x over the consumer's
  strategies needing r.  Pairs whose redistribution is impossible get no variable.
* `w[k, r]` (binary): the placement in which graph output k leaves the graph (a "sink").
* `h[v, p]` (binary): for a value read by several consumers, the one placement p it is
  redistributed to ("hub", `hub_columns`); its consumers' edges start from the hub.

Constraints beyond consistency: a parameter's gradient leaves in the parameter's placement,
a forward output's tangent enters in the output's placement, user pins, and the
parameter-memory budget.  Objective: compute time of chosen strategies + redistribution time
of chosen edges (+ a tiny tie-breaker per placement change).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from ..cost.liveness import BOUNDARY
from ..cost.memory import MemoryTerm, copy_fraction, memory_rows, param_chains, term_fraction
from ..errors import ConstraintError
from ..graph import placements as P
from ..graph.edge_keys import (
    ConsumerEdge,
    EdgeKey,
    GradEdge,
    HubEdge,
    InputGradEdge,
    OutputEdge,
)
from ..ops.collective_ops import COLLECTIVE_OPS
from ..policies.regather import Regather
from ..strategies.table import NodeStrategies, Source, placed, resolve_source
from .constraints import CollectiveDim, MemoryBudget, OutputPin, ParameterBudget, Pin
from .milp import OPTIMAL, Milp
from .prices import GraphPrices
from .recompute_choices import RecomputeChoices
from .redistributions import source_value
from .regather_choices import RegatherChoices

log = logging.getLogger(__name__)

TIE_BREAK_US = 0.01


@dataclass
class Solution:
    choice: dict[fx.Node, int]  # node -> strategy index
    sink_placement: dict[int, P.Placements]  # output index -> placement
    grad_placement: dict[str, P.Placements]
    compute_us: float
    comm_us: float
    objective: float
    status: str
    optimal: bool
    gap: float | None  # proven relative gap to the best bound
    num_vars: int
    num_rows: int
    # predicted us per instance of each edge (ConsumerEdge, HubEdge, GradEdge, OutputEdge)
    edge_comm: dict = field(default_factory=dict)
    overlappable_comm_us: float = 0.0  # parameter gathers / gradient reductions
    exposed_comm_us: float = 0.0  # activation comm + overlappable comm not hidden by compute
    hubs: dict = field(default_factory=dict)  # (producer, output idx) -> placement (hub_columns)
    # traced block label -> {policy: how many of the blocks it stands for follow it}
    recompute: dict[str, dict[str, int]] = field(default_factory=dict)
    recompute_us: float = 0.0  # recomputed compute and communication in the backward
    regathered: frozenset[str] = frozenset()  # traced parameters gathered again (regather.py)
    regather_us: float = 0.0  # the backward's gathering again (in comm_us too)
    build_s: float = 0.0  # building the program
    solve_s: float = 0.0  # HiGHS


class PlacementProgram:
    """One 0/1 program, built one constraint family at a time (variables in the module
    docstring); `solution` reads a plan off the solver's values.

    Notation: `x[n, s]` node n takes strategy s; `y[e, o, r]` edge e redistributes o -> r;
    `h[v, p]` value v's hub placement; `w[k, p]` sink k's placement.  Nodes that share a
    representative (`rep`) share their x, and the costs are multiplied by how many nodes
    (and shallow-trace blocks, `tg.weight`) each variable stands for.
    """

    def __init__(
        self,
        prices: GraphPrices,
        rep: dict[fx.Node, fx.Node] | None,
        regather: Regather,
        recompute: str | dict[str, dict[str, int]],
    ):
        self.prices = prices
        self.tg, self.table, self.est = prices.tg, prices.table, prices.est
        self.rep = rep if rep is not None else {n: n for n in self.table.nodes}
        self.weight = self.tg.weight  # > 1 for a shallow trace's block standing for several
        self.mult: dict[fx.Node, int] = defaultdict(int)
        for n in self.table.nodes:
            self.mult[self.rep[n]] += self.weight(n)
        self.represented: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in self.table.nodes:
            self.represented[self.rep[node]].append(node)
        self.m = Milp()
        self.pside = prices.param_side_nodes()
        self.gside = prices.grad_side_nodes()
        # chain values of the units the solver decides to keep or gather again (below)
        self.decided_chains = {
            n for n, fqn in param_chains(self.tg, self.table).items() if fqn in regather.free
        }
        self.eta = self.est.cm.overlap_efficiency
        self.xvars: dict[fx.Node, list[int]] = {}
        # per edge: its members, its y columns and the redistribution time of one instance each
        self.edge_vars: list[tuple[list[EdgeKey], range, list[float]]] = []
        self._pair_ends: dict[int, tuple[list, list[list[int]], list[list[int]]]] = {}
        self.edge_pair_vars: dict[EdgeKey, list] = {}  # member -> [(y, emitted, required)]
        self.pair_cost: dict[int, float] = {}  # y -> redistribution time of one instance
        self.overlapped: set[int] = set()
        self.hub_vars: dict[tuple, dict[P.Placements, int]] = {}
        self.sink_vars: dict[int, dict[P.Placements, int]] = {}
        self.grad_vars: dict[str, dict[P.Placements, int]] = {}
        # a memory term's local fractions (`term_fractions`), and a copy term's per edge
        # (`copy_fractions`), by the term's key
        self._term_fractions: dict[tuple, list[float]] = {}
        self._copy_fractions: dict[tuple[tuple, EdgeKey], list[float]] = {}
        self.recompute = RecomputeChoices(self, recompute)
        self.regather = RegatherChoices(self, regather)

    def scaled_comm(self, y: int) -> float:
        """Redistribution time of pair y as the objective counts it (the part not hidden
        behind compute where overlappable)."""
        c = self.pair_cost[y]
        return c * (1.0 - self.eta) if y in self.overlapped else c

    def member_weight(self, key: EdgeKey) -> int:
        if isinstance(key, GradEdge):
            return self.weight(self.tg.params[key.fqn])
        if isinstance(key, (OutputEdge, InputGradEdge)):
            return 1
        return self.weight(key.node)

    # ---------------------------------------------------------------- families
    def add_placement_choices(self) -> None:
        """sum_s x[n, s] = 1 for every representative n; objective += compute(n, s) x[n, s]
        times the nodes n stands for."""
        m = self.m
        for node in self.table.nodes:
            r = self.rep[node]
            if r in self.xvars:
                self.xvars[node] = self.xvars[r]
                continue
            strategies = self.table.nodes[r].strategies
            xs = [
                m.var(self.prices.compute_cost(r, s) * self.mult[r]) for s in range(len(strategies))
            ]
            self.xvars[r] = self.xvars[node] = xs
            m.onehot(xs)
            if r in self.pside or r in self.gside:
                m.free_groups.add(len(m.groups) - 1)

    def _producer_groups(self, src: Source) -> dict[P.Placements, list[int]]:
        g: dict[P.Placements, list[int]] = defaultdict(list)
        for s, pl in enumerate(self.table.nodes[src[0]].out_placements(src[1])):
            if pl is not None:
                g[pl].append(self.xvars[src[0]][s])
        return g

    def _link(
        self,
        src: Source,
        cons_groups: dict[P.Placements, list[int]],
        members: list[EdgeKey],
        prod: dict[P.Placements, list[int]] | None = None,
    ) -> None:
        """Tight edge rows between a producer (or its hub) and a consumer's requirements:
        for every emitted o, sum_r y[e, o, r] = sum of the producer's x emitting o; for every
        required r, sum_o y[e, o, r] = sum of the consumer's x needing r.  Objective +=
        comm(o -> r) y (times (1 - overlap efficiency) where parameter-side, overlappable)."""
        m = self.m
        val = source_value(src)
        prod = self._producer_groups(src) if prod is None else prod
        pair_vars: list = []
        for key in members:
            self.edge_pair_vars[key] = pair_vars
        emitted, required = tuple(prod), tuple(cons_groups)
        rows_o = [[(v, -1.0) for v in xs] for xs in prod.values()]
        rows_r = [[(v, -1.0) for v in xs] for xs in cons_groups.values()]
        frozen = any(k in self.prices.no_comm_edges for k in members)
        count = sum(self.member_weight(k) for k in members)
        first = members[0]
        # a parameter's gathers overlap compute (bucketed and issued a unit ahead), except
        # one from a kept chain value into the backward, where the executor sees an
        # activation: priced so for the units the solver decides, lest it keep a sharded
        # copy and gather that in the backward to dodge the gather-again memory rows
        exposed = (
            isinstance(first, ConsumerEdge)
            and first.node not in self.tg.forward_nodes
            and src[0] in self.decided_chains
        )
        overlappable = self.eta > 0 and (
            (src[0] in self.pside and not exposed)
            or isinstance(first, GradEdge)
            or (isinstance(first, (ConsumerEdge, HubEdge)) and first.node in self.gside)
        )
        sink = isinstance(first, (GradEdge, InputGradEdge, OutputEdge))
        # the executor buckets a unit's parameter gathers and its gradient reductions
        bucketed = (src[0] in self.pside and not exposed) or isinstance(first, GradEdge)
        pairs = self.prices.pairs(
            emitted, required, tuple(val.shape), val.element_size(), frozen, sink, bucketed
        )
        scale = (1.0 - self.eta) if overlappable else 1.0
        ys = m.vars(
            [(c * scale + (TIE_BREAK_US if moves else 0.0)) * count for *_, c, moves in pairs]
        )
        if overlappable:
            self.overlapped.update(ys)
        costs = [c for _, _, c, _ in pairs]
        self.edge_vars.append((members, ys, costs))
        self.pair_cost.update(zip(ys, costs))
        pair_vars += [(y, emitted[i_o], required[i_r]) for y, (i_o, i_r, _, _) in zip(ys, pairs)]
        by_emitted, by_required = self._pairs_by_end(pairs, len(emitted), len(required))
        for terms, ks in zip(rows_o + rows_r, by_emitted + by_required):
            m.row(terms + [(ys[k], 1.0) for k in ks], 0.0, 0.0)

    def _pairs_by_end(
        self, pairs: list, n_emitted: int, n_required: int
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The indices into `pairs` (a list `prices.pairs` keeps) of each emitted and each
        required placement's pairs, in order; memoised with the list, as edges of repeated
        layers share it."""
        hit = self._pair_ends.get(id(pairs))
        if hit is None or hit[0] is not pairs:
            by_emitted: list[list[int]] = [[] for _ in range(n_emitted)]
            by_required: list[list[int]] = [[] for _ in range(n_required)]
            for k, (i_o, i_r, _, _) in enumerate(pairs):
                by_emitted[i_o].append(k)
                by_required[i_r].append(k)
            hit = self._pair_ends[id(pairs)] = (pairs, by_emitted, by_required)
        return hit[1], hit[2]

    def add_edges(self) -> None:
        """One set of y per (producer group, consumer group, argument); a value read by
        several consumer groups goes through a hub (`hub_columns`), its consumers link from it."""
        table, rep = self.table, self.rep
        edges: dict[tuple, list[EdgeKey]] = defaultdict(list)
        for node, ns in table.nodes.items():
            for k, src in enumerate(ns.sources):
                edges[(rep[src[0]], src[1], rep[node], k)].append(ConsumerEdge(node, k))
        required: dict[tuple, dict[P.Placements, list[int]]] = {}
        fanout: dict[tuple, list[tuple]] = defaultdict(list)
        for key in edges:
            psrc, pidx, cnode, k = key
            groups: dict[P.Placements, list[int]] = defaultdict(list)
            for s, st in enumerate(table.nodes[cnode].strategies):
                if st.ins[k] is not None:
                    groups[st.ins[k]].append(self.xvars[cnode][s])
            if groups:
                required[key] = groups
                fanout[(psrc, pidx)].append(key)
        for src, keys in fanout.items():
            if (
                len(keys) > 1
                and src[0].op == "call_function"
                and src[0] not in self.pside
                and not any(e in self.prices.no_comm_edges for k in keys for e in edges[k])
            ):
                w = hub_columns(self.m, self._producer_groups(src), [required[k] for k in keys])
                self.hub_vars[src] = w
                self._link(
                    src,
                    {pl: [v] for pl, v in w.items()},
                    [HubEdge(n, src[1]) for n in self.represented[src[0]]],
                )
        for key, groups in required.items():
            src = key[:2]
            hub = self.hub_vars.get(src)
            self._link(src, groups, edges[key], {pl: [v] for pl, v in hub.items()} if hub else None)

    def add_output_sinks(self) -> None:
        """sum_p w[k, p] = 1 per forward output k, linked like an edge; the output's tangent
        enters in the same placement (`tie_columns`)."""
        for i, out in enumerate(self.tg.outputs):
            src = resolve_source(out)
            val = source_value(src)
            w = {pl: self.m.var(0.0) for pl in P.all_placements(val.shape, self.prices.mesh_shape)}
            self.m.onehot(list(w.values()))
            self.sink_vars[i] = w
            self._link(src, {pl: [v] for pl, v in w.items()}, [OutputEdge(i)])
            tan = self.tg.tangents[i]
            if tan is not None and tan in self.table.nodes:
                tie_columns(self.m, w, self.table.nodes[tan], self.xvars[tan])

    def add_gradient_sinks(self) -> None:
        """A parameter's gradient leaves in the parameter's placement: one sink per (param
        group, gradient group), linked like an edge and tied to the parameter's x."""
        groups: dict[tuple, list[str]] = defaultdict(list)
        for fqn, g in self.tg.grads.items():
            if g is None:
                continue
            src = resolve_source(g)
            groups[(self.rep[self.tg.params[fqn]], self.rep.get(src[0], src[0]), src[1])].append(
                fqn
            )
        for (pnode, gnode, gidx), fqns in groups.items():
            src = (gnode, gidx)
            val = source_value(src)
            w = {pl: self.m.var(0.0) for pl in P.all_placements(val.shape, self.prices.mesh_shape)}
            self.m.onehot(list(w.values()))
            for fqn in fqns:
                self.grad_vars[fqn] = w
            self._link(src, {pl: [v] for pl, v in w.items()}, [GradEdge(f) for f in fqns])
            tie_columns(self.m, w, self.table.nodes[pnode], self.xvars[pnode])

    def add_input_gradient_sinks(self) -> None:
        """An input's gradient (a pipeline stage's hidden states) leaves in the input's
        placement: one sink per such input, linked like an edge and tied to the input's x."""
        for i, g in enumerate(self.tg.input_grads):
            if g is None:
                continue
            src = resolve_source(g)
            val = source_value(src)
            w = {pl: self.m.var(0.0) for pl in P.all_placements(val.shape, self.prices.mesh_shape)}
            self.m.onehot(list(w.values()))
            self._link(src, {pl: [v] for pl, v in w.items()}, [InputGradEdge(i)])
            node = self.tg.inputs[i]
            tie_columns(self.m, w, self.table.nodes[node], self.xvars[node])

    def add_pin(self, c: Pin | OutputPin) -> None:
        """x[n, s] = 1 (lower bound) for the strategy whose output is the pinned placement;
        for an output pin, w[k, p] = 1."""
        if isinstance(c, OutputPin):
            w = self.sink_vars[c.index]
            if c.placement not in w:
                raise ConstraintError(f"{c.name}: placement not valid for the output's shape")
            self.m.lb[w[c.placement]] = 1.0
            return
        ns = self.table.nodes[c.node]
        idx = [s for s, st in enumerate(ns.strategies) if st.out[0] == c.placement]
        if not idx:
            raise ConstraintError(f"{c.name}: placement not valid for the tensor's shape")
        self.m.lb[self.xvars[c.node][idx[0]]] = 1.0

    def add_collective_dim(self, c: CollectiveDim) -> None:
        """Strategies of ops with a collective layout that do not use it over `c.dim` are
        ruled out (upper bound 0)."""
        for node, ns in self.table.nodes.items():
            rule = COLLECTIVE_OPS.get(node.target)
            if rule is None:
                continue
            keep = [rule.collective_dim(list(st.ins)) == c.dim for st in ns.strategies]
            if not any(keep):
                raise ConstraintError(f"{c.name}: impossible for node '{node.name}'")
            for s, ok in enumerate(keep):
                if not ok:
                    self.m.ub[self.xvars[node][s]] = 0.0

    def add_parameter_budget(self, c: ParameterBudget) -> None:
        """low <= sum_p bytes(p)/total * sum_s shard_fraction(p, s) x[p, s] <= high, in units of
        all parameter bytes (a well-scaled row); each bound is raised to what the smallest
        shard of every parameter allows."""
        tg, weight = self.tg, self.weight
        total = (
            float(sum(self.prices.param_bytes(n) * weight(n) for n in tg.params.values())) or 1.0
        )
        terms, lo_bound, hi_bound = [], 0.0, 0.0
        for pnode in tg.params.values():
            ns = self.table.nodes[pnode]
            b = self.prices.param_bytes(pnode) * weight(pnode) / total
            fr = [
                P.shard_fraction(pnode.meta["val"].shape, placed(st.out[0]), self.prices.mesh_shape)
                for st in ns.strategies
            ]
            for s, f in enumerate(fr):
                terms.append((self.xvars[pnode][s], b * f))
            fmin = min(fr)
            hi_bound += b * max(fmin, c.high)
            lo_bound += b * max(fmin, c.low if c.low is not None else 0.0)
        self.m.row(
            terms,
            lo_bound * (1 - 1e-9) if c.low is not None else -math.inf,
            hi_bound * (1 + 1e-9),
        )

    def add_memory_budget(self, c: MemoryBudget) -> None:
        """Every candidate peak (memory.py) at most the budget: row / budget <= 1; with
        microbatches in flight (a pipeline stage), each row also holds the other
        microbatches' saved activations (the boundary's saved values, `in_flight - 1` times)."""
        for terms in self.memory_rows(c.bytes_per_rank, c.in_flight):
            self.m.row(terms, -math.inf, 1.0)

    def memory_rows(self, scale: float, in_flight: float = 1.0) -> list[list[tuple[int, float]]]:
        """The memory model's rows (memory.py: params, grads, optimizer state, the
        activations alive at each candidate peak) in units of `scale` bytes, so the
        coefficients are O(1), each with `in_flight - 1` more microbatches' saved values.
        A copy held on an edge counts only if that edge redistributes (through a hub on both
        steps: an upper bound)."""
        rc = self.recompute
        options = rc.options if rc.active else ("none",)
        rows = memory_rows(self.tg, self.table, options, self.regather.setting)
        out = [self._row_terms(row.entries, 1.0 / scale) for row in rows]
        if in_flight > 1:
            boundary = next(row for row in rows if row.where == BOUNDARY)
            saved = [
                e for e in boundary.entries if e.saved and e.term.kind not in ("param", "grad")
            ]
            held = self._row_terms(saved, (in_flight - 1) / scale)
            out = [terms + held for terms in out]
        return out

    def _row_terms(self, entries: list, coef: float) -> list[tuple[int, float]]:
        """One row's entries as (column, bytes x `coef`) terms."""
        rc = self.recompute
        terms: list[tuple[int, float]] = []
        copies: set = set()
        for e in entries:
            t = e.term
            if self.regather.decides(e):
                if t.kind != "copy" or (t.key, e.regathered) not in copies:
                    copies.add((t.key, e.regathered))
                    self.regather.add_entry(e, e.weight * coef, terms)
                continue
            if t.kind == "copy":
                if t.key in copies:
                    continue
                copies.add(t.key)
                if e.block is None:
                    mult = e.weight
                else:
                    mult = self.weight(t.node) if rc.auto else e.multiplier(rc.pins)
                if mult:
                    self._copy_terms(t, mult * coef, terms)
                continue
            for s, frac in enumerate(self.term_fractions(t)):
                if not frac:
                    continue
                col, mult = rc.entry_column(e, s)
                if mult:
                    terms.append((col, t.full_bytes * frac * mult * coef))
        return terms

    def _copy_terms(self, t: MemoryTerm, coef: float, terms: list) -> None:
        for edge in self.copy_edges(t):
            for (y, _o, _r), f in zip(
                self.edge_pair_vars.get(edge, []), self.copy_fractions(t, edge)
            ):
                if f:
                    terms.append((y, t.full_bytes * f * coef))

    # a term's fractions are the same in every memory row (there are many): computed once
    def term_fractions(self, t: MemoryTerm) -> list[float]:
        """Local fraction of "param"/"activation" term `t` under each strategy of its node."""
        fractions = self._term_fractions.get(t.key)
        if fractions is None:
            n = len(self.xvars[t.node])
            fractions = [term_fraction(t, self.table, s) for s in range(n)]
            self._term_fractions[t.key] = fractions
        return fractions

    def copy_edges(self, t: MemoryTerm) -> tuple[EdgeKey, EdgeKey]:
        """The edge whose redistribution holds copy term `t`'s copy, and its value's hub."""
        src = self.table.nodes[t.node].sources[t.copied_input]
        return ConsumerEdge(t.node, t.copied_input), HubEdge(src[0], src[1])

    def copy_fractions(self, t: MemoryTerm, edge: EdgeKey) -> list[float]:
        """Local fraction of copy term `t` held under each pair of `edge` (`edge_pair_vars`)."""
        fractions = self._copy_fractions.get((t.key, edge))
        if fractions is None:
            pairs = self.edge_pair_vars.get(edge, [])
            fractions = [copy_fraction(t, self.table, o, r) for _y, o, r in pairs]
            self._copy_fractions[(t.key, edge)] = fractions
        return fractions

    # ---------------------------------------------------------------- reading the answer
    def solution(
        self, values: list[float], status: str, obj: float, how: str, gap: float | None
    ) -> Solution:
        def chosen(w: dict) -> P.Placements:
            return max(w, key=lambda pl: values[w[pl]])

        choice, compute = {}, 0.0
        for node, xs in self.xvars.items():
            s = max(range(len(xs)), key=lambda i: values[xs[i]])
            choice[node] = s
            compute += self.prices.compute_cost(self.rep[node], s) * self.weight(node)
        comm = overlapped = 0.0
        edge_comm: dict[EdgeKey, float] = defaultdict(float)
        for members, ys, costs in self.edge_vars:
            for v, c in zip(ys, costs):
                if values[v] <= 0.5:
                    continue
                count = 0
                for key in members:
                    count += self.member_weight(key)
                    edge_comm[key] += c  # per instance; the totals below are weighted
                comm += c * count
                if v in self.overlapped:
                    overlapped += c * count
        regathered = self.regather.regathered(values)
        regather_us = self.regather.regather_us(values, regathered)
        comm += regather_us
        overlapped += regather_us
        exposed = (comm - overlapped) + (1.0 - self.eta) * overlapped
        counts = self.recompute.counts(values)
        hubs = {
            (n, src[1]): chosen(w)
            for src, w in self.hub_vars.items()
            for n in self.represented[src[0]]
        }
        return Solution(
            choice=choice,
            sink_placement={i: chosen(w) for i, w in self.sink_vars.items()},
            grad_placement={f: chosen(w) for f, w in self.grad_vars.items()},
            compute_us=compute,
            comm_us=comm,
            objective=obj,
            status=f"{status} via {how}",
            optimal=status == OPTIMAL,
            gap=gap,
            num_vars=len(self.m.cost),
            num_rows=len(self.m.row_lo),
            edge_comm=dict(edge_comm),
            overlappable_comm_us=overlapped,
            exposed_comm_us=exposed,
            hubs=hubs,
            recompute=counts,
            recompute_us=self.recompute.recompute_us(values, choice, counts),
            regathered=regathered,
            regather_us=regather_us,
        )


def hub_columns(m: Milp, emitted: dict, required: list[dict]) -> dict[P.Placements, int]:
    """A value read by several consumers is redistributed once per placement, not once per
    consumer.  Its "hub" picks the one placement it is redistributed to (one-hot over what
    the producer emits and the consumers require); consumers read from the hub and pay
    only for their own step on from it (nothing when they need the hub's placement).  The
    price, producer -> hub once plus hub -> each consumer, bounds what the runner does (it
    redistributes through the hub the same way, and reads the producer's value directly
    where a consumer wants the producer's own placement), and is exact when the consumers
    want at most one placement besides the producer's — the Megatron pattern: one
    all-gather of the normalised activations feeds wq, wk and wv."""
    placements = dict.fromkeys(emitted)
    for groups in required:
        placements.update(dict.fromkeys(groups))
    w = {pl: m.var(0.0) for pl in placements}
    m.onehot(list(w.values()))
    return w


def tie_columns(m: Milp, w: dict, ns: NodeStrategies, xs: list[int]) -> None:
    """Sink placement == the placement of a placeholder (param or tangent): for every p,
    sum of x over the placeholder's strategies emitting p = w[p]."""
    by_pl: dict = defaultdict(list)
    for s, st in enumerate(ns.strategies):
        by_pl[st.out[0]].append(xs[s])
    for pl in set(w) | set(by_pl):
        terms = [(v, 1.0) for v in by_pl.get(pl, [])]
        if pl in w:
            terms.append((w[pl], -1.0))
        m.row(terms, 0.0, 0.0)
