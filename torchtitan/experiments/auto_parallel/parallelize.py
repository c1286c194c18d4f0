"""Hand the meta-device model and the job's mesh to the planner; return its parallel module.

Mesh: the trainer's mesh as is — any of `dp_replicate`, `dp_shard`, `tp` with size > 1 —
so the parallelism degrees directly shape the planner's search space.  Every data-parallel
dim carries the batch (`Shard(0)` on inputs and outputs), `tp` sees the whole batch
(`Replicate`), and with loss parallelism the logits leave split along the vocabulary
(`Shard(2)` on `tp`).  A replicate dim is just another batch dim to the planner: it may
replicate parameters there (HSDP/DDP-like) or shard them, whichever the cost model prefers
under the memory budget.

Planning happens once, on rank 0, and the plan is broadcast (a time-limited solve could
differ between ranks).  It is cached as JSON under `{dump_folder}/plans/` (the library's
plan/cache.py: keyed by the traced graph, mesh, constraints, precision and cost model) and
reused on restart, unless `--autoparallel.no_plan_cache`; with `--autoparallel.plan_file`
the plan comes from that file instead (steering.py); `[autoparallel]` (job_config.py)
holds the planner's other settings.  When the mesh search chose the mesh
(mesh_choice.py), its plan for that mesh comes with it (`SearchedPlan`) and is applied
from the search's own trace: the chosen mesh is neither traced nor solved again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.autoparallel import AutoParallel, Plan, PlannerError
from torchtitan.autoparallel.cost.model import DEVICES, CostModel
from torchtitan.autoparallel.errors import InfeasiblePlanError
from torchtitan.autoparallel.plan.display import plan_summary
from torchtitan.autoparallel.solve.constraints import MemoryBudget
from torchtitan.autoparallel.trace.repeat import MIN_BLOCKS
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import EP, ParallelDims
from torchtitan.distributed.pipeline import StageIO
from torchtitan.distributed.utils import (
    TORCH_DTYPES,
    device_type,
    ranks_per_node,
    resolve_param_dtype,
)
from torchtitan.errors import UserInputError
from torchtitan.experiments.auto_parallel.job_config import AutoParallelConfig, parameter_fraction
from torchtitan.experiments.auto_parallel.memory_check import check_plan_fits, memory_per_rank
from torchtitan.experiments.auto_parallel.pins import job_pins, match_pins
from torchtitan.experiments.auto_parallel.steering import job_plan_file
from torchtitan.protocols.train_spec import MeshChoice
from torchtitan.tools.heap import give_back_freed_heap
from torchtitan.tools.logging import logger


@dataclass(frozen=True)
class SearchedPlan:
    """The mesh search's plan for the mesh it chose (`MeshChoice.plan` of this spec): the
    planner that traced the model (entered, on a planning mesh of that shape) and the plan
    it solved there, applied on the job's mesh as is."""

    planner: AutoParallel
    plan: Plan


def _batch_placements(mesh_dim_names: tuple[str, ...], tp_placement) -> list:
    return [tp_placement if name == "tp" else Shard(0) for name in mesh_dim_names]


def job_cost_model(setting: str) -> CostModel:
    """The cost model of `--autoparallel.cost_model` (a device name, or auto: the device this
    job runs on) with this launch's node size, so that each mesh dim is priced with the link
    it really uses (`CostModel.within_node`)."""
    if setting != "auto":
        name = setting.lower()
    elif device_type() != "cuda":
        name = "cpu"
    else:
        gpu = torch.cuda.get_device_name().lower()
        name = next((d for d in DEVICES if d != "cpu" and d in gpu), "h100")
    return CostModel.for_device(name, gpus_per_node=ranks_per_node())


def parallelize_llama_auto(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    mesh_choice: MeshChoice | None = None,
    stage: StageIO | None = None,
) -> nn.Module:
    embeddings = cast(nn.Embedding | None, model.tok_embeddings)  # None: a later stage
    vocab_size = embeddings.num_embeddings if embeddings is not None else 0
    return parallelize_auto(model, parallel_dims, job_config, vocab_size, mesh_choice, stage)


def parallelize_hf_auto(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    mesh_choice: MeshChoice | None = None,
) -> nn.Module:
    embeddings = cast(Callable[[], nn.Embedding], model.get_input_embeddings)
    vocab_size = embeddings().num_embeddings
    return parallelize_auto(model, parallel_dims, job_config, vocab_size, mesh_choice)


def parallelize_auto(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    vocab_size: int,
    mesh_choice: MeshChoice | None = None,
    stage: StageIO | None = None,
) -> nn.Module:
    """Plan and apply `model` (token ids of `vocab_size` in, logits out) on the job's mesh;
    with the mesh search's `mesh_choice`, apply the plan it made for this mesh.  A pipeline
    `stage` is planned on the mesh's other dims for what it takes and gives (hidden states
    after the first stage, before the last), a microbatch at a time."""
    searched = mesh_choice.plan if mesh_choice is not None else None
    try:
        parallel_model = _parallelize(model, parallel_dims, job_config, vocab_size, searched, stage)
    except PlannerError as e:  # raised alike on every rank (on_rank0): the trainer's one line
        raise planner_error(e, job_config) from None
    give_back_freed_heap()  # the planner's working set is garbage now (tools/heap.py)
    return parallel_model


def planner_error(e: PlannerError, job_config: JobConfig) -> UserInputError:
    """The trainer's one line for a planner error; when no plan fits the memory a rank has
    (the default budget), it says where that figure comes from and what lowers the need."""
    line = f"auto-parallel planner: {e}"
    fits_nothing = isinstance(e, InfeasiblePlanError) and MemoryBudget.LABEL in str(e)
    if fits_nothing and planner_settings(job_config).memory_budget_gib is None:
        available, source = memory_per_rank()
        line += (
            f"; the budget is what a rank has, {available / 2**30:.1f} GiB ({source}), less "
            f"{MEMORY_MARGIN:.0%}: lower the need with --activation_checkpoint.mode auto (the "
            "planner recomputes blocks to fit) or full, more ranks, or a smaller "
            "--training.local_batch_size or --training.seq_len"
        )
    return UserInputError(line)


def planner_for_job(
    model: nn.Module,
    mesh,
    job_config: JobConfig,
    vocab_size: int,
    global_batch: int,
    stage: StageIO | None = None,
) -> AutoParallel:
    """The planner for this job's model and precision on `mesh` (not yet entered); for a
    pipeline `stage` after the first, its input is the hidden states it receives.  Rank 0
    plans and the others receive its plan, so the planning trace is made where it is
    needed (in rank 0's planning process), not on entering."""
    training = job_config.training
    settings = planner_settings(job_config)

    def input_fn():
        if stage is not None and not stage.first:
            (hidden,) = stage.inputs
            shape = (global_batch, *hidden.shape[1:])
            return torch.randn(shape, dtype=hidden.dtype, requires_grad=True)
        return torch.randint(0, vocab_size, (global_batch, training.seq_len), dtype=torch.long)

    mp_policy = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(training.mixed_precision_param),
        reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
    )
    return AutoParallel(
        model,
        input_fn,
        mesh,
        mp_policy=mp_policy,
        cost_model=job_cost_model(settings.cost_model),
        solver_time_limit=settings.solver_time_limit_seconds,
        solver_proof_limit=settings.solver_proof_limit_seconds,
        reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        block_containers=(stage.container,) if stage is not None and stage.container else (),
        trace_on_enter=False,
    )


def planner_settings(job_config: JobConfig) -> AutoParallelConfig:
    return getattr(job_config, "autoparallel", None) or AutoParallelConfig()


def add_job_constraints(
    autop: AutoParallel,
    names: tuple[str, ...],
    loss_parallel: bool,
    job_config: JobConfig,
    memory_share: int = 1,
    in_flight: float = 1.0,
) -> None:
    """The job's constraints: the memory budget (a rank's, shared by the `memory_share`
    pipeline stages it holds, each holding `in_flight` microbatches' activations), the
    parameter fraction if one is set, the batch split over every data-parallel dim, logits
    split over tp with loss parallelism, the routed experts split over the `ep` dim when
    the job has one, the `--autoparallel.pin` placements."""
    settings = planner_settings(job_config)
    autop.set_recompute(job_recompute(job_config, autop))
    fraction = parameter_fraction(settings.max_parameter_fraction, autop.mesh.size())
    if fraction is not None:
        autop.add_parameter_memory_constraint(low=None, high=fraction)
    if EP in names:  # --parallelism.expert_parallel_degree: the experts split over `ep`
        autop.add_expert_parallel_constraint(EP)
    autop.add_memory_constraint(memory_budget_bytes(job_config) / memory_share, in_flight)
    autop.add_input_constraints([_batch_placements(names, Replicate())])
    autop.add_output_constraints(
        [_batch_placements(names, Shard(2) if loss_parallel else Replicate())]
    )
    mesh = list(zip(names, autop.mesh.shape))
    for name, placements in match_pins(job_pins(job_config), autop.param_shapes(), mesh).items():
        autop.add_parameter_constraint(name, placements)


def job_recompute(job_config: JobConfig, autop: AutoParallel) -> str | dict[str, str]:
    """`[activation_checkpoint]` as the planner's recompute setting: none, full, auto;
    selective with "op" keeps matmul and attention outputs and recomputes the rest of every
    block, with an integer N it recomputes every Nth block of each repeated stack fully (as
    the hand-written path does)."""
    ac = job_config.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode
    option = ac.selective_ac_option
    if option == "op":
        return "selective"
    if not (option.isdigit() and int(option) >= 1):
        raise UserInputError(
            f"--activation_checkpoint.selective_ac_option {option!r}: use 'op' or a positive "
            "integer N (checkpoint every Nth block)"
        )
    if not autop.blocks:
        raise UserInputError(
            f"--activation_checkpoint.selective_ac_option {option}: recomputes every Nth block "
            "of a stack of repeated blocks, and the planner found none in this model (a stack "
            f"is {MIN_BLOCKS} or more structurally identical children of a ModuleList, "
            "ModuleDict or Sequential): use 'op', or --activation_checkpoint.mode full or auto"
        )
    every = int(option)
    return {
        f"{b.container}#{i}": "full"
        for b in autop.blocks
        for i in range(len(b.keys))
        if i % every == 0
    }


# What the memory model leaves out (allocator fragmentation, temporaries inside an op,
# communication buffers) is kept free when the budget is not given.
MEMORY_MARGIN = 0.1


def memory_budget_bytes(job_config: JobConfig) -> float:
    """`--autoparallel.memory_budget_gib`; unset: what a rank has (`memory_per_rank`) less
    `MEMORY_MARGIN`."""
    gib = planner_settings(job_config).memory_budget_gib
    if gib is not None:
        return gib * 2**30
    available, _source = memory_per_rank()
    return available * (1.0 - MEMORY_MARGIN)


def plan_cache_folder(job_config: JobConfig) -> Path | None:
    """{dump_folder}/plans, or None with `--autoparallel.no_plan_cache`."""
    if not planner_settings(job_config).plan_cache:
        return None
    return Path(job_config.job.dump_folder) / "plans"


def _parallelize(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    vocab_size: int,
    searched: SearchedPlan | None,
    stage: StageIO | None,
) -> nn.Module:
    mesh = parallel_dims.world_mesh
    names = tuple(mesh.mesh_dim_names or ())
    loss_parallel = parallel_dims.loss_parallel_enabled
    global_batch = job_config.training.local_batch_size * parallel_dims.dp_degree
    if stage is not None:  # planned on its stage's ranks, a microbatch at a time
        names = tuple(n for n in names if n != "pp")
        mesh = mesh[names]
        global_batch = stage.inputs[0].shape[0] * parallel_dims.dp_degree
        if loss_parallel and stage.last:
            logger.info(
                "auto-parallel: a pipeline's last stage hands the schedule whole logits; "
                "the loss is not vocabulary-parallel"
            )
        loss_parallel = False
    start = time.perf_counter()
    if searched is not None:
        if searched.planner.model is not model:
            raise RuntimeError("the mesh search planned another model than the one to apply")
        # the search's trace and settings on the real mesh; the constraints as when solved
        autop = searched.planner.on_mesh(mesh)
        add_job_constraints(autop, names, loss_parallel, job_config)
        plan = searched.plan
        check_plan_fits(plan)
        parallel_model = autop.apply_placement(plan)
        logger.info(
            "auto-parallel: applied the plan the mesh search made for this mesh, from its trace "
            f"(no solve) in {time.perf_counter() - start:.1f}s; "
            f"{autop.cost_model.node_layout(mesh.shape, names)}\n{plan_summary(plan)}"
        )
    else:
        with planner_for_job(model, mesh, job_config, vocab_size, global_batch, stage) as autop:
            share, in_flight = (stage.stages_per_rank, stage.in_flight) if stage else (1, 1.0)
            add_job_constraints(autop, names, loss_parallel, job_config, share, in_flight)
            cache_dir = plan_cache_folder(job_config)
            # solved in a child process: this one trains next, without the planner's heap
            if path := job_plan_file(job_config):
                plan = autop.plan_from_file(
                    path, broadcast=True, cache_dir=cache_dir, in_child=True
                )
            else:
                plan = autop.optimize_placement(broadcast=True, cache_dir=cache_dir, in_child=True)
            check_plan_fits(plan)
            parallel_model = autop.apply_placement(plan)
            layout = autop.cost_model.node_layout(mesh.shape, names)
        elapsed = time.perf_counter() - start
        what = f" of pipeline {stage.describe()}" if stage is not None else ""
        logger.info(
            f"auto-parallel planning{what} took {elapsed:.1f}s; {layout}\n{plan_summary(plan)}"
        )

    if job_config.compile.enable and "model" in job_config.compile.components:
        # One graph for the whole model: its collectives are what inductor's comms
        # passes (bucketing, reordering; see [compile]) work on.
        parallel_model.compile()
        logger.info("the auto-parallel module's lowered graphs will be compiled by inductor")

    if loss_parallel:
        tp_mesh = mesh["tp"]

        def vocab_sharded_logits(module, args, output):
            # The trainer's loss_parallel() context computes cross-entropy on this DTensor.
            return DTensor.from_local(output, tp_mesh, [Shard(2)], run_check=False)

        parallel_model.register_forward_hook(vocab_sharded_logits)
    return parallel_model
