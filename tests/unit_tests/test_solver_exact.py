"""The 0/1 solver (`milp.Milp.solve`) against brute force on programs whose LP
relaxation is fractional: odd cycles of nodes that prefer to differ from their neighbours
(the relaxation's half-and-half mixtures, as fp32 Llama3 programs show), in the same
formulation as the planner's (one-hot x per node, tight marginal rows per edge)."""

from __future__ import annotations

import itertools
import random

import pytest

from torchtitan.autoparallel.solve.milp import Milp


def _program(n_nodes: int, states: int, seed: int):
    rng = random.Random(seed)
    unary = [[rng.uniform(0, 1) for _ in range(states)] for _ in range(n_nodes)]
    edges = [(i, (i + 1) % n_nodes) for i in range(n_nodes)]  # an odd ring: frustrated
    edges += [(i, (i + 3) % n_nodes) for i in range(0, n_nodes, 2)]
    pair = {
        e: [
            [(0.0 if a != b else 10.0) + rng.uniform(0, 2) for b in range(states)]
            for a in range(states)
        ]
        for e in edges
    }
    m = Milp()
    x = []
    for i in range(n_nodes):
        cols = [m.var(unary[i][s]) for s in range(states)]
        m.onehot(cols)
        x.append(cols)
    for (i, j), cost in pair.items():
        y = {(a, b): m.var(cost[a][b]) for a in range(states) for b in range(states)}
        for a in range(states):
            m.row([(y[a, b], 1.0) for b in range(states)] + [(x[i][a], -1.0)], 0.0, 0.0)
        for b in range(states):
            m.row([(y[a, b], 1.0) for a in range(states)] + [(x[j][b], -1.0)], 0.0, 0.0)

    def cost_of(assign) -> float:
        return sum(unary[i][s] for i, s in enumerate(assign)) + sum(
            pair[i, j][assign[i]][assign[j]] for i, j in pair
        )

    best = min(cost_of(a) for a in itertools.product(range(states), repeat=n_nodes))
    return m, x, cost_of, best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_nodes, states", [(7, 2), (5, 3)])
def test_optimum_matches_brute_force(n_nodes, states, seed):
    m, x, cost_of, best = _program(n_nodes, states, seed)
    status, values, objective, how, gap = m.solve(time_limit=30.0, verbose=False)
    assert values is not None and gap is not None and gap <= 1e-3
    assign = []
    for cols in x:
        ones = [s for s, c in enumerate(cols) if values[c] > 0.5]
        assert len(ones) == 1 and all(abs(values[c] - round(values[c])) < 1e-6 for c in cols)
        assign.append(ones[0])
    assert objective == pytest.approx(cost_of(assign), rel=1e-9)  # the reported cost is real
    assert best - 1e-9 <= objective <= best * (1 + 1e-3)  # optimal to the solver's tolerance
    assert how != "LP (integral)"  # these relaxations are fractional: the search ran
    if states == 3:  # here duality rules columns out before the final search
        assert how == "reduced-cost fixing + branch and bound"


def test_search_from_a_first_plan_is_bounded_by_the_proof_limit(monkeypatch):
    """Once a plan near the bound exists, the whole program's search gets `proof_limit`
    seconds (of the solve's time limit); here it still finishes and proves the optimum."""
    import time

    m, _x, _cost_of, best = _program(5, 3, seed=0)
    budgets = []
    search = Milp._branch_and_bound

    def spy(self, upper, start, verbose, rel_gap, t_end):
        budgets.append((start is not None, t_end - time.perf_counter()))
        return search(self, upper, start, verbose, rel_gap, t_end)

    monkeypatch.setattr(Milp, "_branch_and_bound", spy)
    status, values, objective, how, gap = m.solve(time_limit=30.0, verbose=False, proof_limit=2.0)
    assert how == "reduced-cost fixing + branch and bound"
    started = [left for from_plan, left in budgets if from_plan]
    assert len(started) == 1 and 0.0 < started[0] <= 2.0
    assert all(left > 2.0 for from_plan, left in budgets if not from_plan)  # the time limit's
    assert gap <= 1e-3 and objective <= best * (1 + 1e-3)
