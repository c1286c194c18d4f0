"""TrainSpec: everything model-specific the trainer needs, looked up by `--model.name`.

Built-in specs are imported lazily (their module is imported the first time the name is
asked for), so an optional spec with heavy or missing dependencies never breaks
`import torchtitan`.  Specs registered at run time (e.g. from
`--experimental.custom_import`) take priority over the built-ins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan.errors import UserInputError
from torchtitan.protocols.model import BaseModelArgs

# name -> module exposing `get_train_spec() -> TrainSpec`
_BUILTIN_SPECS: dict[str, str] = {
    "llama3": "torchtitan.models.llama3",
    "llama3_auto_parallel": "torchtitan.experiments.auto_parallel",
    "hf_auto_parallel": "torchtitan.experiments.auto_parallel.hf",
    "deepseek_v3": "torchtitan.models.deepseek_v3",
    "deepseek_v3_auto_parallel": "torchtitan.experiments.auto_parallel.moe",
}
_REGISTERED: dict[str, TrainSpec] = {}


@dataclass(frozen=True)
class MeshChoice:
    """A spec's mesh search's answer (`TrainSpec.choose_mesh_fn`)."""

    degrees: Mapping[str, int]
    """The chosen mesh: {"dp_replicate", "dp_shard", "tp"}, and "pp", "ep" when chosen."""
    plan: Any = None
    """The spec's own record of how it parallelises the model on that mesh (the planner
    specs: the chosen plan and the planner that traced the model), handed back to its
    `parallelize_fn`, which applies it instead of planning again; None: nothing kept."""
    schedule: str | None = None
    """The pipeline schedule chosen with a pipelined mesh (for a schedule left to `auto`);
    None: the job's own."""
    microbatch_size: int | None = None
    """The pipeline microbatch size chosen with a pipelined mesh (for a size left to
    `auto`); None: the job's own."""


@dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: Callable[[BaseModelArgs], Any]
    """Builds the model from its args (a class, or a factory); called under the meta device."""
    flavors: Mapping[str, BaseModelArgs]
    parallelize_fn: Callable[..., Any]
    """(model, parallel_dims, job_config) -> model; runs on the meta-device model.  When
    `choose_mesh_fn` chose the mesh and its answer carries a plan, that answer comes too,
    as the keyword `mesh_choice=`; for a spec with a `pipeline_split`, each stage comes
    with the keyword `stage=` (a `torchtitan.distributed.pipeline.StageIO`: what the stage
    takes and gives per microbatch)."""
    build_optimizers_fn: Callable[..., Any]
    build_lr_schedulers_fn: Callable[..., Any]
    build_dataloader_fn: Callable[..., Any]
    build_tokenizer_fn: Callable[..., Any]
    build_loss_fn: Callable[..., Any]
    check_parallelism_fn: Callable[..., None] | None = None
    """(model_args, parallel_dims, job_config) -> None: raises `UserInputError` for a mesh
    `parallelize_fn` cannot apply (e.g. a tp degree that does not divide the heads).  Run
    before any rank starts (preflight) and again by the trainer; None accepts any mesh."""
    pipeline_split: Any = None
    """Where the model may be cut into pipeline stages (a
    `torchtitan.distributed.pipeline.PipelineSplit`); None: the spec cannot pipeline
    (`--parallelism.pipeline_parallel_degree` > 1 is an error)."""
    stage_costs_fn: Callable[..., Any] | None = None
    """(meta model, job_config, stage_ranks) -> `torchtitan.distributed.pipeline.StageCosts`:
    the predicted time and memory of the model's parts for stages shared by `stage_ranks`
    ranks, by which the pipeline stages are split when the user gives no split; None: the
    blocks are split as evenly as they go."""
    choose_mesh_fn: Callable[..., MeshChoice | Mapping[str, int]] | None = None
    """(meta model, model_args, job_config, world_size, global_batch, pipeline) ->
    `MeshChoice` (or just its degrees) for a job that leaves some degrees to `auto`; called
    on every rank before the mesh exists (`torchtitan.config.resolve.search_mesh`).
    `pipeline` (a `torchtitan.distributed.pipeline.PipelineOptions`, or None for a spec that
    cannot pipeline) gives the stages of a pipeline degree.  None: the spec cannot choose
    (`auto` is an error)."""


class UnknownTrainSpecError(UserInputError):
    pass


def import_custom_module(name: str) -> None:
    """Import `--experimental.custom_import` (a module that registers extra specs)."""
    if not name:
        return
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise UserInputError(
            f"--experimental.custom_import: cannot import {name!r} ({type(e).__name__}: {e}); "
            "give a module importable from the working directory or PYTHONPATH"
        ) from None


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _REGISTERED:
        raise ValueError(f"a TrainSpec named {spec.name!r} is already registered")
    _REGISTERED[spec.name] = spec


def registered_names() -> list[str]:
    return sorted(set(_REGISTERED) | set(_BUILTIN_SPECS))


def get_train_spec(name: str) -> TrainSpec:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN_SPECS:
        raise UnknownTrainSpecError(
            f"--model.name: unknown model {name!r}; registered: {', '.join(registered_names())}"
        )
    spec = importlib.import_module(_BUILTIN_SPECS[name]).get_train_spec()
    _REGISTERED[name] = spec
    return spec
