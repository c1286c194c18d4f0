"""Stage 4: choose one strategy per node with a 0/1 program solved by HiGHS (highspy).

Variables
* `x[n, s]` (binary): node n uses strategy s.  One-hot per node.
* `y[e, o, r]` (continuous, 0..1): on edge e, the producer emits placement o and the consumer
  needs placement r.  Tight ("marginal") formulation: for every o, sum_r y = sum of x over the
  producer's strategies emitting o; for every r, sum_o y = sum of x over the consumer's
  strategies needing r.  Pairs whose redistribution is impossible get no variable.
* `w[k, r]` (binary): the placement in which graph output k leaves the graph (a "sink").
* `h[v, p]` (binary): for a value read by several consumers, the one placement p it is
  redistributed to ("hub", `_hub`); its consumers' edges start from the hub.

Constraints beyond consistency: a parameter's gradient leaves in the parameter's placement,
a forward output's tangent enters in the output's placement, user pins, and the
parameter-memory budget.  Objective: compute time of chosen strategies + redistribution time
of chosen edges (+ a tiny tie-breaker per placement change).

User constraints are named; if the program is infeasible we drop them one at a time to find a
minimal conflicting set and report their names.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import highspy
import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from . import placements as P
from .cost import INF, Estimator
from .errors import ConstraintError, InfeasiblePlanError, PlannerError
from .memory import copy_fraction, memory_terms, param_chains, term_fraction
from .strategies import StrategyTable, resolve_source
from .trace import TracedGraph

log = logging.getLogger(__name__)

TIE_BREAK_US = 0.01


@dataclass
class UserConstraint:
    name: str  # human-readable, used in error messages
    kind: str  # "pin" | "mem"
    node: fx.Node | None = None
    placement: P.Placements | None = None
    sink: int | None = None  # output index for output pins
    low: float | None = None
    high: float | None = None


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
    # us per (consumer node, arg k), (producer node, "hub", output idx), ("grad", fqn),
    # ("output", i)
    edge_comm: dict = field(default_factory=dict)
    overlappable_comm_us: float = 0.0  # parameter gathers / gradient reductions
    exposed_comm_us: float = 0.0  # activation comm + overlappable comm not hidden by compute
    hubs: dict = field(default_factory=dict)  # (producer, output idx) -> placement (_hub)


class _Model:
    """Row-wise sparse model accumulator."""

    def __init__(self):
        self.cost: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []
        self.groups: list[list[int]] = []  # one-hot groups of binary columns
        self.free_groups: set[int] = set()  # group indices never fixed from the relaxation

    def var(self, cost: float, lb=0.0, ub=1.0) -> int:
        """A column; it is binary if it belongs to a one-hot group (`onehot`), else continuous."""
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        merged: dict[int, float] = defaultdict(float)
        for c, v in terms:
            merged[c] += v
        for c, v in merged.items():
            if v != 0.0:
                self.index.append(c)
                self.value.append(v)
        self.starts.append(len(self.index))
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    def onehot(self, cols: list[int]) -> None:
        """Exactly one of the binary columns `cols` is 1 (a row, remembered for rounding)."""
        self.groups.append(cols)
        self.row([(c, 1.0) for c in cols], 1.0, 1.0)

    def _lp(self) -> "highspy.HighsLp":
        lp = highspy.HighsLp()
        n = len(self.cost)
        lp.num_col_ = n
        lp.num_row_ = len(self.row_lo)
        lp.col_cost_ = self.cost
        lp.col_lower_ = self.lb
        lp.col_upper_ = self.ub
        lp.row_lower_ = self.row_lo
        lp.row_upper_ = self.row_hi
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = self.starts
        lp.a_matrix_.index_ = self.index
        lp.a_matrix_.value_ = self.value
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(self.row_lo)
        return lp

    def solve(self, time_limit: float, verbose: bool, rel_gap: float = 1e-3):
        """Solve; returns (status, column values or None, objective, method, proven relative gap).

        First the LP relaxation (no presolve: here it costs more than it saves).  These
        programs' relaxations are nearly integral (typically >90% of one-hot groups), so the
        groups it decided are fixed and branch and bound runs on the few undecided ones and on
        the `free_groups` (parameter-side choices: where and in which layout weights are
        gathered, the levers of a binding memory row — fixing them around one fractional
        group left 405B at 80 GiB 2.7% above its optimum; free, within 0.01%).  If
        that plan is within `rel_gap` of the LP bound it is optimal to the same tolerance the
        full search would prove; otherwise the full 0/1 program is solved (started from it).
        Measured on Llama3-8B (8,8): 9.7 s -> 1.4 s, same objective.
        """
        t_end = time.perf_counter() + float(time_limit)
        h = highspy.Highs()
        h.setOptionValue(
            "output_flag", bool(verbose) or bool(os.environ.get("AUTOPARALLEL_SOLVER_LOG"))
        )
        h.setOptionValue("threads", 1)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("presolve", "off")
        h.passModel(self._lp())
        if os.environ.get("AUTOPARALLEL_WRITE_MODEL"):
            h.writeModel(os.environ["AUTOPARALLEL_WRITE_MODEL"])
        Status = highspy.HighsModelStatus
        h.run()
        status = h.getModelStatus()
        if status == Status.kInfeasible:
            return status, None, None, "LP", None
        ints = np.array([c for g in self.groups for c in g], dtype=np.int32)

        def as_mip() -> None:  # from the relaxation to the 0/1 program
            h.changeColsIntegrality(
                len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger)
            )
            h.setOptionValue("presolve", "choose")
            h.setOptionValue("mip_rel_gap", rel_gap)

        start = None
        if status == Status.kOptimal:
            bound = h.getInfo().objective_function_value
            x = np.asarray(h.getSolution().col_value)
            # fix the groups the relaxation already decided; branch and bound on the rest
            lo, hi = np.asarray(self.lb)[ints], np.asarray(self.ub)[ints]
            fix_lo, fix_hi = lo.copy(), hi.copy()
            pos = decided = 0
            for gi, g in enumerate(self.groups):
                k = int(np.argmax(x[g]))
                if x[g[k]] > 1.0 - 1e-6:
                    decided += 1
                    if gi not in self.free_groups:
                        fix_hi[pos : pos + len(g)] = 0.0
                        fix_lo[pos + k] = fix_hi[pos + k] = 1.0
                pos += len(g)
            if decided == len(self.groups):  # the relaxation is integral: optimal as it is
                return Status.kOptimal, list(x), bound, "LP (integral)", 0.0
            h.changeColsBounds(len(ints), ints, fix_lo, fix_hi)
            as_mip()
            h.run()
            log.info(
                "LP bound %.3f; %d of %d one-hot groups integral; the rest: %s, objective %s",
                bound,
                decided,
                len(self.groups),
                h.getModelStatus(),
                h.getInfo().objective_function_value,
            )
            if h.getModelStatus() == Status.kOptimal:
                obj = h.getInfo().objective_function_value
                start = list(h.getSolution().col_value)
                gap = (obj - bound) / max(abs(obj), 1e-9)
                if gap <= rel_gap:
                    return Status.kOptimal, start, obj, "LP + fixing", gap
            h.changeColsBounds(len(ints), ints, lo, hi)
        # branch and bound on the true 0/1 program
        as_mip()
        h.setOptionValue("time_limit", max(1.0, t_end - time.perf_counter()))
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = start
            h.setSolution(sol)
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
        return (
            status,
            (list(h.getSolution().col_value) if has_sol else None),
            info.objective_function_value,
            "branch and bound",
            info.mip_gap if has_sol else None,
        )


class PlacementSolver:
    def __init__(self, tg: TracedGraph, table: StrategyTable, est: Estimator):
        self.tg = tg
        self.table = table
        self.est = est
        self.mesh_shape = table.mesh_shape
        self._compute: dict[tuple[fx.Node, int], float] = {}
        # (consumer node, input index) edges on which no redistribution may happen
        self.no_comm_edges: set = set()
        # node -> representative sharing its variables (see cluster.py); None = no sharing
        self.rep: dict[fx.Node, fx.Node] | None = None
        self._param_side: set | None = None
        self._pair_memo: dict = {}
        # parameters the executor gathers again in the backward (memory.py)
        self.regathered: frozenset[str] = frozenset()

    def param_side_nodes(self) -> set:
        """Nodes on a parameter's single-input chain (param, cast, transpose, view) and on a
        gradient's single-input chain back from the gradient output.  Communication on edges
        out of the former / into the latter is parameter-side (overlappable with compute)."""
        if self._param_side is None:
            side = set(param_chains(self.tg, self.table))
            self._grad_side = set()
            for g in self.tg.grads.values():
                if g is None:
                    continue
                node = resolve_source(g)[0]
                while (
                    node in self.table.nodes
                    and len(self.table.nodes[node].sources) == 1
                    and node not in self._grad_side
                ):
                    self._grad_side.add(node)
                    node = self.table.nodes[node].sources[0][0]
            self._param_side = side
        return self._param_side

    # ------------------------------------------------------------------
    def compute_cost(self, node: fx.Node, s: int) -> float:
        key = (node, s)
        c = self._compute.get(key)
        if c is None:
            ns = self.table.nodes[node]
            st = ns.strategies[s]
            if node.op != "call_function":
                c = 0.0
            else:
                in_vals = [_source_val(src) for src in ns.sources]
                v = node.meta["val"]
                out_vals = list(v) if isinstance(v, (list, tuple)) else [v]
                c = self.est.compute_us(
                    node.target, in_vals, list(st.ins), out_vals, list(st.out), node.args
                )
            self._compute[key] = c
        return c

    def _pairs(
        self,
        emitted: tuple,
        required: tuple,
        shape: tuple,
        elem_size: int,
        frozen: bool,
        sink: bool = False,
    ) -> list:
        """(emitted, required, cost) of the redistributions an edge may use; memoised, as
        repeated layers ask the same question many times.  Edges into a sink (a gradient
        leaving in its parameter's placement, an output in its pinned one) may take any
        number of steps: there are few of them, and a gradient that is partial on two mesh
        dims (a sequence-parallel norm's weight under FSDP) needs two collectives."""
        key = (emitted, required, shape, elem_size, frozen, sink)
        hit = self._pair_memo.get(key)
        if hit is None:
            hit = self._pair_memo[key] = [
                (o, r, c)
                for o in emitted
                for r in required
                if (o == r or not frozen)
                and (sink or _direct(o, r))
                and (c := self.est.comm_us(o, r, shape, elem_size)) != INF
            ]
        return hit

    def param_bytes(self, node: fx.Node) -> int:
        v = node.meta["val"]
        return v.numel() * v.element_size()

    # ------------------------------------------------------------------
    def solve(
        self, constraints: list[UserConstraint], time_limit: float = 120.0, verbose: bool = False
    ) -> Solution:
        sol = self._solve_once(constraints, time_limit, verbose)
        if sol is not None:
            return sol
        # infeasible: find a minimal conflicting set of user constraints
        active = list(constraints)
        if self._solve_once([], time_limit, False) is None:
            raise InfeasiblePlanError("no placement exists even without user constraints")
        for c in list(active):
            trial = [a for a in active if a is not c]
            if self._solve_once(trial, time_limit, False) is None:
                active = trial
        names = "; ".join(c.name for c in active)
        raise InfeasiblePlanError(f"constraints cannot all hold: {names}")

    def _solve_once(self, constraints, time_limit, verbose) -> Solution | None:
        t0 = time.perf_counter()
        tg, table, est = self.tg, self.table, self.est
        rep = self.rep if self.rep is not None else {n: n for n in table.nodes}
        weight = tg.weight  # > 1 for a shallow trace's block standing for several (repeat.py)
        mult: dict[fx.Node, int] = defaultdict(int)
        for n in table.nodes:
            mult[rep[n]] += weight(n)

        def member_weight(key) -> int:
            if key[0] == "grad":
                return weight(tg.params[key[1]])
            return 1 if key[0] == "output" else weight(key[0])

        m = _Model()
        pside = self.param_side_nodes()
        gside = self._grad_side
        xvars: dict[fx.Node, list[int]] = {}
        for node in table.nodes:
            r = rep[node]
            if r in xvars:
                xvars[node] = xvars[r]
                continue
            ns = table.nodes[r]
            xs = [m.var(self.compute_cost(r, s) * mult[r]) for s in range(len(ns.strategies))]
            xvars[r] = xvars[node] = xs
            m.onehot(xs)
            if r in pside or r in gside:
                m.free_groups.add(len(m.groups) - 1)

        edge_vars: list[tuple[list, int, float]] = []  # (member edges, var, cost per member)
        edge_pair_vars: dict = {}  # member edge -> [(var, emitted, required)]
        eta = est.cm.overlap_efficiency
        ov_vars: set[int] = set()

        def producer_groups(src) -> dict[P.Placements, list[int]]:
            ns = table.nodes[src[0]]
            g: dict[P.Placements, list[int]] = defaultdict(list)
            for s, pl in enumerate(ns.out_placements(src[1])):
                if pl is not None:
                    g[pl].append(xvars[src[0]][s])
            return g

        def link(
            src,
            cons_groups: dict[P.Placements, list[int]],
            members: list,
            prod: dict[P.Placements, list[int]] | None = None,
        ) -> None:
            """Tight edge constraints between a producer (or its hub) and a consumer's
            requirement groups."""
            val = _source_val(src)
            prod = producer_groups(src) if prod is None else prod
            pair_vars: list = []
            for key in members:
                edge_pair_vars[key] = pair_vars
            rows_o: dict[P.Placements, list] = {
                o: [(v, -1.0) for v in xs] for o, xs in prod.items()
            }
            rows_r: dict[P.Placements, list] = {
                r: [(v, -1.0) for v in xs] for r, xs in cons_groups.items()
            }
            frozen = any(k in self.no_comm_edges for k in members)
            count = sum(member_weight(k) for k in members)
            key0 = members[0]
            overlappable = eta > 0 and (
                src[0] in pside
                or key0[0] == "grad"
                or (isinstance(key0[0], fx.Node) and key0[0] in gside)
            )
            sink = key0[0] in ("grad", "output")
            for o, r, c in self._pairs(
                tuple(prod), tuple(cons_groups), tuple(val.shape), val.element_size(), frozen, sink
            ):
                tie = TIE_BREAK_US if o != r else 0.0
                if overlappable:
                    y = m.var((c * (1.0 - eta) + tie) * count)
                    ov_vars.add(y)
                else:
                    y = m.var((c + tie) * count)
                edge_vars.append((members, y, c))
                pair_vars.append((y, o, r))
                rows_o[o].append((y, 1.0))
                rows_r[r].append((y, 1.0))
            for terms in list(rows_o.values()) + list(rows_r.values()):
                m.row(terms, 0.0, 0.0)

        # consumer edges, one set of variables per (producer group, consumer group, arg)
        edges: dict[tuple, list] = defaultdict(list)
        for node, ns in table.nodes.items():
            for k, src in enumerate(ns.sources):
                edges[(rep[src[0]], src[1], rep[node], k)].append((node, k))
        required: dict[tuple, dict[P.Placements, list[int]]] = {}
        fanout: dict[tuple, list[tuple]] = defaultdict(list)
        for key in edges:
            psrc, pidx, cnode, k = key
            groups: dict[P.Placements, list[int]] = defaultdict(list)
            for s, st in enumerate(table.nodes[cnode].strategies):
                if st.ins[k] is not None:
                    groups[st.ins[k]].append(xvars[cnode][s])
            if groups:
                required[key] = groups
                fanout[(psrc, pidx)].append(key)
        represented: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in table.nodes:
            represented[rep[node]].append(node)
        hub_vars: dict[tuple, dict[P.Placements, int]] = {}
        for src, keys in fanout.items():
            if (
                len(keys) > 1
                and src[0].op == "call_function"
                and src[0] not in pside
                and not any(e in self.no_comm_edges for k in keys for e in edges[k])
            ):
                hub_vars[src] = w = self._hub(m, producer_groups(src), [required[k] for k in keys])
                link(
                    src,
                    {pl: [v] for pl, v in w.items()},
                    [(n, "hub", src[1]) for n in represented[src[0]]],
                )
        for key, groups in required.items():
            src = key[:2]
            hub = hub_vars.get(src)
            link(src, groups, edges[key], {pl: [v] for pl, v in hub.items()} if hub else None)

        # sinks: forward outputs (tied to tangents) and parameter gradients (tied to params)
        sink_vars: dict[int, dict[P.Placements, int]] = {}
        for i, out in enumerate(tg.outputs):
            src = resolve_source(out)
            val = _source_val(src)
            opts = P.all_placements(val.shape, self.mesh_shape)
            w = {pl: m.var(0.0) for pl in opts}
            m.onehot(list(w.values()))
            sink_vars[i] = w
            link(src, {pl: [v] for pl, v in w.items()}, [("output", i)])
            tan = tg.tangents[i]
            if tan is not None and tan in table.nodes:
                self._tie(m, w, table.nodes[tan], xvars[tan])
        grad_vars: dict[str, dict[P.Placements, int]] = {}
        grad_groups: dict[tuple, list[str]] = defaultdict(list)
        for fqn, g in tg.grads.items():
            if g is None:
                continue
            src = resolve_source(g)
            grad_groups[(rep[tg.params[fqn]], rep.get(src[0], src[0]), src[1])].append(fqn)
        for (pnode, gnode, gidx), fqns in grad_groups.items():
            src = (gnode, gidx)
            val = _source_val(src)
            opts = P.all_placements(val.shape, self.mesh_shape)
            w = {pl: m.var(0.0) for pl in opts}
            m.onehot(list(w.values()))
            for fqn in fqns:
                grad_vars[fqn] = w
            link(src, {pl: [v] for pl, v in w.items()}, [("grad", f) for f in fqns])
            self._tie(m, w, table.nodes[pnode], xvars[pnode])

        # user constraints
        for c in constraints:
            if c.kind == "pin":
                if c.sink is not None:
                    w = sink_vars[c.sink]
                    if c.placement not in w:
                        raise ConstraintError(
                            f"{c.name}: placement not valid for the output's shape"
                        )
                    m.lb[w[c.placement]] = 1.0
                else:
                    ns = table.nodes[c.node]
                    idx = [s for s, st in enumerate(ns.strategies) if st.out[0] == c.placement]
                    if not idx:
                        raise ConstraintError(
                            f"{c.name}: placement not valid for the tensor's shape"
                        )
                    m.lb[xvars[c.node][idx[0]]] = 1.0
            elif c.kind == "mem":
                # in units of all parameter bytes, so the row is well scaled for the solver
                total = (
                    float(sum(self.param_bytes(n) * weight(n) for n in tg.params.values())) or 1.0
                )
                terms, lo_bound, hi_bound = [], 0.0, 0.0
                for fqn, pnode in tg.params.items():
                    ns = table.nodes[pnode]
                    b = self.param_bytes(pnode) * weight(pnode) / total
                    fr = [
                        P.shard_fraction(pnode.meta["val"].shape, st.out[0], self.mesh_shape)
                        for st in ns.strategies
                    ]
                    for s, f in enumerate(fr):
                        terms.append((xvars[pnode][s], b * f))
                    fmin = min(fr)
                    hi_bound += b * max(fmin, c.high if c.high is not None else 1.0)
                    lo_bound += b * max(fmin, c.low if c.low is not None else 0.0)
                m.row(
                    terms,
                    lo_bound * (1 - 1e-9) if c.low is not None else -highspy.kHighsInf,
                    hi_bound * (1 + 1e-9),
                )
            elif c.kind == "bytes":
                # per-rank bytes (params, grads, optimizer state, saved activations), scaled
                # by the budget so the row's coefficients are O(1)
                terms = []
                for t in memory_terms(tg, table, regathered=self.regathered):
                    if t.kind == "copy":  # on the edge: held only if it redistributes
                        # (through a hub: counted on both steps, an upper bound)
                        src = table.nodes[t.node].sources[t.arg]
                        for y, o, r in edge_pair_vars.get((t.node, t.arg), []) + edge_pair_vars.get(
                            (src[0], "hub", src[1]), []
                        ):
                            f = copy_fraction(t, table, o, r)
                            if f:
                                terms.append((y, t.full_bytes * weight(t.node) * f / c.high))
                        continue
                    xs = xvars[t.node]
                    for s in range(len(xs)):
                        terms.append(
                            (
                                xs[s],
                                t.full_bytes * weight(t.node) * term_fraction(t, table, s) / c.high,
                            )
                        )
                m.row(terms, -highspy.kHighsInf, 1.0)
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        status, values, obj, how, gap = m.solve(time_limit, verbose)
        solve_s = time.perf_counter() - t1
        log.info(
            "ILP %d vars, %d rows: build %.2fs, solve %.2fs, status %s (%s, gap %s)",
            len(m.cost),
            len(m.row_lo),
            build_s,
            solve_s,
            status,
            how,
            gap,
        )
        if status == highspy.HighsModelStatus.kInfeasible or values is None:
            if status not in (highspy.HighsModelStatus.kInfeasible,):
                if status == highspy.HighsModelStatus.kTimeLimit:
                    raise PlannerError(
                        f"solver hit the {time_limit}s time limit without a feasible plan"
                    )
            return None
        optimal = status == highspy.HighsModelStatus.kOptimal
        if not optimal:
            log.warning(
                "solver stopped with status %s; the plan is feasible, proven within %s of optimal",
                status,
                "-" if gap is None else f"{gap:.2%}",
            )
        choice = {}
        compute = 0.0
        for node, xs in xvars.items():
            s = max(range(len(xs)), key=lambda i: values[xs[i]])
            choice[node] = s
            compute += self.compute_cost(rep[node], s) * weight(node)
        comm = ov_comm = 0.0
        edge_comm: dict = defaultdict(float)
        for members, v, c in edge_vars:
            if values[v] > 0.5:
                count = 0
                for key in members:
                    count += member_weight(key)
                    edge_comm[key] += c  # per instance; the totals below are weighted
                comm += c * count
                if v in ov_vars:
                    ov_comm += c * count
        exposed = (comm - ov_comm) + (1.0 - eta) * ov_comm
        sinks = {i: max(w, key=lambda pl: values[w[pl]]) for i, w in sink_vars.items()}
        hubs = {
            (n, src[1]): max(w, key=lambda pl: values[w[pl]])
            for src, w in hub_vars.items()
            for n in represented[src[0]]
        }
        grads = {f: max(w, key=lambda pl: values[w[pl]]) for f, w in grad_vars.items()}
        self.last_build_s, self.last_solve_s = build_s, solve_s
        return Solution(
            choice,
            sinks,
            grads,
            compute,
            comm,
            obj,
            f"{status} via {how}",
            optimal,
            gap,
            len(m.cost),
            len(m.row_lo),
            dict(edge_comm),
            ov_comm,
            exposed,
            hubs,
        )

    @staticmethod
    def _hub(m: _Model, emitted: dict, required: list[dict]) -> dict[P.Placements, int]:
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

    @staticmethod
    def _tie(m: _Model, w: dict, ns, xs: list[int]) -> None:
        """Sink placement == the placement of a placeholder (param or tangent)."""
        by_pl: dict = defaultdict(list)
        for s, st in enumerate(ns.strategies):
            by_pl[st.out[0]].append(xs[s])
        for pl in set(w) | set(by_pl):
            terms = [(v, 1.0) for v in by_pl.get(pl, [])]
            if pl in w:
                terms.append((w[pl], -1.0))
            m.row(terms, 0.0, 0.0)


@functools.lru_cache(maxsize=None)
def _direct(o: P.Placements, r: P.Placements) -> bool:
    """Redistributions the program may use: at most one collective (slicing is free).

    Dropping multi-collective changes (except "to fully replicated") keeps edge variables near
    O(placements) per edge instead of O(placements^2); since every placement can reach
    all-Replicate, and every op has an all-Replicate strategy, the program stays feasible.
    """
    if o == r:
        return True
    if all(isinstance(p, Replicate) for p in r):
        return True
    return sum(a != b and not isinstance(a, Replicate) for a, b in zip(o, r)) <= 1


def prune_unreachable(table, est: Estimator, no_comm_edges=frozenset()) -> int:
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

    def emitted_of(src):
        ns_src = table.nodes[src[0]]
        key = (id(ns_src.strategies), src[1])
        e = emitted_memo.get(key)
        if e is None:
            keep.append(ns_src.strategies)
            e = emitted_memo[key] = frozenset(
                pl for pl in ns_src.out_placements(src[1]) if pl is not None
            )
        return e

    def ok(e, r, frozen):
        if r is None:
            return True
        key = (e, r, frozen)
        hit = ok_memo.get(key)
        if hit is None:
            hit = ok_memo[key] = any(
                o == r or (not frozen and _direct(o, r) and _finite(o, r)) for o in e
            )
        return hit

    for node, ns in table.nodes.items():
        if not ns.sources:
            continue
        emitted = tuple(emitted_of(src) for src in ns.sources)
        frozen = tuple((node, k) in no_comm_edges for k in range(len(ns.sources)))
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


@functools.lru_cache(maxsize=None)
def _finite(o: P.Placements, r: P.Placements) -> bool:
    """Whether the cost model allows o -> r at all (shape-independent: only Partial targets
    fail)."""
    return all(a == b or not b.is_partial() for a, b in zip(o, r))


def _source_val(src) -> torch.Tensor:
    node, idx = src
    v = node.meta["val"]
    if isinstance(v, (list, tuple)):
        return v[idx]
    return v
