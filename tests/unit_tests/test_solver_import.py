"""The solver's engine (highspy) loads on the first solve, not with the trainer or the
planner: a rank that receives its plan from the planning process never holds it."""

from __future__ import annotations

import subprocess
import sys

from torchtitan.autoparallel.solve.milp import OPTIMAL, Milp


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_the_planned_spec_imports_without_highspy():
    loaded = _modules_after(
        "import torchtitan.train, torchtitan.experiments.auto_parallel, torchtitan.autoparallel"
    )
    assert "torchtitan.autoparallel.solve.solver" in loaded  # the planner is imported ...
    assert "highspy" not in loaded  # ... but not its engine


def test_a_solve_reports_the_engines_own_status():
    m = Milp()
    xs = [m.var(2.0), m.var(1.0)]
    m.onehot(xs)
    status, values, objective, _how, gap = m.solve(time_limit=10.0, verbose=False)
    assert (status, values, objective, gap) == (OPTIMAL, [0.0, 1.0], 1.0, 0.0)
