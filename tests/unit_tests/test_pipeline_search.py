"""The mesh search's pipelined candidates (experiments/auto_parallel/pipeline_search.py):
traced and planned side by side in forked children, they give the results and the stage
plans of one process planning them one after another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.config import ConfigManager
from torchtitan.config.resolve import pipeline_options
from torchtitan.errors import UserInputError
from torchtitan.experiments.auto_parallel import pipeline_search
from torchtitan.models.llama3.args import llama3_configs
from torchtitan.models.llama3.model import Transformer
from torchtitan.protocols.train_spec import get_train_spec

CANDIDATES = [
    {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1},
    {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2},
]


def _search(workers: int, monkeypatch):
    """plan_pipelined on CANDIDATES (debug Llama, 4 layers, global batch 4, microbatch size
    searched), `workers` candidates at a time: the results and the stage plans."""
    monkeypatch.setattr(pipeline_search, "cores", lambda: workers)
    args = dataclasses.replace(
        llama3_configs["debugmodel"], n_layers=4, vocab_size=512, max_seq_len=32
    )
    with torch.device("meta"):
        model = Transformer(args)
    job = ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "torchtitan.experiments.auto_parallel.job_config",
            "--model.name",
            "llama3_auto_parallel",
            "--training.seq_len",
            "32",
            "--training.global_batch_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "auto",
            "--parallelism.disable_loss_parallel",
            "--autoparallel.cost_model",
            "h100",
            "--autoparallel.no_plan_cache",
        ]
    )
    options = pipeline_options(get_train_spec("llama3_auto_parallel"), args, job)
    assert options is not None
    stage_plans: dict = {}
    planned, skipped = pipeline_search.plan_pipelined(
        model, options, CANDIDATES, job, 4, args.vocab_size, stage_plans=stage_plans
    )
    return planned, skipped, stage_plans


def test_pipelined_candidates_planned_side_by_side_match_one_process(fake_world, monkeypatch):
    with fake_world(4):
        apart = _search(3, monkeypatch)
        here = _search(1, monkeypatch)
    # pp 2 x dp_shard 2: a local batch of 2, microbatch 1; pp 2 x tp 2: 4, microbatches 1, 2
    assert len(apart[0]) == len(here[0]) == 3
    for (a, _), (b, _) in zip(apart[0], here[0]):
        assert a.label() == b.label()
        assert (a.predicted, a.objective, a.gap, a.note, a.detail) == (
            b.predicted,
            b.objective,
            b.gap,
            b.note,
            b.detail,
        )
        assert a.fits and a.predicted["bubble_us"] > 0
    assert apart[1] == here[1]
    assert apart[2].keys() == here[2].keys()
    for label, plans in apart[2].items():
        assert plans.keys() == here[2][label].keys()
        for which, plan in plans.items():
            untimed = [
                dataclasses.replace(p, timings={}).to_json() for p in (plan, here[2][label][which])
            ]
            assert untimed[0] == untimed[1], (label, which)


def test_a_bad_option_found_in_a_child_is_the_trainers_one_line_error(fake_world, monkeypatch):
    """An option that only a stage's planning finds wrong (raised in a forked child) comes
    back as the same UserInputError, which the trainer prints as one `error:` line."""

    def bad_option(*args, **kwargs):
        raise UserInputError("--activation_checkpoint.selective_ac_option 2: no blocks here")

    monkeypatch.setattr(pipeline_search, "_plan_candidate", bad_option)
    with fake_world(4), pytest.raises(UserInputError, match="selective_ac_option 2: no blocks"):
        _search(2, monkeypatch)
