"""`deepseek_v3_auto_parallel`: the MoE decoder with the planner as its `parallelize_fn`.

Same model, flavors, data, optimizer and loss as `deepseek_v3`; the planner chooses every
layout, the routed experts' included (replicated, split by hidden unit, or split over a
mesh dim with tokens dispatched by all-to-all).  `--parallelism.expert_parallel_degree N`
makes it split them over an `ep` mesh dim of N ranks.
"""

import dataclasses
from typing import cast

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.experiments.auto_parallel.mesh_choice import choose_mesh_llama_auto
from torchtitan.experiments.auto_parallel.parallelize import parallelize_llama_auto
from torchtitan.models.deepseek_v3 import get_train_spec as _moe_spec
from torchtitan.models.deepseek_v3.args import MoEModelArgs
from torchtitan.models.deepseek_v3.parallelize import check_expert_parallel
from torchtitan.protocols.model import BaseModelArgs


def check_moe_auto(
    model_args: BaseModelArgs, parallel_dims: ParallelDims, job_config: JobConfig
) -> None:
    """The planner takes any mesh; an expert-parallel degree must divide the experts."""
    check_expert_parallel(cast(MoEModelArgs, model_args), parallel_dims.ep, job_config.model.flavor)


def get_train_spec():
    return dataclasses.replace(
        _moe_spec(),
        name="deepseek_v3_auto_parallel",
        parallelize_fn=parallelize_llama_auto,
        check_parallelism_fn=check_moe_auto,
        choose_mesh_fn=choose_mesh_llama_auto,
    )
