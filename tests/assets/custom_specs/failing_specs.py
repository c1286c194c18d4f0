"""Specs whose `parallelize_fn` fails on one rank only, for the launcher tests: a bug
(`fails_on_rank1`, `fails_on_rank3`) and an input error (`refuses_on_rank1`); and one
whose tokenizer fails in preflight (`tokenizer_bug`).  Imported with
`--experimental.custom_import failing_specs` and this folder on PYTHONPATH."""

import dataclasses
import os

from torchtitan.errors import UserInputError
from torchtitan.models.llama3 import get_train_spec
from torchtitan.protocols.train_spec import register_train_spec


def _failing(error: Exception, rank: int):
    base = get_train_spec().parallelize_fn

    def parallelize(model, parallel_dims, job_config):
        if int(os.environ["RANK"]) == rank:
            raise error
        return base(model, parallel_dims, job_config)

    return parallelize


for name, error, rank in (
    ("fails_on_rank1", RuntimeError("boom on rank 1"), 1),
    ("fails_on_rank3", RuntimeError("boom on rank 3"), 3),
    ("refuses_on_rank1", UserInputError("--model.flavor: rank 1 refuses it"), 1),
):
    register_train_spec(
        dataclasses.replace(get_train_spec(), name=name, parallelize_fn=_failing(error, rank))
    )


def _tokenizer_with_a_bug(job_config):
    raise RuntimeError("tokenizer bug")


# fails in preflight already (the launcher builds the tokenizer to check the config)
register_train_spec(
    dataclasses.replace(
        get_train_spec(), name="tokenizer_bug", build_tokenizer_fn=_tokenizer_with_a_bug
    )
)
