"""The domain-free engine of stage 4: a sparse 0/1 program solved with HiGHS (highspy).

Knows columns, rows and one-hot groups, nothing of graphs or placements (it is tested on
its own, `tests/unit_tests/test_solver_exact.py`).  `Milp.solve` runs: LP relaxation ->
a first plan among the columns near the bound (the heuristic) -> reduced-cost fixing ->
branch and bound from that plan, bounded by the proof limit.

highspy is imported on the first solve, not with this module: a training rank that receives
its plan from another process never loads it.  What leaves this module is the engine's own:
a status among `OPTIMAL`, `INFEASIBLE`, `TIME_LIMIT` (or HiGHS's name for any other) and
`math.inf` for an unbounded side of a row or column.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import highspy

log = logging.getLogger(__name__)

# The first plan near the LP bound is searched among columns whose reduced cost is within
# this fraction of the bound (any choice is valid: it only has to find a good plan fast).
HEURISTIC_SLACK = 0.005

OPTIMAL, INFEASIBLE, TIME_LIMIT = "optimal", "infeasible", "time limit"

# (status, column values or None, objective or None, how it was found, proven relative gap
# or None)
MilpResult = tuple[str, list[float] | None, float | None, str, float | None]
_HighsResult = tuple[Any, list[float] | None, float | None, str, float | None]


def _highspy() -> ModuleType:
    import highspy

    return highspy


def _status(highs_status: Any) -> str:
    """HiGHS's model status in the engine's terms."""
    known = _highspy().HighsModelStatus
    names = {known.kOptimal: OPTIMAL, known.kInfeasible: INFEASIBLE, known.kTimeLimit: TIME_LIMIT}
    return names.get(highs_status, str(highs_status))


@dataclass
class _Relaxed:
    bound: float
    x: np.ndarray
    reduced_cost: np.ndarray


@dataclass(frozen=True)
class _Arrays:
    cost: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    starts: np.ndarray
    index: np.ndarray
    value: np.ndarray


class Milp:
    """Row-wise sparse model accumulator."""

    def __init__(self) -> None:
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
        self._arrays_of: tuple[tuple[int, int, int], _Arrays] | None = None

    def var(self, cost: float, lb: float = 0.0, ub: float = 1.0) -> int:
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
        """lo <= sum of coefficient * column <= hi; a column named twice gets the sum."""
        if len({c for c, _ in terms}) < len(terms):
            merged: dict[int, float] = defaultdict(float)
            for c, v in terms:
                merged[c] += v
            terms = list(merged.items())
        self.index += [c for c, v in terms if v != 0.0]
        self.value += [v for _, v in terms if v != 0.0]
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

    def _arrays(self) -> _Arrays:
        """The program's columns and rows as arrays, made once for the solves that read it
        (again if a column or row was added since)."""
        size = (len(self.cost), len(self.index), len(self.row_lo))
        if self._arrays_of is None or self._arrays_of[0] != size:
            f64, i64 = np.float64, np.int64
            self._arrays_of = (
                size,
                _Arrays(
                    cost=np.asarray(self.cost, dtype=f64),
                    lb=np.asarray(self.lb, dtype=f64),
                    ub=np.asarray(self.ub, dtype=f64),
                    starts=np.asarray(self.starts, dtype=i64),
                    index=np.asarray(self.index, dtype=i64),
                    value=np.asarray(self.value, dtype=f64),
                ),
            )
        return self._arrays_of[1]

    def _lp(self, keep: np.ndarray | None = None) -> highspy.HighsLp:
        """The program as HiGHS reads it; with `keep` (sorted column indices) only those
        columns, the others being 0."""
        a = self._arrays()
        cost, lb, ub, starts, index, value = a.cost, a.lb, a.ub, a.starts, a.index, a.value
        if keep is not None:
            new_id = np.full(len(cost), -1, dtype=np.int64)
            new_id[keep] = np.arange(len(keep))
            idx = new_id[index]
            mask = idx >= 0
            row_of = np.repeat(np.arange(len(self.row_lo)), np.diff(starts))
            starts = np.concatenate(
                [[0], np.cumsum(np.bincount(row_of[mask], minlength=len(self.row_lo)))]
            )
            index, value = idx[mask], value[mask]
            cost, lb, ub = cost[keep], lb[keep], ub[keep]
        hs = _highspy()
        lp = hs.HighsLp()
        n = len(cost)
        lp.num_col_ = n
        lp.num_row_ = len(self.row_lo)
        lp.col_cost_ = cost
        lp.col_lower_ = lb
        lp.col_upper_ = ub
        lp.row_lower_ = self.row_lo
        lp.row_upper_ = self.row_hi
        lp.a_matrix_.format_ = hs.MatrixFormat.kRowwise
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
    ) -> MilpResult:
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
           (status `TIME_LIMIT`; a memory budget that binds leaves the relaxation mixing
           two plans, and closing that gap is most of the time on large models).
        Fractional relaxations here are a few groups mixing two layouts half and half
        (sequence-parallel or replicated norms in fp32 Llama3-8B (8,8): 0.25% above the
        bound); step 3 keeps 40% of its columns and proves the optimum in about a second,
        where HiGHS's root cuts on the whole program took 15 s.
        """
        status, values, obj, how, gap = self._solve(time_limit, verbose, rel_gap, proof_limit)
        return _status(status), values, obj, how, gap

    def _solve(
        self, time_limit: float, verbose: bool, rel_gap: float, proof_limit: float
    ) -> _HighsResult:
        t_end = time.perf_counter() + float(time_limit)
        Status = _highspy().HighsModelStatus
        status, relaxed = self._relaxation(time_limit, verbose)
        if status == Status.kInfeasible:
            return status, None, None, "LP", None
        upper = self._arrays().ub.copy()
        if relaxed is None:  # no usable bound: the whole program
            return self._branch_and_bound(upper, None, verbose, rel_gap, t_end)
        bound, x, reduced_cost = relaxed.bound, relaxed.x, relaxed.reduced_cost
        near, undecided = self._decided(x)
        if not undecided:
            return Status.kOptimal, list(x), bound, "LP (integral)", 0.0
        lower = self._arrays().lb
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
        if start is None:
            return self._branch_and_bound(upper, None, verbose, rel_gap, t_end)
        assert obj is not None  # a plan has an objective
        if (obj - bound) <= rel_gap * abs(obj):
            return Status.kOptimal, start, obj, "LP + fixing", (obj - bound) / max(abs(obj), 1e-9)
        upper = self._unfix(_reduced_cost_fixing(x, reduced_cost, lower, upper, obj - bound))
        log.info(
            "reduced-cost fixing: %d of %d columns can be 1 in a plan cheaper than %.3f",
            int(np.sum(upper > 0)),
            len(upper),
            obj,
        )
        t_end = min(t_end, time.perf_counter() + proof_limit)
        status, values, obj2, how, gap = self._branch_and_bound(
            upper, start, verbose, rel_gap, t_end
        )
        if values is not None and int(np.sum(upper > 0)) < len(upper):
            how = "reduced-cost fixing + branch and bound"
        return status, values, obj2, how, gap

    def _relaxation(self, time_limit: float, verbose: bool) -> tuple[Any, _Relaxed | None]:
        """The LP relaxation's status, and its bound, column values and reduced costs when it
        solved to optimality."""
        h = _highs(verbose)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("presolve", "off")
        h.passModel(self._lp())
        if os.environ.get("AUTOPARALLEL_WRITE_MODEL"):
            h.writeModel(os.environ["AUTOPARALLEL_WRITE_MODEL"])
        h.run()
        status = h.getModelStatus()
        if status != _highspy().HighsModelStatus.kOptimal:
            return status, None
        solution = h.getSolution()
        return status, _Relaxed(
            h.getInfo().objective_function_value,
            np.asarray(solution.col_value),
            np.asarray(solution.col_dual),
        )

    def _decided(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """Upper bounds fixing every one-hot group the relaxation `x` decided (except
        `free_groups`) to its choice, and how many groups it left fractional."""
        near = self._arrays().ub.copy()
        undecided = 0
        for gi, g in enumerate(self.groups):
            k = int(np.argmax(x[g]))
            if x[g[k]] > 1.0 - 1e-6:
                if gi not in self.free_groups:
                    near[g] = 0.0
                    near[g[k]] = 1.0
            else:
                undecided += 1
        return near, undecided

    def _unfix(self, upper: np.ndarray) -> np.ndarray:
        cols = list(self.unfixable)
        upper[cols] = self._arrays().ub[cols]
        return upper

    def _branch_and_bound(
        self,
        upper: np.ndarray,
        start: list[float] | None,
        verbose: bool,
        rel_gap: float,
        t_end: float,
    ) -> _HighsResult:
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
        hs = _highspy()
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), hs.HighsVarType.kInteger))
        h.setOptionValue("mip_rel_gap", rel_gap)
        # HiGHS's light presolve (mode 2; mode 1 crashed HiGHS 1.16 here): the full one
        # spent most of a proof presolving (Llama 3 8B fp32 on (8,8): 0.9 of 1.1 s), and
        # two memory-bound programs that ran out of time with it are proved with this one;
        # one program of the eight compared proves slower (benchmarks/planner.md)
        h.setOptionValue("presolve_mode", 2)
        h.setOptionValue("time_limit", max(1.0, t_end - time.perf_counter()))
        if start is not None:
            sol = hs.HighsSolution()
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
    h = _highspy().Highs()
    h.setOptionValue(
        "output_flag", bool(verbose) or bool(os.environ.get("AUTOPARALLEL_SOLVER_LOG"))
    )
    h.setOptionValue("threads", 1)
    return h


def _reduced_cost_fixing(
    x: np.ndarray, reduced_cost: np.ndarray, lb: np.ndarray, ub: np.ndarray, slack: float
) -> np.ndarray:
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
