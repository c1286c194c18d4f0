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
import math
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
from .edge_keys import ConsumerEdge, EdgeKey, GradEdge, HubEdge, OutputEdge
from .errors import ConstraintError, InfeasiblePlanError, PlannerError
from .memory import chain_up, copy_fraction, memory_rows, param_chains, term_fraction
from .recompute_program import RecomputeChoices
from .regather import Regather
from .regather_program import RegatherChoices
from .strategies import StrategyTable, resolve_source
from .trace import TracedGraph

log = logging.getLogger(__name__)

TIE_BREAK_US = 0.01
# The first plan near the LP bound is searched among columns whose reduced cost is within
# this fraction of the bound (any choice is valid: it only has to find a good plan fast).
HEURISTIC_SLACK = 0.005


@dataclass(frozen=True)
class Pin:
    """Node `node` (an input or parameter placeholder) outputs `placement`."""

    name: str  # human-readable, used in error messages
    node: fx.Node
    placement: P.Placements


@dataclass(frozen=True)
class OutputPin:
    """Forward output `index` leaves the graph in `placement`."""

    name: str
    index: int
    placement: P.Placements


@dataclass(frozen=True)
class ParameterBudget:
    """Parameter bytes per rank between `low` and `high`, as fractions of all of them."""

    name: str
    low: float | None
    high: float


@dataclass(frozen=True)
class MemoryBudget:
    """Predicted bytes per rank (memory.py) at most `bytes_per_rank`."""

    name: str
    bytes_per_rank: float


UserConstraint = Pin | OutputPin | ParameterBudget | MemoryBudget


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
    hubs: dict = field(default_factory=dict)  # (producer, output idx) -> placement (_hub)
    # traced block label -> {policy: how many of the blocks it stands for follow it}
    recompute: dict[str, dict[str, int]] = field(default_factory=dict)
    recompute_us: float = 0.0  # recomputed compute and communication in the backward
    regathered: frozenset[str] = frozenset()  # traced parameters gathered again (regather.py)
    regather_us: float = 0.0  # the backward's gathering again (in comm_us too)
    build_s: float = 0.0  # building the program
    solve_s: float = 0.0  # HiGHS


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
        # continuous columns that may take values other than 0 and 1 in a plan (sums of
        # costs or bytes): reduced-cost fixing's argument does not hold for them
        self.unfixable: set[int] = set()

    def var(self, cost: float, lb=0.0, ub=1.0) -> int:
        """A column; it is binary if it belongs to a one-hot group (`onehot`), else continuous."""
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.cost) - 1

    def vars(self, costs: list[float]) -> range:
        """Continuous columns in [0, 1] with these costs (many at once)."""
        first = len(self.cost)
        self.cost.extend(costs)
        self.lb.extend([0.0] * len(costs))
        self.ub.extend([1.0] * len(costs))
        return range(first, first + len(costs))

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

    def product(self, cols: list[int], choice: dict) -> dict[tuple[int, object], int]:
        """Columns p[i, k] equal to cols[i] * choice[k] at 0/1 values, for columns `cols`
        summing to 1 (a node's x, an edge's y) and a one-hot `choice`: sum_k p[i, k] =
        cols[i] and sum_i p[i, k] = choice[k], tight like an edge's rows."""
        grid = {(i, k): self.var(0.0) for i in range(len(cols)) for k in choice}
        for i, c in enumerate(cols):
            self.row([(grid[i, k], 1.0) for k in choice] + [(c, -1.0)], 0.0, 0.0)
        for k, z in choice.items():
            self.row([(grid[i, k], 1.0) for i in range(len(cols))] + [(z, -1.0)], 0.0, 0.0)
        return grid

    def _lp(self, keep: np.ndarray | None = None) -> "highspy.HighsLp":
        """The program as HiGHS reads it; with `keep` (sorted column indices) only those
        columns, the others being 0."""
        cost, lb, ub = self.cost, self.lb, self.ub
        starts, index, value = self.starts, self.index, self.value
        if keep is not None:
            new_id = np.full(len(self.cost), -1, dtype=np.int64)
            new_id[keep] = np.arange(len(keep))
            idx = new_id[np.asarray(self.index, dtype=np.int64)]
            mask = idx >= 0
            row_of = np.repeat(np.arange(len(self.row_lo)), np.diff(self.starts))
            starts = np.concatenate(
                [[0], np.cumsum(np.bincount(row_of[mask], minlength=len(self.row_lo)))]
            )
            index, value = idx[mask], np.asarray(self.value)[mask]
            cost, lb, ub = (np.asarray(v)[keep] for v in (self.cost, self.lb, self.ub))
        lp = highspy.HighsLp()
        n = len(cost)
        lp.num_col_ = n
        lp.num_row_ = len(self.row_lo)
        lp.col_cost_ = cost
        lp.col_lower_ = lb
        lp.col_upper_ = ub
        lp.row_lower_ = self.row_lo
        lp.row_upper_ = self.row_hi
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(self.row_lo)
        return lp

    def solve(
        self,
        time_limit: float,
        verbose: bool,
        rel_gap: float = 1e-3,
        proof_limit: float = math.inf,
    ):
        """Solve; returns (status, column values or None, objective, method, proven relative gap).

        1. The LP relaxation (no presolve: here it costs more than it saves).  When it is
           integral (typical with bf16 casts, which pin most layouts) that is the optimum.
        2. Otherwise a plan near it: branch and bound on a small program that keeps only
           the one-hot groups the relaxation left undecided (plus `free_groups`, the
           parameter-side choices: fixing those around one fractional group left 405B at
           80 GiB 2.7% above its optimum) and the columns whose reduced cost is within
           `HEURISTIC_SLACK` of the bound (all of them if that leaves no plan).  A plan
           within `rel_gap` of the LP bound is optimal to that tolerance however it was
           found.
        3. Otherwise the whole 0/1 program, minus the columns LP duality shows no plan
           cheaper than that one can use (`_reduced_cost_fixing`), started from it, for at
           most `proof_limit` seconds: if it neither finds a cheaper plan nor proves this
           one within `rel_gap` by then, the plan is the best found, with the gap it proved
           (status `kTimeLimit`; a memory budget that binds leaves the relaxation mixing
           two plans, and closing that gap is most of the time on large models).
        Fractional relaxations here are a few groups mixing two layouts half and half
        (sequence-parallel or replicated norms in fp32 Llama3-8B (8,8): 0.25% above the
        bound); step 3 keeps 40% of its columns and proves the optimum in about a second,
        where HiGHS's root cuts on the whole program took 15 s.
        """
        t_end = time.perf_counter() + float(time_limit)
        h = _highs(verbose)
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
        upper = np.asarray(self.ub, dtype=float)
        if status != Status.kOptimal:  # no usable bound: the whole program
            return self._branch_and_bound(upper, None, verbose, rel_gap, t_end)
        bound = h.getInfo().objective_function_value
        x = np.asarray(h.getSolution().col_value)
        reduced_cost = np.asarray(h.getSolution().col_dual)
        lower = np.asarray(self.lb, dtype=float)
        near = upper.copy()
        undecided = 0
        for gi, g in enumerate(self.groups):
            k = int(np.argmax(x[g]))
            if x[g[k]] > 1.0 - 1e-6:
                if gi not in self.free_groups:
                    near[g] = 0.0
                    near[g[k]] = 1.0
            else:
                undecided += 1
        if not undecided:
            return Status.kOptimal, list(x), bound, "LP (integral)", 0.0
        # a heuristic program: the columns that matter near the bound (a guess,
        # HEURISTIC_SLACK) first, the decided groups alone if that holds no plan
        for slack in (HEURISTIC_SLACK * abs(bound), math.inf):
            heuristic = self._unfix(_reduced_cost_fixing(x, reduced_cost, lower, near, slack))
            status, start, obj, _how, _gap = self._branch_and_bound(
                heuristic, None, verbose, rel_gap, t_end
            )
            if start is not None:
                break
        log.info(
            "LP bound %.3f; %d of %d one-hot groups fractional; plan near it: %s, objective %s",
            bound,
            undecided,
            len(self.groups),
            status,
            obj,
        )
        if start is not None and (obj - bound) <= rel_gap * abs(obj):
            return Status.kOptimal, start, obj, "LP + fixing", (obj - bound) / max(abs(obj), 1e-9)
        if start is not None:
            upper = self._unfix(_reduced_cost_fixing(x, reduced_cost, lower, upper, obj - bound))
            log.info(
                "reduced-cost fixing: %d of %d columns can be 1 in a plan cheaper than %.3f",
                int(np.sum(upper > 0)),
                len(upper),
                obj,
            )
        if start is not None:
            t_end = min(t_end, time.perf_counter() + proof_limit)
        status, values, obj2, how, gap = self._branch_and_bound(
            upper, start, verbose, rel_gap, t_end
        )
        if start is not None and values is not None and int(np.sum(upper > 0)) < len(upper):
            how = "reduced-cost fixing + branch and bound"
        return status, values, obj2, how, gap

    def _unfix(self, upper: np.ndarray) -> np.ndarray:
        cols = list(self.unfixable)
        upper[cols] = np.asarray(self.ub, dtype=float)[cols]
        return upper

    def _branch_and_bound(self, upper, start, verbose: bool, rel_gap: float, t_end: float):
        """The 0/1 program with column upper bounds `upper` (columns at 0 are left out),
        started from the full-length solution `start` if given, in a fresh HiGHS."""
        keep = np.flatnonzero(np.asarray(upper) > 0)
        lp = self._lp(keep)
        lp.col_upper_ = np.asarray(upper)[keep]
        h = _highs(verbose)
        h.passModel(lp)
        is_int = np.zeros(len(self.cost), dtype=bool)
        is_int[[c for g in self.groups for c in g]] = True
        ints = np.flatnonzero(is_int[keep]).astype(np.int32)
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
        h.setOptionValue("mip_rel_gap", rel_gap)
        h.setOptionValue("time_limit", max(1.0, t_end - time.perf_counter()))
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(np.asarray(start)[keep])
            h.setSolution(sol)
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        if info.primal_solution_status != 2:  # kSolutionStatusFeasible
            return status, None, None, "branch and bound", None
        values = np.zeros(len(self.cost))
        values[keep] = h.getSolution().col_value
        # The objective is recomputed from the plan: HiGHS's presolve can shift its reported
        # primal and dual bounds alike (seen: by ~10% on Llama3-8B unclustered), so only
        # their difference is used.
        obj = float(np.dot(self.cost, values))
        gap = max(0.0, info.objective_function_value - info.mip_dual_bound) / max(abs(obj), 1e-9)
        return status, list(values), obj, "branch and bound", gap


def _highs(verbose: bool) -> highspy.Highs:
    h = highspy.Highs()
    h.setOptionValue(
        "output_flag", bool(verbose) or bool(os.environ.get("AUTOPARALLEL_SOLVER_LOG"))
    )
    h.setOptionValue("threads", 1)
    return h


def _reduced_cost_fixing(x, reduced_cost, lb, ub, slack: float) -> np.ndarray:
    """Upper bounds with every column set to 0 that no plan cheaper than the incumbent
    (objective = LP bound + `slack`) can use.

    LP duality: for any point of the relaxation, objective >= bound + sum over columns at
    their lower bound 0 of reduced_cost * value (the other terms are >= 0 too).  A column at
    0 whose reduced cost exceeds `slack` would alone push a plan above the incumbent, if it
    were 1.  In a 0/1 plan every column is 0 or 1: x and the sinks/hubs are binary, and
    once they are, the tight edge rows leave each edge exactly one y at 1.  So fixing such
    columns to 0 keeps every better plan, and the search (and the gap it proves) on the
    smaller program holds for the whole one.  The margin absorbs the LP's tolerances.
    """
    margin = 1e-6 * max(1.0, abs(slack)) + 1e-4
    out = np.array(ub, dtype=float)
    at_zero = (x <= 1e-9) & (np.asarray(lb) == 0.0)
    out[at_zero & (reduced_cost > slack + margin)] = 0.0
    return out


class PlacementSolver:
    """Builds and solves the 0/1 program for one traced graph, strategy table and cost model.

    `no_comm_edges`: consumer edges on which no redistribution may happen (mixed-precision
    casts); `regather`: which parameters the backward gathers again, or leaves to the solver
    (regather.py); `recompute`: "auto" (the solver chooses each repeated block's activation
    recompute policy), one policy for all, or pinned per traced block (recompute_program.py).
    """

    def __init__(
        self,
        tg: TracedGraph,
        table: StrategyTable,
        est: Estimator,
        no_comm_edges: frozenset[ConsumerEdge] = frozenset(),
        regather: Regather = Regather(),
        recompute: str | dict[str, dict[str, int]] = "none",
    ):
        self.tg = tg
        self.recompute = recompute
        self.table = table
        self.est = est
        self.mesh_shape = table.mesh_shape
        self.no_comm_edges = frozenset(no_comm_edges)
        self.regather = regather
        self._compute: dict[tuple[fx.Node, int], float] = {}
        self._param_side: set | None = None
        self._pair_memo: dict = {}

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

    def pairs(
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
        self,
        constraints: list[UserConstraint],
        time_limit: float = 120.0,
        verbose: bool = False,
        rep: dict[fx.Node, fx.Node] | None = None,
        proof_limit: float = math.inf,
    ) -> Solution:
        """The cheapest plan under `constraints`; `rep` maps each node to the representative
        whose variables it shares (cluster.py; None: no sharing).  `proof_limit` bounds the
        search for a cheaper plan than a first one near the bound (`_Model.solve`)."""
        sol = self._solve_once(constraints, time_limit, verbose, rep, proof_limit)
        if sol is not None:
            return sol
        # infeasible: find a minimal conflicting set of user constraints
        active = list(constraints)
        if self._solve_once([], time_limit, False, rep, proof_limit) is None:
            raise InfeasiblePlanError("no placement exists even without user constraints")
        for c in list(active):
            trial = [a for a in active if a is not c]
            if self._solve_once(trial, time_limit, False, rep, proof_limit) is None:
                active = trial
        names = "; ".join(c.name for c in active)
        budgets = [c for c in active if isinstance(c, MemoryBudget)]
        if budgets:
            others = [c for c in constraints if not isinstance(c, MemoryBudget)]
            need = self.minimum_memory(others, time_limit, rep)
            if need is not None:
                names += (
                    f" (the least memory any plan needs under the other constraints is "
                    f"{need / 2**30:.4g} GiB per rank)"
                )
        raise InfeasiblePlanError(f"constraints cannot all hold: {names}")

    def minimum_memory(self, constraints, time_limit: float, rep) -> float | None:
        """The smallest predicted bytes per rank of any plan under `constraints` (no memory
        budget among them): the same program with the memory row as its objective."""
        program = self._build(constraints, rep)
        m = program.m
        m.cost = [0.0] * len(m.cost)
        peak = m.var(1.0, 0.0, highspy.kHighsInf)  # GiB; peak >= every row
        m.unfixable.add(peak)
        for terms in program.memory_rows(2.0**30):
            m.row(terms + [(peak, -1.0)], -highspy.kHighsInf, 0.0)
        status, values, obj, _how, _gap = m.solve(time_limit, False)
        if values is None:
            return None
        return float(obj) * 2.0**30

    def _build(self, constraints, rep) -> "_Program":
        program = _Program(self, rep)
        program.add_placement_choices()
        program.recompute.add_choices()
        program.regather.add_choices()
        program.add_edges()
        program.add_output_sinks()
        program.add_gradient_sinks()
        program.recompute.add_costs()
        program.regather.add_costs()
        for c in constraints:
            if isinstance(c, (Pin, OutputPin)):
                program.add_pin(c)
            elif isinstance(c, ParameterBudget):
                program.add_parameter_budget(c)
            else:
                program.add_memory_budget(c)
        return program

    def _solve_once(
        self, constraints, time_limit, verbose, rep, proof_limit: float = math.inf
    ) -> Solution | None:
        t0 = time.perf_counter()
        program = self._build(constraints, rep)
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        status, values, obj, how, gap = program.m.solve(
            time_limit, verbose, proof_limit=proof_limit
        )
        solve_s = time.perf_counter() - t1
        log.info(
            "ILP %d vars, %d rows: build %.2fs, solve %.2fs, status %s (%s, gap %s)",
            len(program.m.cost),
            len(program.m.row_lo),
            build_s,
            solve_s,
            status,
            how,
            gap,
        )
        if status == highspy.HighsModelStatus.kInfeasible or values is None:
            if status == highspy.HighsModelStatus.kTimeLimit:
                raise PlannerError(
                    f"solver hit the {time_limit}s time limit without a feasible plan"
                )
            return None
        if status != highspy.HighsModelStatus.kOptimal:
            log.warning(
                "solver stopped with status %s; the plan is feasible, proven within %s of optimal",
                status,
                "-" if gap is None else f"{gap:.2%}",
            )
        sol = program.solution(values, status, obj, how, gap)
        sol.build_s, sol.solve_s = build_s, solve_s
        return sol


class _Program:
    """One 0/1 program, built one constraint family at a time (variables in the module
    docstring); `solution` reads a plan off the solver's values.

    Notation: `x[n, s]` node n takes strategy s; `y[e, o, r]` edge e redistributes o -> r;
    `h[v, p]` value v's hub placement; `w[k, p]` sink k's placement.  Nodes that share a
    representative (`rep`) share their x, and the costs are multiplied by how many nodes
    (and shallow-trace blocks, `tg.weight`) each variable stands for.
    """

    def __init__(self, solver: PlacementSolver, rep: dict[fx.Node, fx.Node] | None):
        self.solver = solver
        self.tg, self.table, self.est = solver.tg, solver.table, solver.est
        self.rep = rep if rep is not None else {n: n for n in self.table.nodes}
        self.weight = self.tg.weight  # > 1 for a shallow trace's block standing for several
        self.mult: dict[fx.Node, int] = defaultdict(int)
        for n in self.table.nodes:
            self.mult[self.rep[n]] += self.weight(n)
        self.represented: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in self.table.nodes:
            self.represented[self.rep[node]].append(node)
        self.m = _Model()
        self.pside = solver.param_side_nodes()
        self.gside = solver._grad_side
        self.eta = self.est.cm.overlap_efficiency
        self.xvars: dict[fx.Node, list[int]] = {}
        self.edge_vars: list[tuple[list[EdgeKey], int, float]] = []  # (members, y, cost each)
        self.edge_pair_vars: dict[EdgeKey, list] = {}  # member -> [(y, emitted, required)]
        self.pair_cost: dict[int, float] = {}  # y -> redistribution time of one instance
        self.overlapped: set[int] = set()
        self.hub_vars: dict[tuple, dict[P.Placements, int]] = {}
        self.sink_vars: dict[int, dict[P.Placements, int]] = {}
        self.grad_vars: dict[str, dict[P.Placements, int]] = {}
        self.recompute = RecomputeChoices(self, solver.recompute)
        self.regather = RegatherChoices(self, solver.regather)

    def scaled_comm(self, y: int) -> float:
        """Redistribution time of pair y as the objective counts it (the part not hidden
        behind compute where overlappable)."""
        c = self.pair_cost[y]
        return c * (1.0 - self.eta) if y in self.overlapped else c

    def member_weight(self, key: EdgeKey) -> int:
        if isinstance(key, GradEdge):
            return self.weight(self.tg.params[key.fqn])
        if isinstance(key, OutputEdge):
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
                m.var(self.solver.compute_cost(r, s) * self.mult[r]) for s in range(len(strategies))
            ]
            self.xvars[r] = self.xvars[node] = xs
            m.onehot(xs)
            if r in self.pside or r in self.gside:
                m.free_groups.add(len(m.groups) - 1)

    def _producer_groups(self, src) -> dict[P.Placements, list[int]]:
        g: dict[P.Placements, list[int]] = defaultdict(list)
        for s, pl in enumerate(self.table.nodes[src[0]].out_placements(src[1])):
            if pl is not None:
                g[pl].append(self.xvars[src[0]][s])
        return g

    def _link(self, src, cons_groups, members: list[EdgeKey], prod=None) -> None:
        """Tight edge rows between a producer (or its hub) and a consumer's requirements:
        for every emitted o, sum_r y[e, o, r] = sum of the producer's x emitting o; for every
        required r, sum_o y[e, o, r] = sum of the consumer's x needing r.  Objective +=
        comm(o -> r) y (times (1 - overlap efficiency) where parameter-side, overlappable)."""
        m = self.m
        val = _source_val(src)
        prod = self._producer_groups(src) if prod is None else prod
        pair_vars: list = []
        for key in members:
            self.edge_pair_vars[key] = pair_vars
        rows_o = {o: [(v, -1.0) for v in xs] for o, xs in prod.items()}
        rows_r = {r: [(v, -1.0) for v in xs] for r, xs in cons_groups.items()}
        frozen = any(k in self.solver.no_comm_edges for k in members)
        count = sum(self.member_weight(k) for k in members)
        first = members[0]
        overlappable = self.eta > 0 and (
            src[0] in self.pside
            or isinstance(first, GradEdge)
            or (isinstance(first, (ConsumerEdge, HubEdge)) and first.node in self.gside)
        )
        sink = isinstance(first, (GradEdge, OutputEdge))
        pairs = self.solver.pairs(
            tuple(prod), tuple(cons_groups), tuple(val.shape), val.element_size(), frozen, sink
        )
        scale = (1.0 - self.eta) if overlappable else 1.0
        ys = m.vars([(c * scale + (TIE_BREAK_US if o != r else 0.0)) * count for o, r, c in pairs])
        if overlappable:
            self.overlapped.update(ys)
        for y, (o, r, c) in zip(ys, pairs):
            self.edge_vars.append((members, y, c))
            self.pair_cost[y] = c
            pair_vars.append((y, o, r))
            rows_o[o].append((y, 1.0))
            rows_r[r].append((y, 1.0))
        for terms in list(rows_o.values()) + list(rows_r.values()):
            m.row(terms, 0.0, 0.0)

    def add_edges(self) -> None:
        """One set of y per (producer group, consumer group, argument); a value read by
        several consumer groups goes through a hub (`_hub`), its consumers link from it."""
        table, rep = self.table, self.rep
        edges: dict[tuple, list[ConsumerEdge]] = defaultdict(list)
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
                and not any(e in self.solver.no_comm_edges for k in keys for e in edges[k])
            ):
                w = _hub(self.m, self._producer_groups(src), [required[k] for k in keys])
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
        enters in the same placement (`_tie`)."""
        for i, out in enumerate(self.tg.outputs):
            src = resolve_source(out)
            val = _source_val(src)
            w = {pl: self.m.var(0.0) for pl in P.all_placements(val.shape, self.solver.mesh_shape)}
            self.m.onehot(list(w.values()))
            self.sink_vars[i] = w
            self._link(src, {pl: [v] for pl, v in w.items()}, [OutputEdge(i)])
            tan = self.tg.tangents[i]
            if tan is not None and tan in self.table.nodes:
                _tie(self.m, w, self.table.nodes[tan], self.xvars[tan])

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
            val = _source_val(src)
            w = {pl: self.m.var(0.0) for pl in P.all_placements(val.shape, self.solver.mesh_shape)}
            self.m.onehot(list(w.values()))
            for fqn in fqns:
                self.grad_vars[fqn] = w
            self._link(src, {pl: [v] for pl, v in w.items()}, [GradEdge(f) for f in fqns])
            _tie(self.m, w, self.table.nodes[pnode], self.xvars[pnode])

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

    def add_parameter_budget(self, c: ParameterBudget) -> None:
        """low <= sum_p bytes(p)/total * sum_s shard_fraction(p, s) x[p, s] <= high, in units of
        all parameter bytes (a well-scaled row); each bound is raised to what the smallest
        shard of every parameter allows."""
        tg, weight = self.tg, self.weight
        total = (
            float(sum(self.solver.param_bytes(n) * weight(n) for n in tg.params.values())) or 1.0
        )
        terms, lo_bound, hi_bound = [], 0.0, 0.0
        for pnode in tg.params.values():
            ns = self.table.nodes[pnode]
            b = self.solver.param_bytes(pnode) * weight(pnode) / total
            fr = [
                P.shard_fraction(pnode.meta["val"].shape, st.out[0], self.solver.mesh_shape)
                for st in ns.strategies
            ]
            for s, f in enumerate(fr):
                terms.append((self.xvars[pnode][s], b * f))
            fmin = min(fr)
            hi_bound += b * max(fmin, c.high)
            lo_bound += b * max(fmin, c.low if c.low is not None else 0.0)
        self.m.row(
            terms,
            lo_bound * (1 - 1e-9) if c.low is not None else -highspy.kHighsInf,
            hi_bound * (1 + 1e-9),
        )

    def add_memory_budget(self, c: MemoryBudget) -> None:
        """Every candidate peak (memory.py) at most the budget: row / budget <= 1."""
        for terms in self.memory_rows(c.bytes_per_rank):
            self.m.row(terms, -highspy.kHighsInf, 1.0)

    def memory_rows(self, scale: float) -> list[list[tuple[int, float]]]:
        """The memory model's rows (memory.py: params, grads, optimizer state, the
        activations alive at each candidate peak) in units of `scale` bytes, so the
        coefficients are O(1).  A copy held on an edge counts only if that edge
        redistributes (through a hub on both steps: an upper bound)."""
        table, rc = self.table, self.recompute
        options = rc.options if rc.active else ("none",)
        out = []
        for row in memory_rows(self.tg, table, options, self.solver.regather):
            terms: list[tuple[int, float]] = []
            copies: set = set()
            for e in row.entries:
                t = e.term
                if self.regather.decides(e):
                    if t.kind != "copy" or (t.key, e.regathered) not in copies:
                        copies.add((t.key, e.regathered))
                        self.regather.add_entry(e, e.weight / scale, terms)
                    continue
                if t.kind == "copy":
                    if t.key in copies:
                        continue
                    copies.add(t.key)
                    mult = self.weight(t.node) if rc.auto else e.multiplier(rc.pins)
                    if mult:
                        self._copy_terms(t, mult / scale, terms)
                    continue
                for s in range(len(self.xvars[t.node])):
                    frac = term_fraction(t, table, s)
                    if not frac:
                        continue
                    col, mult = rc.entry_column(e, s)
                    if mult:
                        terms.append((col, t.full_bytes * frac * mult / scale))
            out.append(terms)
        return out

    def _copy_terms(self, t, coef: float, terms: list) -> None:
        table = self.table
        src = table.nodes[t.node].sources[t.arg]
        on_edge = self.edge_pair_vars.get(ConsumerEdge(t.node, t.arg), [])
        on_hub = self.edge_pair_vars.get(HubEdge(src[0], src[1]), [])
        for y, o, r in on_edge + on_hub:
            f = copy_fraction(t, table, o, r)
            if f:
                terms.append((y, t.full_bytes * f * coef))

    # ---------------------------------------------------------------- reading the answer
    def solution(self, values, status, obj, how, gap) -> Solution:
        def chosen(w: dict) -> P.Placements:
            return max(w, key=lambda pl: values[w[pl]])

        choice, compute = {}, 0.0
        for node, xs in self.xvars.items():
            s = max(range(len(xs)), key=lambda i: values[xs[i]])
            choice[node] = s
            compute += self.solver.compute_cost(self.rep[node], s) * self.weight(node)
        comm = overlapped = 0.0
        edge_comm: dict[EdgeKey, float] = defaultdict(float)
        for members, v, c in self.edge_vars:
            if values[v] > 0.5:
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
            optimal=status == highspy.HighsModelStatus.kOptimal,
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


def _tie(m: _Model, w: dict, ns, xs: list[int]) -> None:
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
