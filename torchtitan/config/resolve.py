"""The run a job describes, settled before the training loop starts.

The user's `JobConfig` says what was typed: degrees may be `auto` or -1, the global batch
-1.  `resolve` turns it and the world size into a `ResolvedConfig`: the degrees as numbers,
the batch per data-parallel rank and per step, the gradient-accumulation steps, and a copy
of the config with those values written in (what the spec's builders read).  The user's
config itself is never changed, so what was typed and what runs can be logged side by side.

`torchtitan.preflight` (before any rank starts) and the trainer go through the same
functions, so both refuse the same inputs with the same message.  Degrees left to `auto`
are the spec's mesh search's (`search_mesh`); it needs the model, so only the trainer runs
it, and preflight checks that a search is possible (`check_mesh_search_possible`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig, Parallelism, Training
from torchtitan.distributed.parallel_dims import (
    AUTO,
    DEGREES,
    EP_OPTION,
    ParallelDims,
    ParallelismConfigError,
    check_search_degrees,
)
from torchtitan.distributed.pipeline import (
    AUTO_SCHEDULES,
    SCHEDULES,
    PipelineOptions,
    StagePlan,
    plan_stages,
)
from torchtitan.errors import UserInputError
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import MeshChoice, TrainSpec
from torchtitan.tools.logging import logger


@dataclass(frozen=True)
class ResolvedConfig:
    """The run as it executes on `world_size` ranks (see the module docstring)."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    local_batch_size: int
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int
    """Sequences per optimizer step over all ranks."""
    grad_accumulation_steps: int
    mesh_searched: bool
    """The degrees are the spec's mesh search's choice (some were typed as `auto`)."""
    ep: int
    """Expert-parallel degree (carved from the shard ranks)."""
    pp: int
    """Pipeline-parallel degree (the outermost mesh dim)."""
    stage_plan: StagePlan | None
    """With pp > 1: the blocks of each pipeline stage, the schedule and its microbatches."""
    job_config: JobConfig = field(compare=False, repr=False)
    """A copy of the user's config with the values above written in: what the spec's
    builders (dataloader, `parallelize_fn`, ...) read.  The user's own is left as typed."""

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def parallel_dims(self) -> ParallelDims:
        """These degrees as a `ParallelDims` (its mesh not built yet)."""
        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            world_size=self.world_size,
            enable_loss_parallel=not self.job_config.parallelism.disable_loss_parallel,
            ep=self.ep,
            pp=self.pp,
        )

    def mesh_label(self) -> str:
        if self.pp > 1:
            return (
                f"{self.pp}x{self.dp_replicate}x{self.dp_shard}x{self.tp} "
                "(pp x replicate x shard x tp)"
            )
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp} (replicate x shard x tp)"

    def describe(self, user: JobConfig) -> str:
        """One line: the resolved values, and what the user typed for them."""
        search = " (mesh search)" if self.mesh_searched else ""
        return (
            f"resolved config: {self._pp()}replicate {self.dp_replicate} x shard {self.dp_shard} x "
            f"tp {self.tp}{self._ep()}{search}, local batch {self.local_batch_size}, global batch "
            f"{self.global_batch_size}, grad accumulation {self.grad_accumulation_steps} "
            f"(as typed: {_typed(user)})"
        )

    def _pp(self) -> str:
        return f"pp {self.pp} x " if self.pp > 1 else ""

    def _ep(self) -> str:
        return f" (ep {self.ep} of the shard ranks)" if self.ep > 1 else ""


def check_expert_parallel(model_args: BaseModelArgs, ep: int, model: str) -> None:
    """An expert-parallel degree needs routed experts to split, a number it divides."""
    if ep == 1:
        return
    experts = model_args.routed_experts()
    if experts == 0:
        raise UserInputError(
            f"--parallelism.expert_parallel_degree {ep}: {model} has no routed experts; "
            "it applies to mixture-of-experts models (deepseek_v3, deepseek_v3_auto_parallel)"
        )
    if experts % ep:
        raise UserInputError(
            f"--parallelism.expert_parallel_degree {ep} does not divide the {experts} routed "
            f"experts of {model}"
        )


def pipeline_plan(
    spec: TrainSpec, model_args: BaseModelArgs, job_config: JobConfig, pp: int, stage_ranks: int
) -> StagePlan:
    """The pipeline stages of this job (`pp` > 1, each stage shared by `stage_ranks` ranks),
    or a `UserInputError` naming the option:
    a spec that cannot pipeline, blocks or microbatches that do not split as asked, a
    schedule torch does not have."""
    p = job_config.parallelism
    option = f"--parallelism.pipeline_parallel_degree {pp}"
    for setting, give in (
        ("schedule", f"give one of {', '.join(SCHEDULES)}"),
        ("microbatch_size", "give a number of sequences"),
    ):
        if getattr(p, f"pipeline_parallel_{setting}") == AUTO:
            raise UserInputError(
                f"--parallelism.pipeline_parallel_{setting} auto: the mesh search chooses it, "
                "and it runs when a degree is auto (e.g. --parallelism.pipeline_parallel_degree"
                f" auto); {give}"
            )
    if spec.pipeline_split is None:
        raise UserInputError(
            f"{option}: {spec.name} cannot be pipelined (its spec names no pipeline split); "
            "use llama3 or llama3_auto_parallel, or pipeline_parallel_degree 1"
        )
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    blocks = len(getattr(model, spec.pipeline_split.blocks))
    split_points = _split_points(p.pipeline_parallel_split_points)
    costs = None
    if spec.stage_costs_fn is not None and not split_points:
        if p.pipeline_parallel_layers_per_stage is None:
            costs = spec.stage_costs_fn(model, job_config, stage_ranks)
    return plan_stages(
        blocks,
        pp,
        p.pipeline_parallel_schedule,
        p.pipeline_parallel_layers_per_stage,
        job_config.training.local_batch_size,
        int(p.pipeline_parallel_microbatch_size),  # auto refused above
        f"{job_config.model.name} {job_config.model.flavor}",
        split_points,
        costs,
    )


def _split_points(text: str) -> list[int]:
    """`--parallelism.pipeline_parallel_split_points` as block positions."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() for t in items):
        raise UserInputError(
            f"--parallelism.pipeline_parallel_split_points {text!r}: give the positions of "
            "the blocks that start a stage as integers, comma-separated (e.g. 2,4)"
        )
    return [int(t) for t in items]


def _typed(user: JobConfig) -> str:
    p, t = user.parallelism, user.training
    pp = f"pp {p.pipeline_parallel_degree} x " if p.pipeline_parallel_degree != 1 else ""
    return (
        f"{pp}replicate {p.data_parallel_replicate_degree} x shard {p.data_parallel_shard_degree} "
        f"x tp {p.tensor_parallel_degree}, local batch {t.local_batch_size}, global batch "
        f"{t.global_batch_size}"
    )


def resolve_model_args(spec: TrainSpec, job_config: JobConfig, tokenizer: Any) -> BaseModelArgs:
    """The flavor's model args, completed from the job config and tokenizer."""
    flavor = job_config.model.flavor
    if flavor not in spec.flavors:
        raise UserInputError(
            f"--model.flavor: unknown flavor {flavor!r} for {spec.name}; "
            f"choose from {', '.join(spec.flavors)}"
        )
    model_args = copy.deepcopy(spec.flavors[flavor])  # may explain a bad flavor itself
    model_args.update_from_config(job_config, tokenizer)
    return model_args


def grad_accumulation_steps(training: Training, dp_degree: int) -> int:
    """Micro-batches per optimizer step so that a step sees `global_batch_size` samples."""
    per_step = training.local_batch_size * dp_degree
    global_batch = training.global_batch_size if training.global_batch_size > 0 else per_step
    if global_batch % per_step:
        raise UserInputError(
            f"--training.global_batch_size {global_batch} is not a multiple of "
            f"local_batch_size {training.local_batch_size} × data-parallel degree {dp_degree}"
        )
    return global_batch // per_step


def check_mesh_search_possible(spec: TrainSpec, parallelism: Parallelism, world_size: int) -> None:
    """`auto` needs a spec that can choose its mesh, and fixed degrees the world allows."""
    if spec.choose_mesh_fn is None:
        options = [o for _, o in DEGREES] + [EP_OPTION]
        option = next(o for o in options if getattr(parallelism, o) == AUTO)
        raise ParallelismConfigError(
            f"--parallelism.{option} auto: the {spec.name} spec cannot choose its mesh "
            "(the planner specs can: llama3_auto_parallel, hf_auto_parallel, "
            "deepseek_v3_auto_parallel); give a number"
        )
    check_search_degrees(parallelism, world_size)


def search_global_batch(training: Training, world_size: int) -> int:
    """The global batch every candidate mesh of a search trains: `global_batch_size`, or
    what a pure data-parallel mesh of this world gives (`local_batch_size` x world size)."""
    if training.global_batch_size > 0:
        return training.global_batch_size
    return training.local_batch_size * world_size


def search_mesh(
    spec: TrainSpec, model: Any, model_args: BaseModelArgs, job_config: JobConfig, world_size: int
) -> MeshChoice:
    """The spec's mesh search (`choose_mesh_fn`) for a job that leaves degrees to `auto`,
    on the meta-device `model`; called on every rank before the mesh exists.  The chosen
    mesh's data-parallel ranks split `search_global_batch` in one micro-batch each."""
    parallelism = job_config.parallelism
    check_mesh_search_possible(spec, parallelism, world_size)
    choose_mesh = spec.choose_mesh_fn
    assert choose_mesh is not None  # check_mesh_search_possible refuses a spec without one
    global_batch = search_global_batch(job_config.training, world_size)
    answer = choose_mesh(
        model,
        model_args,
        job_config,
        world_size,
        global_batch,
        pipeline_options(spec, model_args, job_config),
    )
    choice = answer if isinstance(answer, MeshChoice) else MeshChoice(dict(answer))
    degrees = choice.degrees
    local = global_batch // (degrees["dp_replicate"] * degrees["dp_shard"])
    logger.info(
        "mesh search chose "
        + ", ".join(f"{o} {degrees[n]}" for n, o in [*DEGREES, ("ep", EP_OPTION)] if n in degrees)
        + f"; global batch {global_batch}, local batch {local}"
    )
    return choice


def pipeline_options(
    spec: TrainSpec, model_args: BaseModelArgs, job_config: JobConfig
) -> PipelineOptions | None:
    """The stages each pipeline degree, local batch and schedule would run
    (`pipeline_plan`), for the mesh search; None for a spec that cannot pipeline."""
    if spec.pipeline_split is None:
        return None
    p = job_config.parallelism
    schedules = AUTO_SCHEDULES if p.pipeline_parallel_schedule == AUTO else None
    microbatch = p.pipeline_parallel_microbatch_size

    def stages_for(
        degrees: dict[str, int], local_batch: int, schedule: str, microbatch_size: int
    ) -> StagePlan:
        run = copy.deepcopy(job_config)
        run.parallelism.pipeline_parallel_schedule = schedule
        run.parallelism.pipeline_parallel_microbatch_size = microbatch_size
        run.training.local_batch_size = local_batch
        stage_ranks = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"]
        return pipeline_plan(spec, model_args, run, degrees["pp"], stage_ranks)

    return PipelineOptions(
        spec.pipeline_split,
        stages_for,
        schedules or (p.pipeline_parallel_schedule,),
        None if microbatch == AUTO else int(microbatch),
    )


def resolve(
    spec: TrainSpec,
    job_config: JobConfig,
    model_args: BaseModelArgs,
    world_size: int,
    mesh_choice: MeshChoice | None = None,
) -> ResolvedConfig:
    """The run `job_config` describes on `world_size` ranks, without changing it.

    The degrees are the config's (the shard degree's -1 filled in), or `mesh_choice`'s
    when the spec's mesh search chose them (`search_mesh`; the batch is then
    `search_global_batch`, split evenly over the data-parallel ranks).  Raises
    `UserInputError` for a mesh or batch no rank could run, the spec's own
    `check_parallelism_fn` included; an `auto` degree without a `mesh_choice` is refused.
    """
    parallelism = job_config.parallelism
    run = copy.deepcopy(job_config)
    if mesh_choice is None:
        dims = ParallelDims.from_config(parallelism, world_size)
    else:
        degrees = mesh_choice.degrees
        dims = ParallelDims(
            dp_replicate=degrees["dp_replicate"],
            dp_shard=degrees["dp_shard"],
            tp=degrees["tp"],
            world_size=world_size,
            enable_loss_parallel=not parallelism.disable_loss_parallel,
            ep=degrees.get("ep", 1),
            pp=degrees.get("pp", 1),
        )
        global_batch = search_global_batch(job_config.training, world_size)
        run.training.local_batch_size = global_batch // dims.dp_degree
        run.training.global_batch_size = global_batch
        if mesh_choice.schedule is not None:
            run.parallelism.pipeline_parallel_schedule = mesh_choice.schedule
        if mesh_choice.microbatch_size is not None:
            run.parallelism.pipeline_parallel_microbatch_size = mesh_choice.microbatch_size
    for name, option in DEGREES:
        setattr(run.parallelism, option, getattr(dims, name))
    run.parallelism.expert_parallel_degree = dims.ep
    check_expert_parallel(model_args, dims.ep, f"{job_config.model.name} {job_config.model.flavor}")
    stage_plan = None
    if dims.pp > 1:
        stage_plan = pipeline_plan(spec, model_args, run, dims.pp, world_size // dims.pp)
    if spec.check_parallelism_fn is not None:
        spec.check_parallelism_fn(model_args, dims, run)
    steps = grad_accumulation_steps(run.training, dims.dp_degree)
    local = run.training.local_batch_size
    run.training.global_batch_size = local * dims.dp_degree * steps
    return ResolvedConfig(
        world_size=world_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        local_batch_size=local,
        global_batch_size=run.training.global_batch_size,
        grad_accumulation_steps=steps,
        mesh_searched=mesh_choice is not None,
        ep=dims.ep,
        pp=dims.pp,
        stage_plan=stage_plan,
        job_config=run,
    )
