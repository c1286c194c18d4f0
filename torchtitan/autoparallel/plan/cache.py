"""Plans cached as JSON files, keyed by everything the solver's answer depends on.

`cached_or_solved(problem, folder, solve)` returns the text of `folder/<key>.json` when that
file holds a plan this model and mesh can run (`Plan.check_applicable`), else solves,
writes the file atomically (temporary name, rename) and returns the new plan.  A file that
is truncated, impossible or edited by hand is named in a warning and replaced, never
applied (an edited plan is trained with through a plan file: plan_file.py).  The key
hashes the traced graph (its ops, the parameters' and inputs' shapes), the mesh, every
constraint (pins, budgets), the precision, the cost model and the torch version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import PlannerError
from ..graph import placements as P
from ..solve.problem import PlanningProblem
from .plan import Plan, graph_fingerprint
from .plan_file import edited_parameters

log = logging.getLogger(__name__)


def plan_key(problem: PlanningProblem, names: bool = True) -> str:
    """The cache key of `problem`'s plan.  With `names=False` the names of the mesh dims and
    of the constraints (the words of messages) are left out: the key of the program alone,
    which two meshes share when only their dims' names differ (dp_shard 4 and dp_replicate 4
    are one program: the planner places parameters itself)."""
    constraints = [
        {
            "type": type(c).__name__,
            **{
                f.name: (
                    getattr(c, f.name).name
                    if f.name == "node"
                    else P.fmt(getattr(c, f.name))
                    if f.name == "placement"
                    else getattr(c, f.name)
                )
                for f in dataclasses.fields(c)
                if names or f.name != "name"
            },
        }
        for c in problem.constraints
    ]
    blob = json.dumps(
        {
            "graph": graph_fingerprint(problem.tg.gm),  # ops only: the shapes follow
            "param_shapes": {f: list(s) for f, s in problem.model.param_shapes.items()},
            "input_shapes": [list(n.meta["val"].shape) for n in problem.tg.inputs],
            "mesh": [
                list(problem.mesh.shape),
                list(problem.mesh.mesh_dim_names or ()) if names else [],
            ],
            "constraints": constraints,
            "precision": [str(problem.param_dtype), str(problem.reduce_dtype)],
            "cost_model": repr(problem.cost_model),
            "recompute": problem.settings.recompute,
            "reshard_after_forward": str(problem.settings.reshard_after_forward),
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _usable(problem: PlanningProblem, path: Path) -> str | None:
    """The cached plan's text, or None (with a warning naming the file) when there is none
    or it cannot be applied to this model and mesh."""
    if not path.exists():
        return None
    try:
        text = path.read_text()
        shapes = {fqn: tuple(s) for fqn, s in problem.model.param_shapes.items()}
        plan = Plan.from_json(text)
        plan.check_applicable(
            shapes, list(problem.mesh.shape), list(problem.mesh.mesh_dim_names or ())
        )
        if edited := edited_parameters(plan):
            raise PlannerError(f"{edited[0]} was edited by hand")
    except (OSError, UnicodeDecodeError, PlannerError) as e:
        log.warning("cached plan %s is unusable (%s); planning again and replacing it", path, e)
        return None
    log.info("reusing cached plan %s", path)
    return text


def cached_or_solved(problem: PlanningProblem, folder: Path, solve: Callable[[], Plan]) -> str:
    path = folder / f"{plan_key(problem)}.json"
    if (text := _usable(problem, path)) is not None:
        return text
    text = solve().to_json()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # never leave a half-written plan behind
    return text


def cached_plan(
    problem: PlanningProblem, folder: str | Path | None, make: Callable[[], Plan]
) -> Plan:
    """`make()` for `problem`, through the cache in `folder` (`cached_or_solved`) when one
    is given."""
    if folder is None:
        return make()
    return Plan.from_json(cached_or_solved(problem, Path(folder), make))
