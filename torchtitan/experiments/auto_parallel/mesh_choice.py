"""`--parallelism.tensor_parallel_degree auto` (and the other degrees): the spec's mesh search.

The candidates are the factorisations of the world into the degrees left open (`auto`, and
the shard degree's -1 next to an `auto`), as `ParallelDims` would lay them out — each with
every expert-parallel degree to try when that is `auto` (`ep` dividing the shard degree and
the routed experts) — minus those
the model or machine rules out: a tp degree must pass `tensor_parallel_misfits` (the rule
the hand-written spec's check applies too: heads, hidden sizes, the vocabulary with loss
parallelism, the sequence) and stay within one node (`CostModel.gpus_per_node`, when the
profile says `tp_within_node`); the data-parallel degree must divide the global batch,
which is the same for every candidate.  Rank 0's planning process traces the model once
and plans each candidate from that trace with the job's own constraints
(`autoparallel.mesh_search`; candidates that differ only in their dims' names are one
program, solved once; the distinct programs are solved side by side, one forked process
each, as many at once as the planning process has cores); meanwhile every rank traces
the whole model, and every rank receives the choice and its plan, which `parallelize_auto`
applies to that trace without solving again (`SearchedPlan`).  With the plan cache on,
every candidate's plan is cached, so a restart makes the same choice without solving.
"""

from __future__ import annotations

import contextlib

from torch import nn

from torchtitan.autoparallel.api import AutoParallel, on_rank0
from torchtitan.autoparallel.child_process import run_in_child
from torchtitan.autoparallel.errors import PlannerError
from torchtitan.autoparallel.mesh_search import (
    MeshCandidate,
    MeshSearch,
    choose,
    factorisations,
    plan_candidates,
)
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import (
    ParallelismConfigError,
    expert_parallel_candidates,
    mesh_dims,
    open_degrees,
    tensor_parallel_misfits,
)
from torchtitan.distributed.pipeline import PipelineOptions
from torchtitan.distributed.utils import device_type
from torchtitan.experiments.auto_parallel.parallelize import (
    SearchedPlan,
    add_job_constraints,
    job_cost_model,
    plan_cache_folder,
    planner_error,
    planner_for_job,
    planner_settings,
)
from torchtitan.experiments.auto_parallel.pipeline_search import plan_pipelined
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import MeshChoice
from torchtitan.tools.logging import logger
from torchtitan.torch_private import planning_mesh


def choose_mesh_llama_auto(
    model,  # the meta model: its input embedding gives the vocabulary
    model_args: BaseModelArgs,
    job_config: JobConfig,
    world_size: int,
    global_batch: int,
    pipeline: PipelineOptions | None = None,
) -> MeshChoice:
    vocab = model.tok_embeddings.num_embeddings
    return choose_mesh(model, model_args, job_config, world_size, global_batch, vocab, pipeline)


def choose_mesh_hf_auto(
    model,  # the meta model: its input embedding gives the vocabulary
    model_args: BaseModelArgs,
    job_config: JobConfig,
    world_size: int,
    global_batch: int,
    pipeline: PipelineOptions | None = None,
) -> MeshChoice:
    vocab = model.get_input_embeddings().num_embeddings
    return choose_mesh(model, model_args, job_config, world_size, global_batch, vocab, pipeline)


def candidate_degrees(
    parallelism,
    world_size: int,
    global_batch: int,
    tp_sizes: dict[str, int],
    seq_len: int,
    gpus_per_node: int | None,
) -> tuple[list[dict[str, int]], list[tuple[dict[str, int], str]]]:
    """(degrees worth planning, [(degrees, why not)]) for this world and model."""
    keep, skipped = [], []
    for degrees in factorisations(world_size, list(open_degrees(parallelism).items())):
        tp, dp = degrees["tp"], degrees["dp_replicate"] * degrees["dp_shard"]
        bad = tensor_parallel_misfits(
            tp_sizes, tp, seq_len, loss_parallel=not parallelism.disable_loss_parallel
        )
        if bad:
            skipped.append((degrees, f"tp {tp} does not divide {', '.join(bad)}"))
        elif gpus_per_node is not None and tp > gpus_per_node:
            skipped.append((degrees, f"tp {tp} spans nodes of {gpus_per_node}"))
        elif global_batch % dp:
            skipped.append((degrees, f"dp {dp} does not divide the global batch {global_batch}"))
        else:
            keep.append(degrees)
    return keep, skipped


def with_expert_parallel(
    keep: list[dict[str, int]], setting, routed_experts: int
) -> tuple[list[dict[str, int]], list[tuple[dict[str, int], str]]]:
    """Each kept candidate once per expert-parallel degree to try (`ep` in its degrees)."""
    out, skipped = [], []
    for degrees in keep:
        eps = expert_parallel_candidates(degrees["dp_shard"], routed_experts, setting)
        if not eps:
            skipped.append(
                (degrees, f"ep {setting} does not divide dp_shard {degrees['dp_shard']}")
            )
        out += [{**degrees, "ep": ep} for ep in eps]
    return out, skipped


def _job_candidates(
    model_args: BaseModelArgs,
    job_config: JobConfig,
    world_size: int,
    global_batch: int,
    can_pipeline: bool,
) -> tuple[list[dict[str, int]], list[dict[str, int]], list[tuple[dict[str, int], str]]]:
    """The job's candidate degrees without and with pipeline stages, and those ruled out
    with the reason; a `ParallelismConfigError` when none is left."""
    parallelism = job_config.parallelism
    cost_model = job_cost_model(planner_settings(job_config).cost_model)
    keep, skipped = candidate_degrees(
        parallelism,
        world_size,
        global_batch,
        model_args.tensor_parallel_sizes(),
        job_config.training.seq_len,
        cost_model.gpus_per_node if cost_model.tp_within_node else None,
    )
    keep, no_ep = with_expert_parallel(
        keep, parallelism.expert_parallel_degree, model_args.routed_experts()
    )
    skipped += no_ep
    flat = [d for d in keep if d["pp"] == 1]
    piped = [d for d in keep if d["pp"] > 1]
    if piped and not can_pipeline:
        skipped += [(d, "the spec cannot pipeline this model") for d in piped]
        piped = []
    if not flat and not piped:
        why = "; ".join(f"{_label(d)}: {reason}" for d, reason in skipped) or "none"
        raise ParallelismConfigError(
            f"mesh search: no mesh of world {world_size} suits this model ({why})"
        )
    return flat, piped, skipped


def _label(degrees: dict[str, int]) -> str:
    return MeshCandidate(*zip(*mesh_dims(**degrees))).label()


def choose_mesh(
    model: nn.Module,
    model_args: BaseModelArgs,
    job_config: JobConfig,
    world_size: int,
    global_batch: int,
    vocab_size: int,
    pipeline: PipelineOptions | None = None,
) -> MeshChoice:
    """The degrees (`pp`, `dp_replicate`, `dp_shard`, `tp`, `ep`) of the cheapest candidate
    mesh (`search_job_meshes`), and for a mesh without pipeline stages its plan with the
    planner that traced the model (`SearchedPlan`, for `parallelize_auto`; a pipelined
    mesh's stages are planned when the trainer builds them, its schedule comes with it);
    call on every rank (rank 0 searches, the others receive its answer)."""
    try:
        result, degrees, planner = search_job_meshes(
            model, model_args, job_config, world_size, global_batch, vocab_size, pipeline
        )
    except PlannerError as e:  # raised alike on every rank (on_rank0): the trainer's one line
        raise planner_error(e, job_config) from None
    logger.info(f"{result.verdict()}\n{result.table()}")
    if degrees["pp"] > 1:  # its stages are planned as the trainer builds them
        best = result.best
        return MeshChoice(
            degrees, schedule=best.schedule, microbatch_size=best.microbatch_size or None
        )
    if result.plan is None or planner is None:  # choose keeps the chosen candidate's plan
        raise RuntimeError("mesh search: the chosen mesh came without its plan")
    return MeshChoice(degrees, SearchedPlan(planner, result.plan))


def search_job_meshes(
    model: nn.Module,
    model_args: BaseModelArgs,
    job_config: JobConfig,
    world_size: int,
    global_batch: int,
    vocab_size: int,
    pipeline: PipelineOptions | None = None,
    stage_plans: dict | None = None,
) -> tuple[MeshSearch, dict[str, int], AutoParallel | None]:
    """Every candidate planned and the cheapest chosen: the search, the chosen degrees,
    and the planner holding the job's one trace of the whole model (None when every
    candidate is pipelined); `stage_plans` receives the pipelined candidates' stage plans
    when the search runs in this process (`plan_pipelined`)."""
    parallelism = job_config.parallelism
    flat, piped, skipped = _job_candidates(
        model_args, job_config, world_size, global_batch, pipeline is not None
    )
    by_mesh = {MeshCandidate(*zip(*mesh_dims(**d))): d for d in [*flat, *piped]}
    planner = None

    def search() -> str:
        planned = []
        if planner is not None:
            planned = plan_candidates(
                planner,
                [MeshCandidate(*zip(*mesh_dims(**d))) for d in flat],
                lambda sub, cand: add_job_constraints(
                    sub,
                    cand.names,
                    cand.size("tp") > 1 and not parallelism.disable_loss_parallel,
                    job_config,
                ),
                cache_dir=plan_cache_folder(job_config),
                device_type=device_type(),
            )
        not_planned = [(_label(d), why) for d, why in skipped]
        if piped:
            assert pipeline is not None
            more, unsplit = plan_pipelined(
                model, pipeline, piped, job_config, global_batch, vocab_size, None, stage_plans
            )
            planned += more
            not_planned += unsplit
        result = choose(
            planned,
            tie_break=lambda cand: (cand.size("pp"), cand.size("tp")),
            skipped=not_planned,
        )
        return result.to_json()  # with the chosen plan, for every rank

    if flat:
        first = MeshCandidate(*zip(*mesh_dims(**flat[0])))
        mesh = planning_mesh(device_type(), first.shape, first.names)
        planner = planner_for_job(model, mesh, job_config, vocab_size, global_batch)
    # the job's one trace: rank 0 plans every candidate from it, and every rank
    # applies the chosen plan from it (`parallelize_auto`)
    # Without pipelined candidates (whose stage plans must come back into this process,
    # `stage_plans`) the search runs in a child process, whose heap goes with it, and every
    # rank meanwhile traces the whole model, which the chosen plan is applied to.
    with planner if planner is not None else contextlib.nullcontext():
        if planner is not None and not piped:
            meanwhile = planner.trace_for_apply

            def search_in_child() -> str:
                return run_in_child(search, meanwhile)

            result = MeshSearch.from_json(on_rank0(search_in_child, meanwhile=meanwhile))
        else:
            result = MeshSearch.from_json(on_rank0(search))
    return result, by_mesh[result.best.mesh], planner
