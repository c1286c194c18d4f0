"""`llama3_auto_parallel`: the llama3 spec with the planner as its `parallelize_fn`.

Same model class, flavors, tokenizer, data, optimizer, LR schedule and loss as `llama3`;
only the parallelisation differs — and the trainer cannot tell.  Pipeline stages are cut
where the planner's predicted times even out (stage_costs.py), each stage planned alone.
"""

import dataclasses

from torchtitan.experiments.auto_parallel.mesh_choice import choose_mesh_llama_auto
from torchtitan.experiments.auto_parallel.parallelize import parallelize_llama_auto
from torchtitan.experiments.auto_parallel.stage_costs import stage_costs
from torchtitan.experiments.auto_parallel.steering import steering_checker
from torchtitan.models.llama3 import get_train_spec as _llama3_spec


def get_train_spec():
    # The planner places uneven shards, so any mesh is accepted; only pins and a plan file
    # are checked.
    base = _llama3_spec()
    return dataclasses.replace(
        base,
        name="llama3_auto_parallel",
        parallelize_fn=parallelize_llama_auto,
        check_parallelism_fn=steering_checker(base.model_cls),
        stage_costs_fn=stage_costs(base.pipeline_split),
        choose_mesh_fn=choose_mesh_llama_auto,
    )
