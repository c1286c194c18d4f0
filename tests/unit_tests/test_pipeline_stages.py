"""`torchtitan.distributed.pipeline`: how the blocks split into stages and which rank
holds which, each bad setting by its message, and that stages cut from a model and
initialised through `whole_model` hold exactly one process's values and compute, chained,
the whole model's logits.  One process, no process group."""

from __future__ import annotations

import pytest
import torch

from torchtitan.distributed.pipeline import (
    PipelineSplit,
    StageCosts,
    StageMemory,
    plan_stages,
    split_stages,
)
from torchtitan.errors import UserInputError
from torchtitan.exact_init import exact_sharded_init
from torchtitan.models.llama3 import Transformer, llama3_configs

ARGS = llama3_configs["debugmodel"]  # 6 blocks
SPLIT = PipelineSplit(first=("tok_embeddings",), blocks="layers", last=("norm", "output"))


def _plan(pp: int, schedule: str, per: int | None = None, batch: int = 4, micro: int = 1):
    return plan_stages(6, pp, schedule, per, batch, micro, "llama3 debugmodel")


@pytest.mark.parametrize(
    "pp, schedule, points, blocks",
    [
        (2, "1F1B", [2], [[0, 1], [2, 3, 4, 5]]),
        (2, "Interleaved1F1B", [1, 3, 5], [[0], [1, 2], [3, 4], [5]]),
    ],
)
def test_split_points_start_stages_where_given(pp, schedule, points, blocks):
    plan = plan_stages(6, pp, schedule, None, 4, 1, "llama3 debugmodel", points)
    assert plan.blocks == blocks


@pytest.mark.parametrize(
    "points, per, message",
    [
        ([3, 2], None, "split_points 3,2: must increase strictly, each between 1 and 5"),
        ([6], None, "split_points 6: must increase strictly"),
        ([2, 4], None, "split_points 2,4: makes 3 stages, and 1F1B on 2 ranks runs 2"),
        ([3], 3, "split_points 3: give split points or layers per stage, not both"),
    ],
)
def test_bad_split_points_are_one_error(points, per, message):
    with pytest.raises(UserInputError, match=message):
        plan_stages(6, 2, "1F1B", per, 4, 1, "llama3 debugmodel", points)


@pytest.mark.parametrize(
    "pp, schedule, per, blocks, held",
    [
        (2, "1F1B", None, [[0, 1, 2], [3, 4, 5]], [[0], [1]]),
        (4, "GPipe", None, [[0], [1, 2], [3, 4], [5]], [[0], [1], [2], [3]]),
        (2, "Interleaved1F1B", None, [[0], [1, 2], [3, 4], [5]], [[0, 2], [1, 3]]),
        (2, "ZBVZeroBubble", None, [[0], [1, 2], [3, 4], [5]], [[0, 3], [1, 2]]),
        (2, "Interleaved1F1B", 1, [[i] for i in range(6)], [[0, 2, 4], [1, 3, 5]]),
    ],
)
def test_blocks_split_into_stages_and_ranks_hold_them(pp, schedule, per, blocks, held):
    plan = _plan(pp, schedule, per)
    assert plan.blocks == blocks and plan.microbatches == 4
    assert [plan.stages_of(r, pp) for r in range(pp)] == held


@pytest.mark.parametrize(
    "blocks, pp, schedule, per, batch, micro, message",
    [
        (6, 2, "Zigzag", None, 4, 1, "no such schedule in torch.distributed.pipelining"),
        (6, 2, "PipelineScheduleMulti", None, 4, 1, "'PipelineScheduleMulti' is an abstract"),
        (6, 2, "1F1B", None, 4, 3, "microbatch_size 3: must divide the local batch size 4"),
        (6, 2, "1F1B", 4, 4, 1, "layers_per_stage 4: must divide the 6 blocks of llama3"),
        (6, 2, "1F1B", 1, 4, 1, "makes 6 stages, and 1F1B on 2 ranks runs 2 (one per rank"),
        (6, 2, "ZBVZeroBubble", 1, 4, 1, "makes 6 stages, and ZBVZeroBubble runs exactly two"),
        (6, 8, "GPipe", None, 4, 1, "GPipe runs 8 stages on 8 ranks, and llama3 debugmodel has 6"),
        (16, 4, "Interleaved1F1B", None, 2, 1, "needs a number of microbatches that 4 divides"),
    ],
)
def test_each_bad_setting_is_one_error(blocks, pp, schedule, per, batch, micro, message):
    with pytest.raises(UserInputError, match=message.replace("(", r"\(")):
        plan_stages(blocks, pp, schedule, per, batch, micro, "llama3 debugmodel")


def _one_process() -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_stages_hold_one_process_values_and_chain_to_its_logits(schedule):
    whole = _one_process()
    plan = _plan(2, schedule)
    parts = {}
    for rank in range(2):
        with torch.device("meta"):
            model = Transformer(ARGS)
        stages = split_stages(model, SPLIT, plan, rank, 2)
        for i, (stage_id, part) in enumerate(zip(stages.stage_ids, stages.parts)):
            part.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad(), stages.whole_model(i, torch.device("cpu")) as m:
                with exact_sharded_init(m):
                    m.init_weights()
            assert all(
                p.device.type == "meta"
                for r in stages.removed
                for b in r.blocks.values()
                for p in b.parameters()
            )
            parts[stage_id] = part
    expected = whole.state_dict()
    for part in parts.values():
        for name, value in part.state_dict().items():
            assert torch.equal(value, expected[name]), name
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    h = tokens
    for stage_id in sorted(parts):
        h = parts[stage_id](h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)


def _stage_times(plan, costs: StageCosts) -> list[float]:
    return [
        len(b) * costs.block
        + (costs.first if s == 0 else 0)
        + (costs.last if s == len(plan.blocks) - 1 else 0)
        for s, b in enumerate(plan.blocks)
    ]


@pytest.mark.parametrize(
    "n, pp, costs, sizes",
    [
        (6, 4, StageCosts(0.0, 1.0, 0.0), [1, 2, 2, 1]),  # nothing around the blocks: even
        (32, 8, StageCosts(0.16, 1.0, 1.76), [4, 4, 4, 4, 5, 4, 4, 3]),  # a big output layer
        (8, 4, StageCosts(2.0, 1.0, 0.0), [1, 2, 3, 2]),  # a costly first stage
    ],
)
def test_stages_are_cut_where_predicted_times_even_out(n, pp, costs, sizes):
    plan = plan_stages(n, pp, "GPipe", None, 4, 1, "m", costs=costs)
    assert [len(b) for b in plan.blocks] == sizes
    assert [i for b in plan.blocks for i in b] == list(range(n))
    even = plan_stages(n, pp, "GPipe", None, 4, 1, "m")
    assert max(_stage_times(plan, costs)) <= max(_stage_times(even, costs))
    assert "cut by predicted time per microbatch" in plan.describe()


def test_llama3_auto_parallel_gives_the_8B_output_layer_its_weight():
    """The planner predicts Llama 3 8B's output projection (vocabulary 128k) at about two
    blocks: on 8 stages the last holds fewer blocks than the others, and the slowest stage
    is predicted faster than with the blocks split evenly."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.resolve import pipeline_plan
    from torchtitan.experiments.auto_parallel import get_train_spec
    from torchtitan.experiments.auto_parallel.job_config import AutoParallelConfig

    spec = get_train_spec()
    job = JobConfig()
    job.model.name, job.model.flavor = spec.name, "8B"
    job.training.seq_len, job.training.local_batch_size = 2048, 8
    job.parallelism.pipeline_parallel_schedule = "1F1B"
    job.autoparallel = AutoParallelConfig(memory_budget_gib=80)  # type: ignore[attr-defined]
    plan = pipeline_plan(spec, spec.flavors["8B"], job, 8, stage_ranks=8)
    costs = plan.costs
    assert costs is not None and costs.first < 0.5 * costs.block < costs.block < costs.last
    memory = costs.memory  # bf16 compute, fp32 parameters + gradients + AdamW's two states
    assert memory is not None and memory.budget_bytes == 80 * GIB and memory.stage_ranks == 8
    with torch.device("meta"):
        block = Transformer(spec.flavors["8B"]).layers["0"]
    block_params = sum(p.numel() for p in block.parameters())
    assert memory.state[1] == block_params * 16
    assert 0.1 * GIB < memory.saved[1] < 2 * GIB  # a block's activations at seq 2048, microbatch 1
    assert "and by memory: a block's state 3.25 GiB over 8 rank(s)" in plan.describe()
    sizes = [len(b) for b in plan.blocks]
    assert sum(sizes) == 32 and sizes[-1] < 4 and sizes != [4] * 8
    even = plan_stages(32, 8, "1F1B", None, 8, 1, "llama3 8B")
    assert max(_stage_times(plan, costs)) < max(_stage_times(even, costs))


GIB = 2**30


def _memory_costs(state=(0.0, 0.0, 0.0), saved=(0.0, 0.0, 0.0), budget_gib=16.0) -> StageCosts:
    """Blocks of 1 µs each, nothing around them; memory in GiB per part."""
    gib = tuple(x * GIB for x in state), tuple(x * GIB for x in saved)
    return StageCosts(0.0, 1.0, 0.0, StageMemory(*gib, budget_bytes=budget_gib * GIB))


def _slowest(plan, costs: StageCosts) -> float:
    """The slowest stage's time with the recomputation its memory forces (as the split
    prices it)."""
    from torchtitan.distributed.pipeline import _StageCost

    shape = plan.shape(4)
    return max(
        _StageCost(costs, s, plan.stages, shape.in_flight(plan.rank_of(s, 4)), 1)(len(b))[0]
        for s, b in enumerate(plan.blocks)
    )


def test_1f1b_gives_its_first_stages_fewer_blocks_when_their_microbatches_do_not_fit():
    """1F1B on 4 ranks, 8 microbatches: stage r holds 4 - r microbatches' activations.  A
    block saves 1 GiB per microbatch and a rank has 16: the even split's first stage holds
    32 GiB and must recompute half of it; moving a block from the first stage to the last is
    cheaper than that recomputation, so the memory-aware split does it."""
    costs = _memory_costs(saved=(0, 1, 0))
    plan = plan_stages(32, 4, "1F1B", None, 8, 1, "m", costs=costs)
    even = plan_stages(32, 4, "1F1B", None, 8, 1, "m")
    sizes = [len(b) for b in plan.blocks]
    assert sum(sizes) == 32 and sizes[0] < 8 < sizes[-1]
    assert _slowest(plan, costs) < _slowest(even, costs)
    assert "1 GiB saved per microbatch" not in plan.describe()  # MiB, as it prints them
    assert "1024 MiB saved per microbatch, 16 GiB per rank" in plan.describe()
    # with room for every microbatch, the cut is the even one
    roomy_costs = _memory_costs(saved=(0, 1, 0), budget_gib=40)
    roomy = plan_stages(32, 4, "1F1B", None, 8, 1, "m", costs=roomy_costs)
    assert [len(b) for b in roomy.blocks] == [8] * 4


def test_a_stage_whose_state_does_not_fit_gives_its_blocks_away():
    """The first modules hold 4 GiB of state and a block 1 GiB, in a 10 GiB rank: the first
    stage has room for 6 blocks, the others share the rest; where no split fits at all, the
    cut balances time alone (the stage's own plan then reports the overflow)."""
    costs = _memory_costs(state=(4, 1, 0), budget_gib=10)
    plan = plan_stages(32, 4, "GPipe", None, 8, 1, "m", costs=costs)
    assert [len(b) for b in plan.blocks] == [6, 9, 9, 8]
    hopeless = _memory_costs(state=(4, 1, 0), budget_gib=4.5)
    plan = plan_stages(32, 4, "GPipe", None, 8, 1, "m", costs=hopeless)
    assert [len(b) for b in plan.blocks] == [8] * 4
