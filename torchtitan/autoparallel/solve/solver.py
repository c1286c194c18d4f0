"""Stage 4: choose one strategy per node.  `PlacementSolver` builds the placement program
(program.py) for a traced graph, its strategy table and a cost model, solves it with the
engine (milp.py) and reads the plan's `Solution` off it.

User constraints (constraints.py) are named; if the program is infeasible they are dropped
one at a time to find a minimal conflicting set, and its names are the error.
"""

from __future__ import annotations

import logging
import math
import time

import torch.fx as fx

from ..errors import InfeasiblePlanError, PlannerError
from .constraints import (
    CollectiveDim,
    MemoryBudget,
    OutputPin,
    ParameterBudget,
    Pin,
    UserConstraint,
)
from .milp import INFEASIBLE, OPTIMAL, TIME_LIMIT
from .problem import PlanningProblem
from .program import PlacementProgram, Solution

log = logging.getLogger(__name__)

Rep = dict[fx.Node, fx.Node] | None  # node -> the node whose variables it shares


class PlacementSolver:
    """Builds and solves the 0/1 program of one planning problem (problem.py): its prices,
    its keep-or-gather-again and recompute settings, its constraints and limits."""

    def __init__(self, problem: PlanningProblem):
        self.prices = problem.prices
        self.regather = problem.regather
        self.recompute = problem.recompute
        self.problem = problem

    def solve(self, verbose: bool = False) -> Solution:
        """The cheapest plan under the problem's constraints; on an infeasible program, an
        `InfeasiblePlanError` naming a minimal conflicting set of them."""
        p = self.problem
        return self._solve(
            list(p.constraints),
            p.settings.time_limit,
            verbose,
            dict(p.rep) if p.rep is not None else None,
            p.settings.proof_limit,
        )

    def _solve(
        self,
        constraints: list[UserConstraint],
        time_limit: float,
        verbose: bool,
        rep: dict[fx.Node, fx.Node] | None,
        proof_limit: float = math.inf,
    ) -> Solution:
        """The cheapest plan under `constraints`; `rep` maps each node to the representative
        whose variables it shares (cluster.py; None: no sharing).  `proof_limit` bounds the
        search for a cheaper plan than a first one near the bound (`Milp.solve`)."""
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
            others: list[UserConstraint] = [
                c for c in constraints if not isinstance(c, MemoryBudget)
            ]
            need = self.minimum_memory(others, time_limit, rep, budgets[0].in_flight)
            if need is not None:
                names += (
                    f" (the least memory any plan needs under the other constraints is "
                    f"{need / 2**30:.4g} GiB per rank)"
                )
        raise InfeasiblePlanError(f"constraints cannot all hold: {names}")

    def minimum_memory(
        self,
        constraints: list[UserConstraint],
        time_limit: float,
        rep: Rep,
        in_flight: float = 1.0,
    ) -> float | None:
        """The smallest predicted bytes per rank of any plan under `constraints` (no memory
        budget among them), with `in_flight` microbatches' saved activations: the same
        program with the memory rows as its objective."""
        program = self._build(constraints, rep)
        m = program.m
        m.cost = [0.0] * len(m.cost)
        peak = m.var(1.0, 0.0, math.inf)  # GiB; peak >= every row
        m.unfixable.add(peak)
        for terms in program.memory_rows(2.0**30, in_flight):
            m.row(terms + [(peak, -1.0)], -math.inf, 0.0)
        status, values, obj, _how, _gap = m.solve(time_limit, False)
        if values is None or obj is None:
            return None
        return float(obj) * 2.0**30

    def _build(self, constraints: list[UserConstraint], rep: Rep) -> PlacementProgram:
        program = PlacementProgram(self.prices, rep, self.regather, self.recompute)
        program.add_placement_choices()
        program.recompute.add_choices()
        program.regather.add_choices()
        program.add_edges()
        program.add_output_sinks()
        program.add_gradient_sinks()
        program.add_input_gradient_sinks()
        program.recompute.add_costs()
        program.regather.add_costs()
        for c in constraints:
            if isinstance(c, (Pin, OutputPin)):
                program.add_pin(c)
            elif isinstance(c, ParameterBudget):
                program.add_parameter_budget(c)
            elif isinstance(c, CollectiveDim):
                program.add_collective_dim(c)
            else:
                program.add_memory_budget(c)
        return program

    def _solve_once(
        self,
        constraints: list[UserConstraint],
        time_limit: float,
        verbose: bool,
        rep: Rep,
        proof_limit: float = math.inf,
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
        if status == INFEASIBLE or values is None:
            if status == TIME_LIMIT:
                raise PlannerError(
                    f"solver hit the {time_limit}s time limit without a feasible plan"
                )
            return None
        if status != OPTIMAL:
            log.warning(
                "solver stopped with status %s; the plan is feasible, proven within %s of optimal",
                status,
                "-" if gap is None else f"{gap:.2%}",
            )
        assert obj is not None  # a plan has an objective
        sol = program.solution(values, status, obj, how, gap)
        sol.build_s, sol.solve_s = build_s, solve_s
        return sol
