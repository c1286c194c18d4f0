"""A plan handed in as a file: checked against the model, mesh and constraints it is to run.

A plan written by `scripts/plan.py` (`plan.json`) or by an earlier run (its plan cache,
`{dump_folder}/plans/<key>.json`) can be reviewed, versioned and edited like code, then
trained with (`AutoParallel.plan_from_file`, `--autoparallel.plan_file`).  Before it is
used, `check_plan_file` compares it with what this job traced, and the first difference is
one `PlannerError` line naming the file:

- the mesh (shape and dim names),
- the parameters (the same names and shapes),
- the traced graph (the same ops in the same order; the first node that differs),
- the inputs and outputs (placed as this job's constraints require: the batch split over
  the data-parallel dims, the logits as the loss expects them).

The part of a plan meant for editing is `params`: one placement per parameter.  A solved
plan places each parameter's gradient as the parameter itself (`grads`), so a parameter
whose `params` entry no longer equals its `grads` entry was edited (`edited_parameters`).
An unedited plan is applied exactly as written; an edited one is solved again with every
parameter pinned where the file puts it, the planner placing the activations around them.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PlannerError
from ..graph import placements as P
from ..solve.constraints import OutputPin, Pin
from ..solve.problem import PlanningProblem
from .plan import Plan, graph_fingerprint


def read_plan_text(path: str | Path) -> str:
    """The text of plan file `path`, or a `PlannerError` naming it."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlannerError(f"plan file {str(path)!r}: cannot be read ({e})") from None


def parse_plan_file(text: str, path: str | Path) -> Plan:
    """The plan in `text` (read from `path`), or a `PlannerError` naming the file."""
    try:
        return Plan.from_json(text)
    except PlannerError as e:
        raise PlannerError(f"plan file {str(path)!r}: {e}") from None


def check_plan_file(plan: Plan, problem: PlanningProblem, path: str | Path) -> None:
    """Raise a `PlannerError` naming `path` and the first difference unless `plan` was made
    for `problem`'s mesh, parameters and traced graph and meets its input and output pins."""
    try:
        shapes = {fqn: tuple(s) for fqn, s in problem.model.param_shapes.items()}
        mesh = problem.mesh
        plan.check_applicable(shapes, list(mesh.shape), list(mesh.mesh_dim_names or ()))
        _check_graph(plan, problem)
        _check_pins(plan, problem)
    except PlannerError as e:
        raise PlannerError(
            f"plan file {str(path)!r} does not fit this job: {e}; plan again for it "
            "(scripts/plan.py, or a run without a plan file) or fix the file"
        ) from None


def edited_parameters(plan: Plan) -> list[str]:
    """The parameters whose `params` entry differs from their gradient's placement (which
    the solver always makes equal): the ones edited by hand."""
    return [fqn for fqn, pl in plan.params.items() if plan.grads.get(fqn, pl) != pl]


def _check_graph(plan: Plan, problem: PlanningProblem) -> None:
    gm = problem.tg.gm
    if not plan.graph_fingerprint or plan.graph_fingerprint == graph_fingerprint(gm):
        return
    ours = [(n.name, str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
    theirs = [(name, str(entry.get("op"))) for name, entry in plan.nodes.items()]
    for i, (mine, its) in enumerate(zip(ours, theirs)):
        if mine != its:
            raise PlannerError(
                f"made for another traced graph: its op {i + 1} is {its[0]} ({its[1]}), this "
                f"model's is {mine[0]} ({mine[1]})"
            )
    if len(ours) != len(theirs):
        raise PlannerError(
            f"made for another traced graph: it places {len(theirs)} ops, this model "
            f"traces {len(ours)}"
        )
    raise PlannerError("made for another traced graph (its inputs or outputs differ)")


def _check_pins(plan: Plan, problem: PlanningProblem) -> None:
    """The plan's inputs, outputs and parameters where this job's pins put them."""
    inputs = {node: i for i, node in enumerate(problem.tg.inputs)}
    traced_params = {node: name for name, node in problem.tg.params.items()}
    for c in problem.constraints:
        want = P.fmt(c.placement) if isinstance(c, (Pin, OutputPin)) else None
        if isinstance(c, OutputPin):
            have, what = _at(plan.outputs, c.index), f"output {c.index}"
        elif isinstance(c, Pin) and c.node in inputs:
            i = inputs[c.node]
            have, what = _at(plan.inputs, i), f"input {i}"
        elif isinstance(c, Pin) and c.node in traced_params:
            traced = traced_params[c.node]
            fqns = [f for f in plan.params if problem.traced_name(f) == traced]
            wrong = [f for f in fqns if plan.params[f] != want]
            have, what = (plan.params[wrong[0]], wrong[0]) if wrong else (want, "")
        else:
            continue
        if have != want:
            raise PlannerError(f"it places {what} as {have}, and this job needs {want}")


def _at(items: list[str], i: int) -> str | None:
    return items[i] if i < len(items) else None
