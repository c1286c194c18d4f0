"""`deepseek_v3_auto_parallel`: the MoE decoder with the planner as its `parallelize_fn`.

Same model, flavors, data, optimizer and loss as `deepseek_v3`; the planner chooses every
layout, the routed experts' included (replicated, split by hidden unit, or split over a
mesh dim with tokens dispatched by all-to-all).  `--parallelism.expert_parallel_degree N`
makes it split them over an `ep` mesh dim of N ranks.
"""

import dataclasses

from torchtitan.experiments.auto_parallel.mesh_choice import choose_mesh_llama_auto
from torchtitan.experiments.auto_parallel.parallelize import parallelize_llama_auto
from torchtitan.models.deepseek_v3 import get_train_spec as _moe_spec


def get_train_spec():
    return dataclasses.replace(
        _moe_spec(),
        name="deepseek_v3_auto_parallel",
        parallelize_fn=parallelize_llama_auto,
        check_parallelism_fn=None,  # the planner places any mesh (config/resolve.py checks EP)
        choose_mesh_fn=choose_mesh_llama_auto,
    )
