"""Where a pipeline is cut, for the auto-parallel specs: by the planner's predicted time,
within a rank's memory.

The blocks of a Llama-like model cost alike, but the modules around them do not: the output
projection of a large vocabulary costs a few blocks (Llama 3 8B: about two), the embedding
lookup almost nothing.  Splitting the blocks evenly leaves the last stage the slowest, and
a pipeline runs at its slowest stage's pace; so the stages are cut where the predicted
times even out (`torchtitan.distributed.pipeline.plan_stages` with `StageCosts`).  Memory
is not even either: under 1F1B the first stage holds the activations of as many
microbatches as there are stages, the last of one; the split gives a stage whose blocks
would not fit the time of the recomputation that makes them fit, and so moves blocks
away from it where that is cheaper.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.autoparallel.cost.parts import PartCost, part_costs
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.pipeline import PipelineSplit, StageCosts, StageMemory
from torchtitan.distributed.utils import resolve_param_dtype
from torchtitan.experiments.auto_parallel.parallelize import (
    job_cost_model,
    memory_budget_bytes,
    planner_settings,
)


def stage_costs(split: PipelineSplit):
    """The spec's `stage_costs_fn` for a model cut at `split`."""
    traced: dict[tuple, dict[str, PartCost]] = {}  # one trace per model and microbatch shape

    def predicted(model: nn.Module, job_config: JobConfig, stage_ranks: int) -> StageCosts:
        """One microbatch's predicted forward + backward time and memory of the modules
        before the blocks, of one block and of the modules after them (token ids in: any
        values do, only shapes are traced), for stages shared by `stage_ranks` ranks."""
        microbatch = int(job_config.parallelism.pipeline_parallel_microbatch_size)  # not auto here
        shape = (microbatch, job_config.training.seq_len)
        dtype = resolve_param_dtype(job_config.training.mixed_precision_param)
        cost_model = planner_settings(job_config).cost_model
        key = (
            type(model).__qualname__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()),
            shape,
            dtype,
            cost_model,
        )
        if key not in traced:
            traced[key] = part_costs(
                model,
                lambda: torch.zeros(shape, dtype=torch.long),
                {"first": split.first, "blocks": (split.blocks,), "last": split.last},
                default="blocks",
                cost_model=job_cost_model(cost_model),
                param_dtype=dtype,
            )
        parts = traced[key]
        n_blocks = len(getattr(model, split.blocks))
        first, last = parts["first"], parts["last"]
        blocks = parts["blocks"]
        block = PartCost(
            blocks.time_us / n_blocks, blocks.state_bytes / n_blocks, blocks.saved_bytes / n_blocks
        )
        memory = StageMemory(
            state=(first.state_bytes, block.state_bytes, last.state_bytes),
            saved=(first.saved_bytes, block.saved_bytes, last.saved_bytes),
            budget_bytes=memory_budget_bytes(job_config),
            stage_ranks=stage_ranks,
        )
        return StageCosts(first.time_us, block.time_us, last.time_us, memory)

    return predicted
