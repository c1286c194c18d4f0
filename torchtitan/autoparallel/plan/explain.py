"""Why a parameter is placed as it is: the plan solved again with each alternative pinned.

For the parameters a pattern names (all of one shape), every placement they could take on
the mesh is pinned in turn, everything else under the same constraints as the plan being
explained, and the solver re-plans the rest of the graph around it.  Each row is then what
choosing that placement would do to the predicted step — compute (recomputation
included), exposed communication, peak memory per rank — or the smallest set of
constraints that forbids it.  The chosen placement's row is the plan itself, re-solved:
the solver proves each plan within its gap of the optimum, so no alternative is cheaper by
more than that.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConstraintError, InfeasiblePlanError
from ..graph import placements as P
from .plan import Plan


class Replanner(Protocol):
    """What explaining needs of the planner (`AutoParallel`, entered): its mesh, the
    parameters' shapes, pins, and a solve."""

    mesh: Any

    def param_shapes(self) -> dict[str, list[int]]: ...

    def add_parameter_constraint(self, fqn: str, placements: Sequence[Any]) -> None: ...

    def optimize_placement(self) -> Plan: ...


@dataclass(frozen=True)
class Alternative:
    """One placement of the explained parameters: its re-solved plan, or why none exists."""

    placement: str
    plan: Plan | None
    infeasible: str | None = None


def matching_parameters(pattern: str, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The parameters `pattern` (a glob over names) names; a `ConstraintError` when none,
    or when they differ in shape (one placement could not mean the same for all)."""
    names = [n for n in shapes if fnmatch.fnmatchcase(n, pattern)]
    if not names:
        raise ConstraintError(f"explain {pattern!r}: no parameter matches it")
    kinds = {tuple(shapes[n]) for n in names}
    if len(kinds) > 1:
        found = ", ".join(f"{n} {tuple(shapes[n])}" for n in names[:4])
        raise ConstraintError(
            f"explain {pattern!r}: it matches parameters of different shapes ({found}); "
            "narrow the pattern to parameters of one shape"
        )
    return names


def explain_placements(
    autop: Replanner, params: Sequence[str], constrain: Callable[[], None]
) -> list[Alternative]:
    """Every placement of `params` on `autop`'s mesh, each solved with `constrain()` (which
    sets the explained plan's constraints afresh) plus that placement pinned on them."""
    shape = autop.param_shapes()[params[0]]
    out = []
    for pl in P.all_placements(shape, tuple(autop.mesh.shape)):
        constrain()
        for name in params:
            autop.add_parameter_constraint(name, pl)
        try:
            out.append(Alternative(P.fmt(pl), autop.optimize_placement()))
        except InfeasiblePlanError as e:
            out.append(Alternative(P.fmt(pl), None, str(e)))
    return out


def explanation_table(chosen: str, alternatives: Sequence[Alternative]) -> str:
    """The alternatives as a table, the chosen placement first, the others by predicted
    step, each with its difference from the chosen one."""
    solved = sorted(
        ((a.placement, a.plan) for a in alternatives if a.plan is not None),
        key=lambda row: (row[0] != chosen, row[1].predicted["step_us"]),
    )
    if not solved or solved[0][0] != chosen:
        raise ConstraintError(f"explain: the chosen placement {chosen} is not among them")
    base_us = solved[0][1].predicted["step_us"]
    lines = [
        f"{'placement':<12} {'step ms':>9} {'vs chosen':>10} {'compute':>9} "
        f"{'exposed comm':>12} {'peak GiB':>9}"
    ]
    for placement, plan in solved:
        p = plan.predicted
        compute = p.get("compute_us", 0.0) + p.get("recompute_us", 0.0)
        mark = "chosen" if placement == chosen else f"{(p['step_us'] - base_us) / 1e3:+.3f}"
        lines.append(
            f"{placement:<12} {p['step_us'] / 1e3:>9.3f} {mark:>10} {compute / 1e3:>9.3f} "
            f"{p.get('exposed_comm_us', 0.0) / 1e3:>12.3f} "
            f"{p.get('peak_bytes_per_rank', 0.0) / 2**30:>9.4f}"
        )
    lines += [
        f"{a.placement:<12} not possible: {a.infeasible}" for a in alternatives if a.plan is None
    ]
    return "\n".join(lines)
