"""Specs whose `parallelize_fn` fails on rank 1 only, for the launcher tests: a bug
(`fails_on_rank1`) and an input error (`refuses_on_rank1`).  Imported with
`--experimental.custom_import failing_specs` and this folder on PYTHONPATH."""

import dataclasses
import os

from torchtitan.errors import UserInputError
from torchtitan.models.llama3 import get_train_spec
from torchtitan.protocols.train_spec import register_train_spec


def _failing(error: Exception):
    base = get_train_spec().parallelize_fn

    def parallelize(model, parallel_dims, job_config):
        if int(os.environ["RANK"]) == 1:
            raise error
        return base(model, parallel_dims, job_config)

    return parallelize


for name, error in (
    ("fails_on_rank1", RuntimeError("boom on rank 1")),
    ("refuses_on_rank1", UserInputError("--model.flavor: rank 1 refuses it")),
):
    register_train_spec(
        dataclasses.replace(get_train_spec(), name=name, parallelize_fn=_failing(error))
    )
