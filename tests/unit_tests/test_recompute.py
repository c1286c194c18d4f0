"""Activation recomputation in one process on a fake process group: what each policy keeps
(the memory model and the lowered graphs agree), where the backward recomputes, the solver's
choice under a budget, the error for a budget nothing fits, and the trainer's mapping of
`[activation_checkpoint]`.

The numbers are the MLP stack's (5 blocks of Linear 32->64, GELU, Linear 64->32 inside a
residual `x + block(x)`, a head; input 8x16x32 fp32 on one rank): without recomputation each
block keeps its first Linear's and its GELU's outputs (32 KiB each); every residual sum feeding
the next block or the head (16 KiB) and the output (16 KiB) are kept too.  Full recomputation
keeps only those; selective also keeps each first Linear's output (a matmul).
The numerics of recomputing plans on 4 ranks: integration_tests/test_autoparallel_numerics.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from autoparallel_models import MLPStack
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from torchtitan.autoparallel import AutoParallel
from torchtitan.autoparallel.errors import InfeasiblePlanError, PlannerError
from torchtitan.autoparallel.policies.recompute import (
    block_label,
    describe_policies,
    kept_by_selective,
)
from torchtitan.autoparallel.trace.repeat import RepeatedBlocks
from torchtitan.errors import UserInputError

KiB = 1024
SHAPE = (8, 16, 32)


@pytest.fixture
def one_rank(fake_world):
    with fake_world(1):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def planned(mesh, recompute="none", budget=None, run=False):
    with torch.device("meta"):
        model = MLPStack(n_layers=5)
    with AutoParallel(
        model, lambda: torch.zeros(SHAPE), mesh, cost_model="cpu", recompute=recompute
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        if budget is not None:
            autop.add_memory_constraint(budget)
        plan = autop.optimize_placement()
        pm = autop.apply_placement(plan) if run else None
    if pm is None:
        return plan, None
    pm.to_empty(device="cpu")
    pm.init_weights()
    pm(torch.randn(SHAPE)).pow(2).mean().backward()
    (lp,) = pm._ap_executor.lowered.values()
    return plan, lp


def saved_by_block(lp) -> dict[str, list]:
    outs = next(n for n in lp.partition.fwd.graph.nodes if n.op == "output").args[0]
    kept: dict[str, list] = {}
    for n in outs[lp.n_out :]:
        kept.setdefault(block_label(n), []).append(n)
    return kept


@pytest.mark.parametrize(
    "policy, saved_kib",
    [("none", 5 * 64 + 5 * 16 + 16), ("full", 5 * 16 + 16), ("selective", 5 * 32 + 5 * 16 + 16)],
)
def test_saved_bytes_per_policy(one_rank, policy, saved_kib):
    plan, _ = planned(one_rank, policy)
    assert plan.predicted["saved_at_boundary_bytes_per_rank"] == saved_kib * KiB
    if policy != "none":
        assert describe_policies(plan.recompute) == f"layers#0-4 {policy}"


def test_lowered_forward_keeps_what_the_policy_keeps(one_rank):
    _plan, lp = planned(one_rank, {"layers#0": "full", "layers#2": "selective"}, run=True)
    kept = saved_by_block(lp)
    # the residual sums are outside the blocks, so a block's own output is never read later
    assert "layers#0" not in kept  # full: nothing
    assert [kept_by_selective(n) for n in kept["layers#2"]] == [True]  # the first Linear
    # none: views of its input (the residual sum, which the eager graph writes into its
    # dying operand: execute/in_place.py), of the first Linear's and of the GELU's outputs
    assert [n.args[0].target for n in kept["layers#1"]] == [
        torch.ops.aten.add_.Tensor,
        torch.ops.aten.addmm.default,
        torch.ops.aten.gelu.default,
    ]
    assert lp.partition.bwd.graph.find_nodes(op="call_function", target=torch.ops.aten.gelu.default)


def test_backward_recomputes_each_block_when_it_reaches_it(one_rank):
    _plan, lp = planned(one_rank, "full", run=True)
    first = {}
    for i, n in enumerate(lp.partition.bwd.graph.nodes):
        if n.target is torch.ops.aten.gelu.default:  # a recomputed forward op
            first.setdefault(block_label(n), i)
    order = [first[f"layers#{i}"] for i in range(5)]
    assert order == sorted(order, reverse=True), order  # last block first, as the backward


def test_solver_recomputes_to_fit_a_budget_and_the_step_pays_for_it(one_rank):
    none, _ = planned(one_rank, "auto")
    full, _ = planned(one_rank, "full")
    assert none.recompute and set(none.recompute.values()) == {"none"}
    budget = (none.predicted["peak_bytes_per_rank"] + full.predicted["peak_bytes_per_rank"]) / 2
    mid, _ = planned(one_rank, "auto", budget=budget)
    assert mid.predicted["peak_bytes_per_rank"] <= budget
    assert {"none"} < set(mid.recompute.values()) | {"none"}
    assert none.predicted["recompute_us"] == 0
    assert 0 < mid.predicted["recompute_us"] <= full.predicted["recompute_us"]
    assert none.predicted["step_us"] < mid.predicted["step_us"] <= full.predicted["step_us"]


def test_budget_nothing_fits_names_the_smallest_that_would(one_rank):
    full, _ = planned(one_rank, "full")
    with pytest.raises(InfeasiblePlanError) as e:
        planned(one_rank, "auto", budget=full.predicted["peak_bytes_per_rank"] / 2)
    need = full.predicted["peak_bytes_per_rank"] / 2**30
    assert f"the least memory any plan needs under the other constraints is {need:.4g} GiB" in (
        str(e.value)
    )


def test_a_stack_too_short_to_find_recomputes_when_its_container_is_named(one_rank):
    """Two blocks are no stack the planner finds by itself (a pipeline stage's share of a
    model's blocks): full recompute is refused, unless the container is named as holding
    blocks; then both blocks recompute and save what a full block saves."""

    def plan(recompute, containers=()):
        with torch.device("meta"):
            model = MLPStack(n_layers=2)
        with AutoParallel(
            model,
            lambda: torch.zeros(SHAPE),
            one_rank,
            cost_model="cpu",
            recompute=recompute,
            block_containers=containers,
        ) as autop:
            autop.add_input_constraints([(Shard(0),)])
            return autop.optimize_placement()

    with pytest.raises(PlannerError, match="no stack of 4 or more identical blocks"):
        plan("full")
    full, none = plan("full", ("layers",)), plan("none", ("layers",))
    assert describe_policies(full.recompute) == "layers#0-1 full"
    saved = full.predicted["saved_at_boundary_bytes_per_rank"]
    assert saved == (2 * 16 + 16) * KiB  # as each of 5 blocks saves in test_saved_bytes_per_policy
    assert none.predicted["saved_at_boundary_bytes_per_rank"] == (2 * 64 + 2 * 16 + 16) * KiB


def test_unknown_policy_and_block_are_named(one_rank):
    with pytest.raises(PlannerError, match="unknown activation recompute policy 'most'"):
        planned(one_rank, "most")
    with pytest.raises(PlannerError, match="names block 'layers#9'"):
        planned(one_rank, {"layers#9": "full"})


# the trainer's [activation_checkpoint] for the auto-parallel specs
def job(*args, model="llama3_auto_parallel"):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--model.name", model, *args])


STACK = SimpleNamespace(blocks=[RepeatedBlocks("layers", tuple(map(str, range(6))), False)])


def test_activation_checkpoint_modes_map_to_recompute_settings():
    from torchtitan.experiments.auto_parallel.parallelize import job_recompute

    assert job_recompute(job("--activation_checkpoint.mode", "none"), STACK) == "none"
    assert job_recompute(job("--activation_checkpoint.mode", "full"), STACK) == "full"
    assert job_recompute(job("--activation_checkpoint.mode", "auto"), STACK) == "auto"
    op = job(
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    )
    assert job_recompute(op, STACK) == "selective"
    every2 = job(
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    )
    assert job_recompute(every2, STACK) == {f"layers#{i}": "full" for i in (0, 2, 4)}
    bad = job(
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "x",
    )
    with pytest.raises(UserInputError, match="selective_ac_option 'x': use 'op' or a positive"):
        job_recompute(bad, STACK)
    # every Nth block of no stack would silently recompute nothing
    with pytest.raises(
        UserInputError,
        match=r"selective_ac_option 2: recomputes every Nth block of a stack of repeated blocks, "
        r"and the planner found none in this model \(a stack is 4 or more",
    ):
        job_recompute(every2, SimpleNamespace(blocks=[]))


def test_hand_written_llama3_refuses_auto():
    from torchtitan.models.llama3.parallelize import parallelize_llama

    cfg = job("--activation_checkpoint.mode", "auto", model="llama3")
    with pytest.raises(UserInputError, match="mode auto: only the auto-parallel models"):
        parallelize_llama(None, SimpleNamespace(tp_enabled=False), cfg)
    cfg = job("--parallelism.fsdp_reshard_after_forward", "auto", model="llama3")
    with pytest.raises(UserInputError, match="reshard_after_forward auto: only the auto-parallel"):
        parallelize_llama(None, SimpleNamespace(tp_enabled=False), cfg)
