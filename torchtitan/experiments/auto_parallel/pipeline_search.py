"""Pipeline degrees in the mesh search: a candidate with `pp` > 1 planned stage by stage.

A pipelined candidate's stages are what the trainer would run on it (the spec's
`PipelineOptions.stages_for`: the schedule, the split balanced by predicted time, the
microbatches its local batch makes).  Each stage is planned as the trainer plans it
(`parallelize_auto` with `stage=`): on the candidate's dims other than `pp`, for one
microbatch over its data-parallel ranks, within its share of a rank's memory and with the
microbatches the schedule keeps in flight on it.  Stages alike (first or not, last or not,
as many blocks) are planned once, for the most microbatches any of them holds.

The candidates are planned side by side, each traced and planned in a forked child process
(`child_process.map_in_children`), as many at once as this process has cores; their results
and stage plans come back as JSON.

The candidate's step is the schedule's (`pipeline_cost.PipelineShape`): the slowest pipeline
rank's stages per microbatch, times the microbatches, plus the bubble and the sends of the
hidden states across the `pp` dim's link.  Its memory is the fullest rank's: its stages'
peaks with their microbatches in flight.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from torchtitan.autoparallel.child_process import cores, map_in_children
from torchtitan.autoparallel.errors import PlannerError
from torchtitan.autoparallel.mesh_search import CandidateResult, MeshCandidate, proven_gap
from torchtitan.autoparallel.plan.plan import Plan
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import mesh_dims
from torchtitan.distributed.pipeline import (
    PipelineOptions,
    StageIO,
    StagePlan,
    split_stages,
    stage_io,
)
from torchtitan.distributed.pipeline_cost import send_us
from torchtitan.distributed.utils import device_type
from torchtitan.errors import UserInputError
from torchtitan.experiments.auto_parallel.parallelize import (
    add_job_constraints,
    job_cost_model,
    plan_cache_folder,
    planner_for_job,
    planner_settings,
)
from torchtitan.tools.logging import logger
from torchtitan.torch_private import planning_mesh

Pins = Callable[[dict[str, tuple[int, ...]], tuple[str, ...]], dict[str, tuple]]


@dataclass(frozen=True)
class _Kind:
    """Stages planned alike: whether they hold the first or last modules, and how many
    blocks."""

    first: bool
    last: bool
    blocks: int


def plan_pipelined(
    model: nn.Module,
    pipeline: PipelineOptions,
    candidates: list[dict[str, int]],
    job_config: JobConfig,
    global_batch: int,
    vocab_size: int,
    pins: Pins | None = None,
    stage_plans: dict[str, dict[str, Plan]] | None = None,
) -> tuple[list[tuple[CandidateResult, Plan | None]], list[tuple[str, str]]]:
    """Each pipelined candidate's result under each schedule to try (no plan is kept: the
    trainer plans its stages once it runs them), and [(label, why not planned)] for those
    whose stages cannot split as the job asks.  `pins` (parameter shapes, mesh dim names
    -> placements) pins each stage's parameters, to price a hand-written configuration;
    `stage_plans` receives each candidate's stage plans ({candidate label: {stages: plan}})."""
    tasks: list[tuple[dict[str, int], MeshCandidate, StagePlan, int, int]] = []
    skipped: list[tuple[str, str]] = []
    for degrees in candidates:
        mesh = MeshCandidate(*zip(*mesh_dims(**degrees)))
        local_batch = global_batch // (degrees["dp_replicate"] * degrees["dp_shard"])
        sizes = pipeline.microbatch_sizes(local_batch, degrees["pp"])
        for schedule, microbatch in itertools.product(pipeline.schedules, sizes):
            searched = microbatch if pipeline.microbatch_size is None else 0
            label = CandidateResult(mesh, schedule=schedule, microbatch_size=searched).label()
            try:
                stages = pipeline.stages_for(degrees, local_batch, schedule, microbatch)
            except UserInputError as e:
                skipped.append((label, str(e)))
                continue
            tasks.append((degrees, mesh, stages, microbatch, searched))

    def plan(task: tuple[dict[str, int], MeshCandidate, StagePlan, int, int]) -> str:
        degrees, mesh, stages, microbatch, searched = task
        t0 = time.perf_counter()
        try:
            result, plans = _plan_candidate(
                model, pipeline, stages, degrees, mesh, job_config, vocab_size, pins, microbatch
            )
        except UserInputError as e:  # raised as itself here, the trainer's one-line error
            return json.dumps({"user_input_error": str(e)})
        result.microbatch_size = searched
        result.plan_s = time.perf_counter() - t0
        as_json = {which: json.loads(p.to_json()) for which, p in plans.items()}
        return json.dumps({"result": result.to_dict(), "plans": as_json})

    # each candidate traced and planned in a forked child, side by side
    planned: list[tuple[CandidateResult, Plan | None]] = []
    for answer in map_in_children([partial(plan, t) for t in tasks], cores()):
        if isinstance(answer, Exception):
            raise answer
        data = json.loads(answer)
        if "user_input_error" in data:
            raise UserInputError(data["user_input_error"])
        result = CandidateResult.from_dict(data["result"])
        if stage_plans is not None:
            stage_plans[result.label()] = {
                which: Plan.from_json(json.dumps(p)) for which, p in data["plans"].items()
            }
        logger.info(
            f"mesh {result.label()}: "
            + (f"step {result.step_us / 1e3:.2f} ms" if result.fits else result.note)
            + f" ({result.detail}) in {result.plan_s:.1f}s"
        )
        planned.append((result, None))
    return planned, skipped


def _plan_candidate(
    model: nn.Module,
    pipeline: PipelineOptions,
    stages: StagePlan,
    degrees: dict[str, int],
    mesh: MeshCandidate,
    job_config: JobConfig,
    vocab_size: int,
    pins: Pins | None,
    microbatch: int,
) -> tuple[CandidateResult, dict[str, Plan]]:
    """The candidate's result (`microbatch` sequences per microbatch), and its stages'
    plans by the stages they stand for."""
    pp = degrees["pp"]
    inner = MeshCandidate(*zip(*mesh_dims(**{**degrees, "pp": 1})))
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    tokens = torch.zeros((microbatch, job_config.training.seq_len), dtype=torch.long)
    io = stage_io(model, pipeline.split, stages, tokens, pp)
    kinds = [_Kind(io[s].first, io[s].last, len(stages.blocks[s])) for s in range(stages.stages)]
    result = CandidateResult(mesh, detail=stages.describe(short=True), schedule=stages.schedule)
    plans: dict[_Kind, Plan] = {}
    for kind in dict.fromkeys(kinds):
        alike = [s for s in range(stages.stages) if kinds[s] == kind]
        held = max(io[s].in_flight for s in alike)
        try:
            part = _stage_module(model, pipeline, stages, alike[0], pp)
            vocab = vocab_size if kind.first else 0
            plans[kind] = _plan_stage(part, io[alike[0]], held, inner, dp, job_config, vocab, pins)
        except PlannerError as e:
            result.note = f"stage {alike[0]}: {str(e).splitlines()[0]}"
            return result, {}
    rank_stages = [stages.stages_of(r, pp) for r in range(pp)]
    rank_us = [sum(plans[kinds[s]].predicted["step_us"] for s in ss) for ss in rank_stages]
    comm_us = [sum(plans[kinds[s]].predicted["exposed_comm_us"] for s in ss) for ss in rank_stages]
    peaks = [sum(_held_bytes(plans[kinds[s]]) for s in ss) for ss in rank_stages]
    link = job_cost_model(planner_settings(job_config).cost_model).mesh_links((pp, *inner.shape))[0]
    (hidden,) = io[0].outputs
    send = send_us(hidden.numel() * hidden.element_size(), link.latency_us, link.bw_gbps)
    shape = stages.shape(pp)
    slowest = max(range(pp), key=lambda r: rank_us[r])
    result.predicted = {
        "step_us": shape.step_us(rank_us, send),
        "exposed_comm_us": shape.microbatches * comm_us[slowest] + shape.sends_us(send),
        "peak_bytes_per_rank": max(peaks),
        "bubble_us": shape.bubble_us(rank_us),
        "sends_us": shape.sends_us(send),
        "microbatches": float(shape.microbatches),
    }
    result.objective = result.predicted["step_us"]
    gaps = [proven_gap(p) for p in plans.values()]
    known = [g for g in gaps if g is not None]
    result.gap = max(known) if known and len(known) == len(gaps) else None
    recompute: Counter[str] = Counter()
    for kind, plan in plans.items():
        for policy in plan.recompute.values():
            recompute[policy] += kinds.count(kind)
    result.detail += (
        f"; bubble {result.predicted['bubble_us'] / 1e3:.2f} ms, sends "
        f"{result.predicted['sends_us'] / 1e3:.2f} ms"
        + (f"; blocks recomputed: {_counted(recompute)}" if recompute else "")
    )
    by_stages = {}
    for kind, plan in plans.items():
        alike = [s for s in range(stages.stages) if kinds[s] == kind]
        which = f"stage {alike[0]}" if len(alike) == 1 else f"stages {', '.join(map(str, alike))}"
        each = " each" if len(alike) > 1 else ""
        by_stages[f"{which} ({kind.blocks} blocks{each})"] = plan
    return result, by_stages


def _stage_module(
    model: nn.Module, pipeline: PipelineOptions, stages: StagePlan, stage: int, pp: int
) -> nn.Module:
    """The meta-device module of `stage` (the model holding that stage's blocks only)."""
    parts = split_stages(model, pipeline.split, stages, stages.rank_of(stage, pp), pp)
    return parts.parts[parts.stage_ids.index(stage)]


def _plan_stage(
    part: nn.Module,
    io: StageIO,
    in_flight: float,
    inner: MeshCandidate,
    dp: int,
    job_config: JobConfig,
    vocab_size: int,
    pins: Pins | None,
) -> Plan:
    """A stage's module planned as the trainer plans it (`parallelize_auto`) on `inner`,
    for one microbatch over its `dp` data-parallel ranks."""
    mesh = planning_mesh(device_type(), inner.shape, inner.names)
    batch = io.inputs[0].shape[0] * dp
    with planner_for_job(part, mesh, job_config, vocab_size, batch, io) as autop:
        add_job_constraints(autop, inner.names, False, job_config, io.stages_per_rank, in_flight)
        if pins is not None:
            shapes = {f: tuple(s) for f, s in autop.param_shapes().items()}
            for name, placements in pins(shapes, inner.names).items():
                autop.add_parameter_constraint(name, placements)
        return autop.optimize_placement(cache_dir=plan_cache_folder(job_config))


def _counted(counts: Counter[str]) -> str:
    """`60 full, 3 none`."""
    return ", ".join(f"{n} {what}" for what, n in counts.most_common())


def _held_bytes(plan: Plan) -> float:
    """A stage's peak bytes per rank with its microbatches in flight."""
    p = plan.predicted
    return p.get("in_flight_peak_bytes_per_rank", p.get("peak_bytes_per_rank", math.nan))
