"""`--parallelism.<degree> auto`: parsing, the degree helpers, who may ask for it (the
planner specs), preflight, how the chosen mesh is resolved (the user's job untouched), and
that a searched job traces its model once and solves each candidate mesh once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan import preflight
from torchtitan.config import ConfigError, ConfigManager, to_toml
from torchtitan.config.job_config import Parallelism
from torchtitan.config.resolve import check_mesh_search_possible, resolve, search_mesh
from torchtitan.distributed.parallel_dims import (
    AUTO,
    DEGREES,
    ParallelDims,
    ParallelismConfigError,
    mesh_dims,
    mesh_search_requested,
    open_degrees,
)
from torchtitan.protocols.train_spec import MeshChoice, get_train_spec

REPO = Path(__file__).resolve().parents[2]
DEBUG_TOML = "torchtitan/models/llama3/train_configs/debug_model.toml"


def parse(*argv):
    return ConfigManager().parse_args(list(argv))


# ------------------------------------------------------------------ config
def test_cli_accepts_auto_or_an_integer():
    assert AUTO == "auto"
    cfg = parse("--parallelism.tensor_parallel_degree", "auto")
    assert cfg.parallelism.tensor_parallel_degree == "auto"
    assert cfg.parallelism.data_parallel_shard_degree == -1  # the others keep their defaults
    four = parse("--parallelism.tensor_parallel_degree", "4").parallelism.tensor_parallel_degree
    assert four == 4 and type(four) is int
    replicate = parse("--parallelism.data_parallel_replicate_degree", "auto").parallelism
    assert replicate.data_parallel_replicate_degree == "auto"


@pytest.mark.parametrize("value", ["autox", "AUTO", "2.5"])
def test_cli_rejects_anything_else_naming_the_option_and_what_is_allowed(value):
    with pytest.raises(ConfigError) as err:
        parse("--parallelism.tensor_parallel_degree", value)
    assert str(err.value) == (
        f"--parallelism.tensor_parallel_degree: expected int|{{auto}}, got {value!r}"
    )


def test_toml_auto_and_round_trip(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[parallelism]\ntensor_parallel_degree = "auto"\ndata_parallel_shard_degree = 2\n'
    )
    cfg = parse("--job.config_file", str(path))
    assert cfg.parallelism.tensor_parallel_degree == "auto"
    assert cfg.parallelism.data_parallel_shard_degree == 2
    text = to_toml(cfg)
    assert 'tensor_parallel_degree = "auto"' in text.splitlines()
    assert "data_parallel_shard_degree = 2" in text.splitlines()
    again_path = tmp_path / "again.toml"
    again_path.write_text(text)
    again = parse("--job.config_file", str(again_path))
    assert again.parallelism == cfg.parallelism
    # in TOML a quoted number is a string, not a degree
    path.write_text('[parallelism]\ntensor_parallel_degree = "4"\n')
    with pytest.raises(ConfigError) as err:
        parse("--job.config_file", str(path))
    assert str(err.value) == (
        f"{path}: parallelism.tensor_parallel_degree: expected int|{{auto}}, got '4' (str)"
    )


# ------------------------------------------------------------------ degree helpers
def test_mesh_search_requested_and_open_degrees():
    assert not mesh_search_requested(Parallelism())
    assert not mesh_search_requested(Parallelism(tensor_parallel_degree=4))
    for _, option in DEGREES:
        assert mesh_search_requested(Parallelism(**{option: "auto"})), option
    assert open_degrees(Parallelism(tensor_parallel_degree="auto")) == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": None,  # -1 next to an auto: left to the search
        "tp": None,
    }
    assert open_degrees(
        Parallelism(tensor_parallel_degree="auto", data_parallel_shard_degree=2)
    ) == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": None}
    assert open_degrees(
        Parallelism(data_parallel_replicate_degree="auto", data_parallel_shard_degree="auto")
    ) == {"pp": 1, "dp_replicate": None, "dp_shard": None, "tp": 1}
    assert open_degrees(Parallelism(pipeline_parallel_degree="auto")) == {
        "pp": None,
        "dp_replicate": 1,
        "dp_shard": None,
        "tp": 1,
    }


def test_mesh_dims_keep_dims_above_one_outermost_first():
    assert mesh_dims(1, 8, 1) == [("dp_shard", 8)]
    assert mesh_dims(1, 1, 4) == [("tp", 4)]
    assert mesh_dims(1, 2, 4) == [("dp_shard", 2), ("tp", 4)]
    assert mesh_dims(2, 2, 2) == [("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)]
    assert mesh_dims(2, 1, 4) == [("dp_replicate", 2), ("tp", 4)]
    assert mesh_dims(1, 1, 1) == [("dp_shard", 1)]  # one rank: one dim of size 1


@pytest.mark.parametrize("name, option", DEGREES)
def test_parallel_dims_refuses_an_unresolved_auto(name, option):
    degrees = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, name: "auto"}
    with pytest.raises(ParallelismConfigError) as err:
        ParallelDims(**degrees, world_size=4)
    assert str(err.value) == f"--parallelism.{option} auto: no mesh search chose it; give a number"
    with pytest.raises(ParallelismConfigError, match=f"^--parallelism.{option} auto: "):
        ParallelDims.from_config(Parallelism(**{option: "auto"}), 4)


# ------------------------------------------------------------------ which specs may search
def test_only_planner_specs_can_choose_their_mesh():
    tp_auto = Parallelism(tensor_parallel_degree="auto")
    with pytest.raises(ParallelismConfigError) as err:
        check_mesh_search_possible(get_train_spec("llama3"), tp_auto, 4)
    assert str(err.value) == (
        "--parallelism.tensor_parallel_degree auto: the llama3 spec cannot choose its mesh "
        "(the planner specs can: llama3_auto_parallel, hf_auto_parallel, "
        "deepseek_v3_auto_parallel); give a number"
    )
    # the message names the first degree left to auto
    both = Parallelism(data_parallel_replicate_degree="auto", tensor_parallel_degree="auto")
    with pytest.raises(ParallelismConfigError, match="^--parallelism.data_parallel_replicate_"):
        check_mesh_search_possible(get_train_spec("llama3"), both, 4)
    assert get_train_spec("llama3_auto_parallel").choose_mesh_fn is not None
    check_mesh_search_possible(get_train_spec("llama3_auto_parallel"), tp_auto, 4)
    check_mesh_search_possible(get_train_spec("hf_auto_parallel"), tp_auto, 4)


def _config(*args):
    return ConfigManager().parse_args(["--job.config_file", DEBUG_TOML, *args])


def test_preflight_with_auto(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ParallelismConfigError, match="the llama3 spec cannot choose its mesh"):
        preflight.check(_config("--parallelism.tensor_parallel_degree", "auto"), 4)
    line = preflight.check(
        _config(
            "--model.name", "llama3_auto_parallel", "--parallelism.tensor_parallel_degree", "auto"
        ),
        4,
    )
    assert line.startswith(
        "preflight: mesh auto (the spec's mesh search plans every candidate at start), data "
    )


def test_preflight_error_line_for_the_manual_spec(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(
            ["--world-size", "4", "--job.config_file", DEBUG_TOML]
            + ["--parallelism.tensor_parallel_degree", "auto"]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: --parallelism.tensor_parallel_degree auto: the llama3 spec cannot choose its "
        "mesh (the planner specs can: llama3_auto_parallel, hf_auto_parallel, "
        "deepseek_v3_auto_parallel); give a number"
    ]


# ------------------------------------------------------------------ the trainer's contract
class StubSpec:
    """A spec whose mesh search answers dp_shard 2 x tp 2 and records what it was given."""

    name = "stub"
    check_parallelism_fn = None
    pipeline_split = None  # the search is given no pipeline options

    def __init__(self, degrees=None):
        self.degrees = degrees or {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
        self.calls = []

    def choose_mesh_fn(self, model, model_args, job_config, world_size, global_batch, pipeline):
        assert pipeline is None
        self.calls.append((model, model_args, job_config, world_size, global_batch))
        return dict(self.degrees)


def _search_and_resolve(spec, model, model_args, job_config, world_size):
    """What the trainer does for a job with `auto` degrees."""
    choice = search_mesh(spec, model, model_args, job_config, world_size)
    return resolve(spec, job_config, model_args, world_size, choice)


def test_resolve_fills_in_degrees_and_splits_the_pure_data_parallel_batch():
    job_config = parse(
        "--parallelism.tensor_parallel_degree", "auto", "--training.local_batch_size", "3"
    )
    typed = job_config.to_dict()
    spec, model, model_args = StubSpec(), object(), SimpleNamespace()
    resolved = _search_and_resolve(spec, model, model_args, job_config, 4)
    # the global batch is what a pure data-parallel mesh of 4 gives: 3 x 4
    assert spec.calls == [(model, model_args, job_config, 4, 12)]
    p, training = resolved.job_config.parallelism, resolved.job_config.training
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (1, 2)
    assert p.tensor_parallel_degree == 2
    assert training.local_batch_size == 6 and training.global_batch_size == 12
    assert not mesh_search_requested(p)
    dims = ParallelDims.from_config(p, 4)  # now a mesh the trainer can build
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 2, 2)
    # the resolution itself, and the user's config as typed
    assert (resolved.dp_replicate, resolved.dp_shard, resolved.tp) == (1, 2, 2)
    assert (resolved.local_batch_size, resolved.global_batch_size) == (6, 12)
    assert resolved.grad_accumulation_steps == 1 and resolved.mesh_searched
    assert job_config.to_dict() == typed
    assert resolved.describe(job_config) == (
        "resolved config: replicate 1 x shard 2 x tp 2 (mesh search), local batch 6, "
        "global batch 12, grad accumulation 1 (as typed: replicate 1 x shard -1 x tp auto, "
        "local batch 3, global batch -1)"
    )


def test_resolve_keeps_a_given_global_batch():
    job_config = parse(
        "--parallelism.tensor_parallel_degree", "auto", "--training.global_batch_size", "20"
    )
    typed = job_config.to_dict()
    spec = StubSpec({"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    resolved = _search_and_resolve(spec, None, None, job_config, 8)
    assert [call[-1] for call in spec.calls] == [20]
    p = resolved.job_config.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (2, 2)
    assert p.tensor_parallel_degree == 2
    assert resolved.job_config.training.local_batch_size == 5  # 20 over 4 data-parallel ranks
    assert resolved.job_config.training.global_batch_size == 20
    assert (resolved.local_batch_size, resolved.global_batch_size) == (5, 20)
    assert job_config.to_dict() == typed


def test_a_mesh_choice_with_a_plan_is_passed_on_as_is():
    job_config = parse("--parallelism.tensor_parallel_degree", "auto")
    plan = object()

    class PlanningSpec(StubSpec):
        def choose_mesh_fn(self, *args):
            return MeshChoice({"dp_replicate": 1, "dp_shard": 1, "tp": 4}, plan)

    choice = search_mesh(PlanningSpec(), None, None, job_config, 4)
    assert choice.plan is plan and dict(choice.degrees) == {
        "dp_replicate": 1,
        "dp_shard": 1,
        "tp": 4,
    }
    resolved = resolve(PlanningSpec(), job_config, None, 4, choice)
    assert (resolved.tp, resolved.local_batch_size, resolved.global_batch_size) == (4, 32, 32)


def test_a_pipelined_choice_brings_its_schedule_and_microbatch_size():
    """A mesh search that chose a pipelined mesh with the schedule and microbatch size left
    to it: the run's stages use them; the user's job keeps `auto`."""
    from torchtitan.models.llama3 import llama3_configs

    job_config = parse(
        *("--parallelism.pipeline_parallel_degree", "auto"),
        *("--parallelism.pipeline_parallel_schedule", "auto"),
        *("--parallelism.pipeline_parallel_microbatch_size", "auto"),
        *("--training.global_batch_size", "8"),
    )
    degrees = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    choice = MeshChoice(degrees, schedule="Interleaved1F1B", microbatch_size=2)
    resolved = resolve(
        get_train_spec("llama3"), job_config, llama3_configs["debugmodel"], 4, choice
    )
    stages = resolved.stage_plan
    assert stages is not None and stages.schedule == "Interleaved1F1B"
    assert (resolved.local_batch_size, stages.microbatches, stages.stages) == (4, 2, 4)
    p = job_config.parallelism
    assert p.pipeline_parallel_schedule == p.pipeline_parallel_microbatch_size == "auto"


def test_resolve_does_nothing_without_auto_and_refuses_a_spec_that_cannot_search():
    job_config = parse("--parallelism.tensor_parallel_degree", "2")
    before = job_config.to_dict()
    spec = StubSpec()
    resolved = resolve(spec, job_config, None, 4)
    assert spec.calls == [] and job_config.to_dict() == before
    assert (resolved.dp_replicate, resolved.dp_shard, resolved.tp) == (1, 2, 2)
    assert not resolved.mesh_searched and resolved.grad_accumulation_steps == 1
    # -1 resolved in the copy the run uses, as typed in the user's
    assert resolved.job_config.training.global_batch_size == 16
    assert job_config.training.global_batch_size == -1

    manual = SimpleNamespace(name="manual", choose_mesh_fn=None)
    job_config = parse("--parallelism.data_parallel_shard_degree", "auto")
    with pytest.raises(ParallelismConfigError, match="^--parallelism.data_parallel_shard_degree "):
        search_mesh(manual, None, None, job_config, 4)
    assert job_config.parallelism.data_parallel_shard_degree == "auto"
    # without a search's answer an auto degree is refused, as ParallelDims refuses it
    with pytest.raises(ParallelismConfigError, match="^--parallelism.data_parallel_shard_degree "):
        resolve(manual, job_config, None, 4)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"data_parallel_replicate_degree": 0},
            "--parallelism.data_parallel_replicate_degree must be auto or >= 1, got 0",
        ),
        (
            {"data_parallel_shard_degree": 0},
            "--parallelism.data_parallel_shard_degree must be auto, -1 or >= 1, got 0",
        ),
        (
            {"data_parallel_replicate_degree": 3},
            "the fixed parallelism degrees multiply to 3, which does not divide the world "
            "size 4; leave more of them to the search (auto)",
        ),
    ],
)
def test_fixed_degrees_next_to_auto_are_checked(options, message):
    parallelism = Parallelism(tensor_parallel_degree="auto", **options)
    with pytest.raises(ParallelismConfigError) as err:
        check_mesh_search_possible(get_train_spec("llama3_auto_parallel"), parallelism, 4)
    assert str(err.value) == message


def test_hf_config_states_its_tensor_parallel_sizes():
    """A Hugging Face config's heads and widths bound the tp degrees the search tries."""
    pytest.importorskip("transformers")
    import types

    from torchtitan.experiments.auto_parallel.mesh_choice import candidate_degrees
    from torchtitan.models.hf_causal_lm.model import HFModelArgs

    args = HFModelArgs(config_path=str(REPO / "tests/assets/hf_llama_debug"))
    job = _config("--model.name", "hf_auto_parallel")
    args.update_from_config(job, types.SimpleNamespace(vocab_size=2000))
    assert args.tensor_parallel_sizes() == {
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_size": 256,
        "intermediate_size": 768,
        "vocab_size": 2000,
    }
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 32, 32, args.tensor_parallel_sizes(), 256, 32
    )
    assert [d["tp"] for d in keep] == [16, 8, 4, 2, 1]
    assert skipped == [
        (
            {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 32},
            "tp 32 does not divide num_attention_heads 16, num_key_value_heads 16, vocab_size 2000",
        )
    ]


# ------------------------------------------------------------------ one trace, no second solve
def _count_calls(monkeypatch, counts: dict[str, int], key: str, owners, name: str) -> None:
    """Count calls of the function `name` of each module or class in `owners` (the same
    function object where several modules imported it)."""
    original = getattr(owners[0], name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return original(*args, **kwargs)

    for owner in owners:
        if getattr(owner, name, None) is original:
            monkeypatch.setattr(owner, name, counted)


def test_a_searched_job_traces_once_and_solves_each_program_once(fake_world, monkeypatch, tmp_path):
    """The trainer's start for dp_replicate and tp auto on 4 ranks with the plan cache off:
    the search plans the 6 candidate meshes from one trace, solving the 4 distinct programs
    among them (dp_replicate 4 and dp_shard 4 are one program, so are dp_replicate 2 x tp 2
    and dp_shard 2 x tp 2), and the chosen mesh's plan is applied from that trace (2 traces:
    the planning one, of the first, second and last block, and the whole model's graph the
    plan runs on), nothing written into the user's config."""
    import sys

    import torchtitan.autoparallel.trace.joint as joint
    from torchtitan.autoparallel import AutoParallel, child_process
    from torchtitan.train import Trainer

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    counts = {"trace": 0, "solve": 0}
    planner_modules = [joint] + [
        module
        for module_name, module in sorted(sys.modules.items())
        if module_name.startswith("torchtitan.autoparallel") and module is not joint
    ]
    _count_calls(monkeypatch, counts, "trace", planner_modules, "trace_joint")
    # the plan cache is off, so each solve_problem is one solve
    _count_calls(monkeypatch, counts, "solve", [AutoParallel], "solve_problem")
    # planned in this process (not a forked child), where the calls are counted
    monkeypatch.setattr(child_process, "can_fork", lambda: False)
    job_config = _config(
        "--model.name",
        "llama3_auto_parallel",
        "--parallelism.data_parallel_replicate_degree",
        "auto",
        "--parallelism.tensor_parallel_degree",
        "auto",
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        "64",
        "--job.custom_config_module",
        "torchtitan.experiments.auto_parallel.job_config",
        "--autoparallel.no_plan_cache",
        "--job.dump_folder",
        str(tmp_path),
    )
    typed = job_config.to_dict()
    with fake_world(4):
        trainer = Trainer(job_config)
    assert counts == {"trace": 2, "solve": 4}
    assert job_config.to_dict() == typed and trainer.user_config is job_config
    resolved = trainer.resolved
    assert resolved.mesh_searched and resolved.global_batch_size == 4
    assert resolved.dp_degree * resolved.tp == 4
    assert resolved.local_batch_size == 4 // resolved.dp_degree
    assert not (tmp_path / "plans").exists()
