"""`hf_auto_parallel`: a Hugging Face causal LM from a local config, parallelised by the planner.

`--model.flavor` is the config (a folder holding `config.json`, or the file); the tokenizer
is `--model.tokenizer_path` as for every spec.  Data, optimizer, LR schedule, loss, logging
and DCP checkpoints (under Hugging Face's parameter names) are the llama3 spec's.
"""

import dataclasses

from torchtitan.experiments.auto_parallel.mesh_choice import choose_mesh_hf_auto
from torchtitan.experiments.auto_parallel.parallelize import parallelize_hf_auto
from torchtitan.experiments.auto_parallel.steering import steering_checker
from torchtitan.models.hf_causal_lm import HFConfigFlavors, build_hf_causal_lm
from torchtitan.models.llama3 import get_train_spec as _llama3_spec


def get_train_spec():
    return dataclasses.replace(
        _llama3_spec(),
        name="hf_auto_parallel",
        parallelize_fn=parallelize_hf_auto,
        check_parallelism_fn=steering_checker(build_hf_causal_lm),
        pipeline_split=None,  # no split is named for transformers models yet
        choose_mesh_fn=choose_mesh_hf_auto,
        model_cls=build_hf_causal_lm,
        flavors=HFConfigFlavors(),
    )
