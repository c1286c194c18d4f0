"""`--autoparallel.pin`: parsing, matching against the model's parameters and mesh, the
checks made before any rank starts, and what a pin does to the plan (one process, fake
process group of 4 ranks, a 2-layer debug Llama 3 on a (dp_shard 2, tp 2) mesh)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import InfeasiblePlanError
from torchtitan.autoparallel.graph import placements as P
from torchtitan.config import ConfigManager
from torchtitan.config.validate import validate_job_config
from torchtitan.errors import UserInputError
from torchtitan.experiments.auto_parallel.parallelize import add_job_constraints, planner_for_job
from torchtitan.experiments.auto_parallel.pins import (
    PinRequest,
    match_pins,
    parse_pins,
)
from torchtitan.experiments.auto_parallel.steering import steering_checker
from torchtitan.models.llama3 import Transformer, llama3_configs
from torchtitan.torch_private import planning_mesh

FAKE_WORLD_SIZE = 4
AP_CONFIG = "torchtitan.experiments.auto_parallel.job_config"
MESH = [("dp_shard", 2), ("tp", 2)]
SHAPES = {
    "tok_embeddings.weight": (2048, 256),
    "layers.0.attention.wo.weight": (256, 256),
    "layers.1.attention.wo.weight": (256, 256),
    "layers.0.attention_norm.weight": (256,),
    "norm.weight": (256,),
}
W1 = "layers.*.feed_forward.w1.weight"


def _job(*argv: str, tp: str = "2"):
    return ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            AP_CONFIG,
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            tp,
            *argv,
        ]
    )


# ---- parsing --------------------------------------------------------------------------
def test_parse_entries_separated_by_semicolons():
    pins = parse_pins(" layers.*.attention.wo.weight = S(1),R ; norm.weight=R,R;")
    assert pins == [
        PinRequest("layers.*.attention.wo.weight", (Shard(1), Replicate())),
        PinRequest("norm.weight", (Replicate(), Replicate())),
    ]
    assert str(pins[0]) == "layers.*.attention.wo.weight=S(1),R"
    assert parse_pins("") == []


@pytest.mark.parametrize(
    "setting, message",
    [
        ("norm.weight", r"'norm.weight': expected PATTERN=PLACEMENTS"),
        ("=R,R", r"expected PATTERN=PLACEMENTS"),
        ("norm.weight=X(0),R", r"cannot parse placement 'X\(0\)'.*R, S\(dim\) per mesh dim"),
        ("norm.weight=P(sum),R", r"cannot be pinned to a partial sum"),
    ],
)
def test_malformed_entry_is_one_error(setting, message):
    with pytest.raises(UserInputError, match=message):
        parse_pins(setting)


def test_pins_with_a_mesh_left_to_the_search_are_refused():
    job = _job("--autoparallel.pin", "x=R,R", tp="auto")
    with pytest.raises(
        UserInputError, match="pins give one placement per mesh dim.*instead of auto"
    ):
        validate_job_config(job)


def test_malformed_entry_is_refused_when_the_config_is_validated():
    job = _job("--autoparallel.pin", "norm.weight")
    with pytest.raises(UserInputError, match="expected PATTERN=PLACEMENTS"):
        validate_job_config(job)


# ---- matching -------------------------------------------------------------------------
def test_a_glob_pins_every_parameter_it_matches():
    got = match_pins(parse_pins("layers.*.attention.wo.weight=S(0),S(1)"), SHAPES, MESH)
    assert got == {
        "layers.0.attention.wo.weight": (Shard(0), Shard(1)),
        "layers.1.attention.wo.weight": (Shard(0), Shard(1)),
    }


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "layers.*.attention.w0.weight=R,R",
            r"no parameter matches 'layers.\*.attention.w0.weight' "
            r"\(did you mean 'layers.0.attention.wo.weight'\?\)",
        ),
        ("norm.weight=R", r"1 placement\(s\) for a 2-D mesh \(dp_shard 2, tp 2\)"),
        ("norm.weight=R,S(1)", r"norm.weight has 1 dim\(s\) \(256,\), no dim 1"),
        (
            "norm.weight=S(0),R;norm.*=R,R",
            r"'norm.weight=S\(0\),R' and 'norm.\*=R,R' pin norm.weight two ways",
        ),
    ],
)
def test_a_pin_that_cannot_apply_is_one_error(setting, message):
    with pytest.raises(UserInputError, match=message):
        match_pins(parse_pins(setting), SHAPES, MESH)


def test_a_split_leaving_ranks_empty_is_refused():
    shapes = {"tiny.weight": (1, 256)}
    with pytest.raises(UserInputError, match=r"tiny.weight \(1, 256\) cannot be split that way"):
        match_pins(parse_pins("tiny.weight=S(0),R"), shapes, MESH)


def test_checked_before_ranks_start_against_the_real_model():
    args = llama3_configs["debugmodel"]
    dims = SimpleNamespace(dp_replicate=1, dp_shard=2, tp=2, ep=1)
    check = steering_checker(Transformer)
    check(args, dims, _job("--autoparallel.pin", f"{W1}=S(0),S(0)"))  # fine
    with pytest.raises(
        UserInputError,
        match=r"no parameter matches 'layers.\*.mlp.w1.weight' "
        r"\(did you mean 'layers.0.feed_forward.w1.weight'\?\)",
    ):
        check(args, dims, _job("--autoparallel.pin", "layers.*.mlp.w1.weight=S(0),S(0)"))


# ---- what a pin does to the plan -------------------------------------------------------
def _plan(*argv: str, n_layers: int = 2):
    job = _job("--training.seq_len", "64", "--activation_checkpoint.mode", "none", *argv)
    args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(args)
    mesh = planning_mesh("cpu", (2, 2), ("dp_shard", "tp"))
    with planner_for_job(model, mesh, job, args.vocab_size, global_batch=4) as autop:
        add_job_constraints(autop, ("dp_shard", "tp"), True, job)
        return autop.optimize_placement()


@pytest.mark.usefixtures("module_fake_world")
def test_a_pin_changes_the_plan_and_never_makes_it_cheaper():
    free = _plan()
    name = "layers.0.feed_forward.w1.weight"
    chosen = free.params[name]
    shape = free.param_shapes[name]
    # another placement holding the same share of the weight on every rank
    other = next(
        P.fmt(pl)
        for pl in P.all_placements(shape, (2, 2))
        if P.fmt(pl) != chosen and P.shard_fraction(shape, pl, (2, 2)) == 0.25
    )
    pinned = _plan("--autoparallel.pin", f"{W1}={other}")
    assert pinned.params[name] == other and pinned.params[name.replace("0", "1", 1)] == other
    # the solver proves its plans within 0.1% of the optimum
    assert pinned.predicted["step_us"] >= free.predicted["step_us"] * (1 - 2e-3)


@pytest.mark.usefixtures("module_fake_world")
def test_pins_that_clash_with_the_parameter_budget_are_named():
    with pytest.raises(
        InfeasiblePlanError,
        match=r"constraints cannot all hold: parameter memory budget .*; "
        r"parameter 'tok_embeddings.weight' pinned to R,R$",
    ):  # a whole embedding on every rank is more than the FSDP-like 1/4 of all parameters
        _plan(
            "--autoparallel.pin",
            "tok_embeddings.weight=R,R",
            "--autoparallel.max_parameter_fraction",
            "fsdp",
            n_layers=1,
        )
