"""`deepseek_v3_auto_parallel`: the MoE decoder with the planner as its `parallelize_fn`.

Same model, flavors, data, optimizer and loss as `deepseek_v3`; the planner chooses every
layout, the routed experts' included (replicated, split by hidden unit, or split over a
mesh dim with tokens dispatched by all-to-all).  `--parallelism.expert_parallel_degree N`
makes it split them over an `ep` mesh dim of N ranks.
"""

import dataclasses

from torchtitan.experiments.auto_parallel.mesh_choice import choose_mesh_llama_auto
from torchtitan.experiments.auto_parallel.parallelize import parallelize_llama_auto
from torchtitan.experiments.auto_parallel.steering import steering_checker
from torchtitan.models.deepseek_v3 import get_train_spec as _moe_spec


def get_train_spec():
    base = _moe_spec()
    return dataclasses.replace(
        base,
        name="deepseek_v3_auto_parallel",
        parallelize_fn=parallelize_llama_auto,
        # the planner places any mesh (config/resolve.py checks EP); only pins are checked
        check_parallelism_fn=steering_checker(base.model_cls),
        pipeline_split=None,  # as deepseek_v3's: the MoE model names no split yet
        choose_mesh_fn=choose_mesh_llama_auto,
    )
