"""The trainer's default constraints: memory, not a fixed fraction of the parameters, bounds
a plan (`--autoparallel.memory_budget_gib`, else what a rank has less a margin), so the
solver replicates where memory allows and shards where it must; the FSDP-like bound is an
option (`--autoparallel.max_parameter_fraction`).  One process, fake process group of 4
ranks, the debug Llama 3 (vocabulary 2048, 2 layers) on a dp_shard 4 mesh, CPU costs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.autoparallel import InfeasiblePlanError
from torchtitan.autoparallel.cost.model import CostModel, Estimator
from torchtitan.config import ConfigManager
from torchtitan.config.manager import ConfigError
from torchtitan.experiments.auto_parallel.memory_check import memory_per_rank
from torchtitan.experiments.auto_parallel.parallelize import (
    MEMORY_MARGIN,
    add_job_constraints,
    memory_budget_bytes,
    planner_error,
    planner_for_job,
)
from torchtitan.models.llama3 import Transformer, llama3_configs
from torchtitan.torch_private import planning_mesh

FAKE_WORLD_SIZE = 4
AP_CONFIG = "torchtitan.experiments.auto_parallel.job_config"
NAMES = ("dp_shard",)


def _job(*argv: str):
    return ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            AP_CONFIG,
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--training.seq_len",
            "64",
            "--autoparallel.cost_model",
            "cpu",
            "--activation_checkpoint.mode",
            "none",
            *argv,
        ]
    )


def _plan(*argv: str, memory_share: int = 1, in_flight: float = 1.0):
    job = _job(*argv)
    args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=2, vocab_size=2048)
    with torch.device("meta"):
        model = Transformer(args)
    mesh = planning_mesh("cpu", (4,), NAMES)
    with planner_for_job(model, mesh, job, args.vocab_size, global_batch=8) as autop:
        add_job_constraints(autop, NAMES, False, job, memory_share, in_flight)
        return autop.optimize_placement()


def test_the_default_budget_is_what_a_rank_has_less_the_margin():
    available, source = memory_per_rank()
    assert memory_budget_bytes(_job()) == pytest.approx(available * (1 - MEMORY_MARGIN))
    assert "RAM" in source  # no GPU here: the machine's RAM shared by the ranks
    assert memory_budget_bytes(_job("--autoparallel.memory_budget_gib", "1.5")) == 1.5 * 2**30


@pytest.mark.usefixtures("module_fake_world")
def test_with_memory_to_spare_the_plan_replicates_and_only_reduces_gradients():
    plan = _plan()
    assert set(plan.params.values()) == {"R"}, plan.params  # DDP-like
    # its one communication: each gradient all-reduced once (bucketed: bandwidth only)
    link = CostModel.for_device("cpu").mesh_links([4])[0]
    param_bytes = plan.predicted["param_bytes_per_rank"]
    all_reduce_us = 2 * 0.75 * param_bytes / (link.bw_gbps * 1e3)
    assert plan.predicted["comm_us"] == pytest.approx(all_reduce_us, rel=1e-6)


@pytest.mark.usefixtures("module_fake_world")
def test_a_budget_replication_does_not_fit_makes_the_plan_shard():
    free = _plan()
    budget = 0.8 * free.predicted["peak_bytes_per_rank"]
    tight = _plan("--autoparallel.memory_budget_gib", str(budget / 2**30))
    assert tight.predicted["peak_bytes_per_rank"] <= budget * (1 + 1e-6)
    assert tight.predicted["param_fraction"] < 1.0
    assert any(pl.startswith("S(") for pl in tight.params.values())


@pytest.mark.usefixtures("module_fake_world")
def test_two_pipeline_stages_on_a_rank_share_its_budget():
    """A budget replication fits in, shared by the two stages a rank of an interleaved
    schedule holds, makes each stage's plan shard."""
    free = _plan()
    budget = 1.5 * free.predicted["peak_bytes_per_rank"]
    alone = _plan("--autoparallel.memory_budget_gib", str(budget / 2**30))
    assert set(alone.params.values()) == {"R"}
    shared = _plan("--autoparallel.memory_budget_gib", str(budget / 2**30), memory_share=2)
    assert shared.predicted["peak_bytes_per_rank"] <= budget / 2 * (1 + 1e-6)
    assert any(pl.startswith("S(") for pl in shared.params.values())


@pytest.mark.usefixtures("module_fake_world")
def test_a_stage_plan_fits_with_the_microbatches_its_schedule_keeps_in_flight():
    """The replicated plan fits one microbatch's activations; with four in flight (a first
    1F1B stage of four) the extra three do not fit beside it, so the solver, whose memory
    rows hold them, shards and fits with all four."""
    free = _plan()
    one, saved = (
        free.predicted["peak_bytes_per_rank"],
        free.predicted["saved_at_boundary_bytes_per_rank"],
    )
    budget = one + 1.5 * saved
    alone = _plan("--autoparallel.memory_budget_gib", str(budget / 2**30))
    assert set(alone.params.values()) == {"R"}
    held = _plan("--autoparallel.memory_budget_gib", str(budget / 2**30), in_flight=4)
    p = held.predicted
    assert p["in_flight_peak_bytes_per_rank"] == pytest.approx(
        p["peak_bytes_per_rank"] + 3 * p["saved_at_boundary_bytes_per_rank"]
    )
    assert p["in_flight_peak_bytes_per_rank"] <= budget * (1 + 1e-6)
    assert any(pl.startswith("S(") for pl in held.params.values())


@pytest.mark.usefixtures("module_fake_world")
def test_microbatches_in_flight_no_plan_can_hold_are_one_line():
    free = _plan()
    budget = free.predicted["saved_at_boundary_bytes_per_rank"] * 10
    with pytest.raises(InfeasiblePlanError) as e:
        _plan("--autoparallel.memory_budget_gib", str(budget / 2**30), in_flight=100)
    assert "(100 microbatches' activations in flight)" in str(e.value)
    assert "the least memory any plan needs under the other constraints is" in str(e.value)


@pytest.mark.usefixtures("module_fake_world")
def test_the_fsdp_parameter_fraction_is_an_option():
    fsdp = _plan("--autoparallel.max_parameter_fraction", "fsdp")
    assert fsdp.predicted["param_fraction"] == pytest.approx(0.25, rel=1e-3)
    half = _plan("--autoparallel.max_parameter_fraction", "0.5")
    assert 0.25 < half.predicted["param_fraction"] <= 0.5 + 1e-6


@pytest.mark.parametrize("value", ["2", "0", "-0.5", "ddp", "nan"])
def test_a_bad_parameter_fraction_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        _job("--autoparallel.max_parameter_fraction", value).autoparallel.validate(None)
    assert str(e.value) == (
        f"--autoparallel.max_parameter_fraction: {value!r} is not none, fsdp or a number in (0, 1]"
    )


def test_a_plan_that_fits_no_rank_says_where_the_budget_comes_from_and_what_lowers_it():
    e = InfeasiblePlanError(
        "constraints cannot all hold: memory budget 5.4 GiB per rank (the least memory any "
        "plan needs under the other constraints is 9.1 GiB per rank)"
    )
    line = str(planner_error(e, _job()))
    available, source = memory_per_rank()
    assert line == (
        f"auto-parallel planner: {e}; the budget is what a rank has, "
        f"{available / 2**30:.1f} GiB ({source}), less 10%: lower the need with "
        "--activation_checkpoint.mode auto (the planner recomputes blocks to fit) or full, "
        "more ranks, or a smaller --training.local_batch_size or --training.seq_len"
    )
    # a budget the user gave is theirs to change: the solver's line is enough
    given = _job("--autoparallel.memory_budget_gib", "5.4")
    assert str(planner_error(e, given)) == f"auto-parallel planner: {e}"


def test_a_bucketed_collective_is_not_charged_the_links_latency():
    from torch.distributed.tensor import Partial, Replicate

    est = Estimator(CostModel.for_device("cpu"), [4])
    link = CostModel.for_device("cpu").mesh_links([4])[0]
    alone = est.comm_us((Partial(),), (Replicate(),), (256, 256), 4)
    bucketed = est.comm_us((Partial(),), (Replicate(),), (256, 256), 4, bucketed=True)
    assert alone - bucketed == pytest.approx(2 * link.latency_us)  # an all-reduce: two phases
