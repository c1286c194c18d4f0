"""Where a pipeline is cut, for the auto-parallel specs: by the planner's predicted time.

The blocks of a Llama-like model cost alike, but the modules around them do not: the output
projection of a large vocabulary costs a few blocks (Llama 3 8B: about two), the embedding
lookup almost nothing.  Splitting the blocks evenly leaves the last stage the slowest, and
a pipeline runs at its slowest stage's pace; so the stages are cut where the predicted
times even out (`torchtitan.distributed.pipeline.plan_stages` with `StageCosts`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.autoparallel.cost.parts import part_times_us
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.pipeline import PipelineSplit, StageCosts
from torchtitan.experiments.auto_parallel.parallelize import job_cost_model, planner_settings


def stage_costs(split: PipelineSplit):
    """The spec's `stage_costs_fn` for a model cut at `split`."""

    def predicted(model: nn.Module, job_config: JobConfig) -> StageCosts:
        """One microbatch's predicted forward + backward time of the modules before the
        blocks, of one block and of the modules after them (token ids in: any values do,
        only shapes are traced)."""
        microbatch = job_config.parallelism.pipeline_parallel_microbatch_size
        shape = (microbatch, job_config.training.seq_len)
        parts = {"first": split.first, "blocks": (split.blocks,), "last": split.last}
        times = part_times_us(
            model,
            lambda: torch.zeros(shape, dtype=torch.long),
            parts,
            default="blocks",
            cost_model=job_cost_model(planner_settings(job_config).cost_model),
        )
        n_blocks = len(getattr(model, split.blocks))
        return StageCosts(times["first"], times["blocks"] / n_blocks, times["last"])

    return predicted
