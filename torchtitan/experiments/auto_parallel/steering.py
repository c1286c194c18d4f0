"""The user's word on the plan, checked before any rank starts: `--autoparallel.pin`
(pins.py) and `--autoparallel.plan_file` (a plan to train with; the library's
plan/plan_file.py checks it against the traced graph once the ranks have traced it).

Here, on the meta-device model and the mesh the degrees make: the pins match parameters
and fit the mesh, and the plan file is a readable plan for this mesh and these parameters
(names and shapes).  Each problem is one error line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchtitan.autoparallel import Plan, PlannerError
from torchtitan.distributed.parallel_dims import mesh_dims
from torchtitan.errors import UserInputError
from torchtitan.experiments.auto_parallel.pins import job_pins, match_pins

PLAN_FILE = "--autoparallel.plan_file"


def read_plan_file(path: str) -> Plan:
    """The plan in file `path`, or a `UserInputError` naming it."""
    from torchtitan.autoparallel.plan.plan_file import parse_plan_file, read_plan_text

    try:
        return parse_plan_file(read_plan_text(path), path)
    except PlannerError as e:
        raise UserInputError(f"{PLAN_FILE}: {e}") from None


def job_plan_file(job_config: Any) -> str:
    """The job's `--autoparallel.plan_file` ("" without one or without the section)."""
    section = getattr(job_config, "autoparallel", None)
    return getattr(section, "plan_file", "") or ""


def steering_checker(model_cls: Callable[[Any], torch.nn.Module]) -> Callable[..., None]:
    """A `TrainSpec.check_parallelism_fn` that checks the job's pins and plan file against
    the model's parameters (built on the meta device) and the mesh the degrees make."""

    def check(model_args: Any, dims: Any, job_config: Any) -> None:
        requests, path = job_pins(job_config), job_plan_file(job_config)
        if not requests and not path:
            return
        with torch.device("meta"):
            model = model_cls(model_args)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        mesh = mesh_dims(dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep)
        match_pins(requests, shapes, mesh)
        if path:
            try:
                read_plan_file(path).check_applicable(
                    shapes, [size for _, size in mesh], [name for name, _ in mesh]
                )
            except PlannerError as e:
                raise UserInputError(
                    f"{PLAN_FILE} {path!r} does not fit this job: {e}; plan again for it "
                    "(scripts/plan.py, or a run without a plan file) or fix the file"
                ) from None

    return check
