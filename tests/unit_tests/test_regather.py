"""Keep or gather again per FSDP unit (regather.py), in one process on a fake 4-rank group:
what the solver chooses with and without a memory budget, what it costs and saves, that the
lowered backward gathers again exactly the units the plan says, and how plans name them.

The model is the 6-block MLP stack, 256 -> 1024 -> 256 (1 MiB weights; traced shallow: the
interior unit decides for blocks 1-4), with every parameter pinned to FSDP's Shard(0), so
each unit all-gathers its weights in the forward and the backward reads them again (a linear
layer's input gradient).  Measured
peaks against these predictions: benchmarks/memory_model.md.
"""

from __future__ import annotations

import pytest
import torch
from autoparallel_models import MLPStack
from lowered_graphs import backward_gathered_units
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from torchtitan.autoparallel import AutoParallel
from torchtitan.autoparallel.errors import PlannerError
from torchtitan.autoparallel.plan.display import plan_summary
from torchtitan.autoparallel.policies.regather import describe_units

SHAPE = (64, 16, 256)
UNITS = ["", *(f"layers.{i}" for i in range(6))]


@pytest.fixture
def dp4(fake_world):
    with fake_world(4):
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))


def planned(mesh, reshard, budget=None, run=False):
    with torch.device("meta"):
        model = MLPStack(dim=256, hidden=1024, n_layers=6)
    with AutoParallel(
        model, lambda: torch.zeros(SHAPE), mesh, cost_model="h100", reshard_after_forward=reshard
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        for fqn, _p in model.named_parameters():
            autop.add_parameter_constraint(fqn, (Shard(0),))
        if budget is not None:
            autop.add_memory_constraint(budget)
        plan = autop.optimize_placement()
        pm = autop.apply_placement(plan) if run else None
    if pm is None:
        return plan, None
    pm.to_empty(device="cpu")
    pm.init_weights()
    pm(torch.randn(SHAPE)[:16]).pow(2).mean().backward()  # lowers (fake collectives)
    (lp,) = pm._ap_executor.lowered.values()
    lp.units = pm._ap_executor.units
    return plan, lp


def test_pinned_policies_price_both_sides(dp4):
    never, _ = planned(dp4, "never")
    always, _ = planned(dp4, "always")
    assert never.regathered == dict.fromkeys(UNITS, False)
    assert always.regathered == dict.fromkeys(UNITS, True)
    # gathering again costs backward all-gathers and saves the gathered weights
    assert never.predicted["regather_us"] == 0.0
    assert always.predicted["regather_us"] > 0.0
    assert always.predicted["comm_us"] > never.predicted["comm_us"]
    assert always.predicted["peak_bytes_per_rank"] < never.predicted["peak_bytes_per_rank"]


def test_without_a_budget_every_unit_keeps(dp4):
    auto, _ = planned(dp4, "auto")
    never, _ = planned(dp4, "never")
    assert auto.regathered == dict.fromkeys(UNITS, False)
    assert auto.predicted["step_us"] == pytest.approx(never.predicted["step_us"])


def test_budget_makes_some_units_gather_again_and_the_backward_does_so(dp4):
    lo = planned(dp4, "always")[0].predicted["peak_bytes_per_rank"]
    hi = planned(dp4, "never")[0].predicted["peak_bytes_per_rank"]
    budget = lo + 0.25 * (hi - lo)
    plan, lp = planned(dp4, "auto", budget, run=True)
    again = {u for u, yes in plan.regathered.items() if yes}
    assert plan.predicted["peak_bytes_per_rank"] <= budget
    assert again and again != set(UNITS), plan.regathered
    # the interior unit decides for blocks 1-4 alike
    assert len({plan.regathered[f"layers.{i}"] for i in range(1, 5)}) == 1
    gathered = backward_gathered_units(lp.partition, lp.units)
    assert gathered and gathered <= again, (gathered, again)
    assert f"gathered parameters: {describe_units(plan.regathered)}" in plan_summary(plan)


def test_describe_units_runs():
    decisions = {"": False, **{f"layers.{i}": 0 < i < 5 for i in range(6)}}
    assert describe_units(decisions) == "layers.1-4 gather again; root, layers.0, layers.5 keep"


def test_bad_setting_is_named(dp4):
    with pytest.raises(PlannerError, match="reshard_after_forward must be .* got 'sometimes'"):
        planned(dp4, "sometimes")
