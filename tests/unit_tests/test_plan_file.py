"""`AutoParallel.plan_from_file` (`--autoparallel.plan_file`, plan/plan_file.py): a plan
file made for this job is applied as written, an edited one is solved again around the
file's parameter placements, and a file made for another mesh, model, graph or constraint
is refused naming the first difference.  One process, fake process group of 4 ranks, a
SwiGLU MLP on a (dp 2, tp 2) mesh."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import AutoParallel, Plan, PlannerError
from torchtitan.autoparallel.graph import placements as P
from torchtitan.autoparallel.plan.cache import cached_or_solved

FAKE_WORLD_SIZE = 4
pytestmark = pytest.mark.usefixtures("module_fake_world")
BATCH = (Shard(0), Replicate())


class SwiGLU(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64, act=F.silu):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def _planner(mesh_shape=(2, 2), names=("dp", "tp"), **model_args) -> AutoParallel:
    with torch.device("meta"):
        model = SwiGLU(**model_args)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    return AutoParallel(model, lambda: torch.randn(8, 16, 32), mesh, cost_model="h100")


def _constrain(autop: AutoParallel, batch=BATCH) -> None:
    autop.clear_constraints()
    autop.add_parameter_memory_constraint(high=None)
    autop.add_input_constraints([batch])
    autop.add_output_constraints([batch])


@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> tuple[Plan, object]:
    """The plan of the default job, saved as a file."""
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    with _planner() as autop:
        _constrain(autop)
        plan = autop.optimize_placement()
    plan.save(path)
    return plan, path


def _from_file(path, autop_args=None, batch=BATCH) -> Plan:
    with _planner(**(autop_args or {})) as autop:
        _constrain(autop, batch)
        return autop.plan_from_file(path)


def test_an_unedited_plan_file_is_applied_as_written(solved, caplog):
    plan, path = solved
    assert plan.params == plan.grads  # what marks a plan as unedited
    with caplog.at_level(logging.INFO, logger="torchtitan.autoparallel.api"):
        loaded = _from_file(path)
    assert loaded.to_json() == plan.to_json()
    assert "applied as written" in caplog.text


def test_an_edited_plan_file_is_solved_again_around_its_parameters(solved, tmp_path, caplog):
    plan, path = solved
    data = json.loads(path.read_text())
    shape = plan.param_shapes["w2.weight"]
    other = next(
        P.fmt(pl)
        for pl in P.all_placements(shape, (2, 2))
        if P.fmt(pl) != plan.params["w2.weight"] and all(isinstance(p, Shard) for p in pl)
    )
    data["params"]["w2.weight"] = other
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="torchtitan.autoparallel.api"):
        replanned = _from_file(edited)
    assert "1 parameter placement(s) edited (w2.weight, ...)" in caplog.text
    assert replanned.params == {**plan.params, "w2.weight": other} == replanned.grads
    with _planner() as autop:  # the same as pinning the file's placements by hand
        _constrain(autop)
        for fqn, text in replanned.params.items():
            autop.add_parameter_constraint(fqn, P.parse(text))
        pinned = autop.optimize_placement()
    assert replanned.predicted["step_us"] == pytest.approx(pinned.predicted["step_us"])
    assert replanned.predicted["step_us"] >= plan.predicted["step_us"] * (1 - 1e-3)


@pytest.mark.parametrize(
    "job, message",
    [
        (
            {"autop_args": {"mesh_shape": (4,), "names": ("dp",)}, "batch": (Shard(0),)},
            "made for mesh [2, 2] ['dp', 'tp'], not [4] ['dp']",
        ),
        ({"autop_args": {"hidden": 48}}, "made for w1.weight of shape [64, 32], not [48, 32]"),
        (
            {"autop_args": {"act": F.gelu}},
            "made for another traced graph: its op 5 is silu (aten.silu.default), this "
            "model's is gelu (aten.gelu.default)",
        ),
        (
            {"batch": (Replicate(), Replicate())},
            "it places input 0 as S(0),R, and this job needs R,R",
        ),
    ],
    ids=["mesh", "shape", "graph", "input"],
)
def test_a_plan_file_for_another_job_names_the_first_difference(solved, job, message):
    _, path = solved
    with pytest.raises(PlannerError) as err:
        _from_file(path, **job)
    assert str(err.value) == (
        f"plan file {str(path)!r} does not fit this job: {message}; plan again for it "
        "(scripts/plan.py, or a run without a plan file) or fix the file"
    )


def test_a_file_that_is_not_a_plan_is_named(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text("{ half")
    with pytest.raises(PlannerError, match=r"plan file '.*notes.json': not a plan"):
        _from_file(path)
    with pytest.raises(PlannerError, match=r"plan file '.*absent.json': cannot be read"):
        _from_file(tmp_path / "absent.json")


def test_the_plan_cache_replaces_a_plan_edited_in_place(solved, tmp_path, caplog):
    plan, _ = solved
    with _planner() as autop:
        _constrain(autop)
        problem = autop.problem()
        cached = cached_or_solved(problem, tmp_path, lambda: plan)
        (path,) = tmp_path.glob("*.json")
        data = json.loads(cached)
        data["params"]["w1.weight"] = "R,R"
        path.write_text(json.dumps(data))
        with caplog.at_level(logging.WARNING):
            again = cached_or_solved(problem, tmp_path, lambda: plan)
    assert "w1.weight was edited by hand" in caplog.text
    assert again == plan.to_json() == path.read_text()


# ---- the trainer's option, checked before any rank starts ------------------------------
def _job(*argv: str, tp: str = "2"):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "torchtitan.experiments.auto_parallel.job_config",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            tp,
            *argv,
        ]
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--autoparallel.plan_file", "{plan}"],
            "--autoparallel.plan_file: a plan is made for one mesh; give every --parallelism "
            "degree instead of auto (or drop the plan file)",
        ),
        (
            ["--autoparallel.plan_file", "{plan}", "--autoparallel.pin", "w1.weight=R,R"],
            "--autoparallel.plan_file and --autoparallel.pin: a plan file places every "
            "parameter already; edit its params instead of pinning",
        ),
        (
            ["--autoparallel.plan_file", "{absent}"],
            "--autoparallel.plan_file: plan file '{absent}': cannot be read",
        ),
    ],
    ids=["auto-mesh", "with-pins", "absent"],
)
def test_the_option_is_refused_when_the_config_is_validated(solved, tmp_path, argv, message):
    from torchtitan.config.validate import validate_job_config
    from torchtitan.errors import UserInputError

    where = {"plan": str(solved[1]), "absent": str(tmp_path / "absent.json")}
    job = _job(*(a.format(**where) for a in argv), tp="auto" if "mesh" in message else "2")
    with pytest.raises(UserInputError) as err:
        validate_job_config(job)
    assert str(err.value).startswith(message.format(**where))


def test_checked_against_the_model_and_mesh_before_ranks_start(solved):
    from types import SimpleNamespace

    from torchtitan.errors import UserInputError
    from torchtitan.experiments.auto_parallel.steering import steering_checker

    plan, path = solved
    check = steering_checker(lambda args: SwiGLU(**args))
    on_2x2 = SimpleNamespace(dp_replicate=1, dp_shard=2, tp=2, ep=1)
    fine = json.loads(path.read_text())
    fine["mesh_dim_names"] = ["dp_shard", "tp"]  # the trainer's names for this mesh
    path.with_name("trainer.json").write_text(json.dumps(fine))
    trainer_plan = str(path.with_name("trainer.json"))
    check({}, on_2x2, _job("--autoparallel.plan_file", trainer_plan))
    with pytest.raises(UserInputError) as err:
        check({"hidden": 48}, on_2x2, _job("--autoparallel.plan_file", trainer_plan))
    assert str(err.value) == (
        f"--autoparallel.plan_file {trainer_plan!r} does not fit this job: made for w1.weight "
        "of shape [64, 32], not [48, 32]; plan again for it (scripts/plan.py, or a run "
        "without a plan file) or fix the file"
    )
