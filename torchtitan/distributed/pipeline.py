"""Pipeline parallelism: the model's blocks cut into consecutive stages, one or more per
rank of the `pp` mesh dim, microbatches driven through them by a schedule of
`torch.distributed.pipelining` (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, ...).

A spec makes its model pipelinable by naming its split (`PipelineSplit`): the modules run
before the blocks (only the first stage keeps them), the container of the blocks (an
`nn.ModuleDict`, so the blocks keep their names when some are removed), and the modules
run after them (only the last stage).  The model's forward skips a module that is None and
takes hidden states in when its input module is gone — nothing else about pipelining.

Each stage is a copy of the meta-device model holding its blocks only, parallelised by the
spec's own `parallelize_fn` (FSDP, TP) like a whole model.  Initialisation gives every
stage exactly what one process draws: the stage's missing modules are put back, allocated
for the while, around the model's own `init_weights`, so the random generator advances as
in one process (`PipelineStages.whole_model`; it costs the rest of the model's size in
memory once, during initialisation).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from torchtitan.distributed.pipeline_cost import PipelineShape
from torchtitan.errors import UserInputError

SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)
_V_SHAPED = ("ZBVZeroBubble",)  # rank r holds stages r and 2·pp − 1 − r
# what `--parallelism.pipeline_parallel_schedule auto` lets the mesh search choose from: the
# schedules of torchtitan's published pipelined runs (one stage per rank, and interleaved)
AUTO_SCHEDULES = ("1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class PipelineSplit:
    """Where a model may be cut (see the module docstring): module names on the model."""

    first: tuple[str, ...]
    """Modules run before the blocks (the first stage keeps them), e.g. the embeddings."""
    blocks: str
    """The `nn.ModuleDict` of the repeated blocks, run in order."""
    last: tuple[str, ...]
    """Modules run after the blocks (the last stage keeps them), e.g. final norm, output."""


@dataclass(frozen=True)
class StageMemory:
    """What a stage must hold, per part of the model (the modules before the blocks, one
    block, the modules after them), in bytes: its training state (parameters, gradients,
    optimizer state), and what it saves for backward per microbatch; and the memory of a
    rank (`budget_bytes`) and how many ranks share a stage (`stage_ranks`: its state can be
    sharded over them, no further)."""

    state: tuple[float, float, float]
    saved: tuple[float, float, float]
    budget_bytes: float
    stage_ranks: int = 1


@dataclass(frozen=True)
class StageCosts:
    """Predicted time of a model's parts (µs per microbatch): the modules before the
    blocks, one block, the modules after them; and, when known, their memory."""

    first: float
    block: float
    last: float
    memory: StageMemory | None = None


@dataclass(frozen=True)
class StagePlan:
    """The blocks of every stage, and which stages each pipeline rank holds."""

    schedule: str
    blocks: list[list[int]]  # stage -> positions of its blocks in the container
    microbatches: int
    costs: StageCosts | None = None  # what the split balanced, when it was by cost

    def describe(self, short: bool = False) -> str:
        """`1F1B, 2 stages of 3/3 blocks, 4 microbatches` and what the split balanced; `short`:
        the stages and microbatches only."""
        text = (
            f"{self.stages} stages of {'/'.join(str(len(b)) for b in self.blocks)} blocks, "
            f"{self.microbatches} microbatches"
        )
        if short:
            return text
        text = f"{self.schedule}, {text}"
        if self.costs is not None:
            c = self.costs
            text += (
                f" (cut by predicted time per microbatch: first modules {c.first / 1e3:.2f} "
                f"ms, a block {c.block / 1e3:.2f} ms, last modules {c.last / 1e3:.2f} ms"
            )
            if c.memory is not None:
                m = c.memory
                text += (
                    f"; and by memory: a block's state {m.state[1] / 2**30:.3g} GiB over "
                    f"{m.stage_ranks} rank(s), {m.saved[1] / 2**20:.4g} MiB saved per "
                    f"microbatch, {m.budget_bytes / 2**30:.4g} GiB per rank"
                )
            text += ")"
        return text

    @property
    def stages(self) -> int:
        return len(self.blocks)

    def stages_of(self, pp_rank: int, pp: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds, in order."""
        return [s for s in range(self.stages) if self.rank_of(s, pp) == pp_rank]

    def rank_of(self, stage: int, pp: int) -> int:
        """The pipeline rank holding `stage`."""
        return _rank_of(self.shape(pp), stage)

    def shape(self, pp: int) -> PipelineShape:
        """The schedule's shape, for pricing (pipeline_cost.py)."""
        return PipelineShape(self.schedule, pp, self.stages // pp, self.microbatches)


@dataclass(frozen=True)
class PipelineOptions:
    """What a mesh search needs to try pipeline degrees: where the model is cut, the
    stages the job would run on a mesh of `degrees` (`pp` and the dims each stage is
    shared by), a local batch of `local_batch`, a schedule and a microbatch size
    (`stages_for(degrees, local_batch, schedule, microbatch_size)`; a `UserInputError`
    where they cannot split so), the schedules to try (the job's, or `AUTO_SCHEDULES` for
    auto), and the job's microbatch size (None: auto, see `microbatch_sizes`)."""

    split: PipelineSplit
    stages_for: Callable[[dict[str, int], int, str, int], StagePlan]
    schedules: tuple[str, ...]
    microbatch_size: int | None = 1

    def microbatch_sizes(self, local_batch: int, pp: int) -> list[int]:
        """The microbatch sizes to try: the job's, or for auto every size that divides
        `local_batch` into at least `pp` microbatches (fewer leave a pipeline rank idle
        all step), 1 at the least."""
        if self.microbatch_size is not None:
            return [self.microbatch_size]
        sizes = [s for s in range(1, local_batch + 1) if local_batch % s == 0]
        return [s for s in sizes if local_batch // s >= pp] or [1]


def schedule_class(name: str) -> type:
    """torch's schedule class called `name` (case as torch spells it or not)."""
    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_schedule {name!r}: no such schedule in "
            f"torch.distributed.pipelining; choose one of {', '.join(SCHEDULES)}"
        ) from None
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise UserInputError(
            f"--parallelism.pipeline_parallel_schedule {name!r} is an abstract base; choose "
            f"one of {', '.join(SCHEDULES)}"
        )
    return cls


def plan_stages(
    n_blocks: int,
    pp: int,
    schedule: str,
    layers_per_stage: int | None,
    local_batch: int,
    microbatch_size: int,
    model: str,
    split_points: Sequence[int] = (),
    costs: StageCosts | None = None,
) -> StagePlan:
    """The stages of a model of `n_blocks` blocks on `pp` pipeline ranks, or one
    `UserInputError` naming the option to change.  The blocks of each stage: from
    `split_points` (the first block of every stage but the first), else
    `layers_per_stage` each, else with `costs` so that the slowest stage is as fast as it
    can be within its rank's memory (`_balanced_by_cost`), else as even as they go (`_balanced`)."""
    cls = schedule_class(schedule)
    name = cls.__name__.removeprefix("Schedule")
    multi = issubclass(cls, PipelineScheduleMulti)
    if split_points:
        option = f"--parallelism.pipeline_parallel_split_points {','.join(map(str, split_points))}"
        if layers_per_stage is not None:
            raise UserInputError(f"{option}: give split points or layers per stage, not both")
        bounds = [0, *split_points, n_blocks]
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise UserInputError(
                f"{option}: must increase strictly, each between 1 and {n_blocks - 1} (the "
                f"positions of the blocks of {model} that start a stage)"
            )
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    elif layers_per_stage is not None:
        option = f"--parallelism.pipeline_parallel_layers_per_stage {layers_per_stage}"
        if layers_per_stage < 1 or n_blocks % layers_per_stage:
            raise UserInputError(f"{option}: must divide the {n_blocks} blocks of {model}")
        sizes = [layers_per_stage] * (n_blocks // layers_per_stage)
    else:
        stages = pp * (2 if multi else 1)
        if n_blocks < stages:
            raise UserInputError(
                f"--parallelism.pipeline_parallel_degree {pp}: {name} runs {stages} stages on "
                f"{pp} ranks, and {model} has {n_blocks} blocks; use a smaller degree"
            )
        if costs is not None:
            microbatches = max(1, local_batch // max(1, microbatch_size))  # checked below
            shape = PipelineShape(name, pp, stages // pp, microbatches)
            sizes = _balanced_by_cost(n_blocks, stages, costs, shape)
        else:
            sizes = _balanced(n_blocks, stages)
        option = ""
    stages = len(sizes)
    if stages % pp or (not multi and stages != pp):
        want = f"{pp}" if not multi else f"a multiple of {pp}"
        raise UserInputError(
            f"{option}: makes {stages} stages, and {name} on {pp} ranks runs {want}"
            f"{'' if multi else ' (one per rank; Interleaved1F1B runs several)'}"
        )
    if schedule in _V_SHAPED and stages != 2 * pp:
        raise UserInputError(
            f"{option}: makes {stages} stages, and {name} runs exactly two per rank ({2 * pp})"
        )
    if microbatch_size < 1 or local_batch % microbatch_size:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_microbatch_size {microbatch_size}: must divide "
            f"the local batch size {local_batch}"
        )
    microbatches = local_batch // microbatch_size
    if multi and microbatches % pp:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_microbatch_size {microbatch_size}: {name} needs "
            f"a number of microbatches that {pp} divides, and the local batch {local_batch} "
            f"makes {microbatches}"
        )
    starts = [sum(sizes[:s]) for s in range(stages)]
    return StagePlan(
        schedule=schedule,
        blocks=[list(range(start, start + n)) for start, n in zip(starts, sizes)],
        microbatches=microbatches,
        costs=costs,
    )


def _balanced(n_blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as even as they go; the blocks left over go to the middle stages
    first (the first stage also runs the embeddings, the last the output projection)."""
    sizes = [n_blocks // stages] * stages
    by_depth = sorted(range(stages), key=lambda s: -min(s, stages - 1 - s))
    for s in by_depth[: n_blocks % stages]:
        sizes[s] += 1
    return sizes


# what recomputing a block's forward adds to its forward + backward time (the forward is
# about a third of it: the backward computes two gradients per matmul)
RECOMPUTE_SHARE = 1 / 3


@dataclass(frozen=True)
class _StageCost:
    """A stage's predicted time per microbatch with `blocks` blocks (`inf`: it cannot fit
    its rank's memory even recomputing every block), and how much of its share of the
    rank's memory the activations it would save fill (the tie-breaker: the fuller gives a
    block away first)."""

    costs: StageCosts
    stage: int
    stages: int
    in_flight: float  # microbatches the stage holds at its peak
    share: int  # stages on its rank

    def __call__(self, blocks: int) -> tuple[float, float]:
        c, first, last = self.costs, self.stage == 0, self.stage == self.stages - 1
        time = blocks * c.block + (c.first if first else 0.0) + (c.last if last else 0.0)
        mem = c.memory
        if mem is None:
            return time, 0.0

        def total(parts: tuple[float, float, float]) -> float:
            return blocks * parts[1] + (parts[0] if first else 0.0) + (parts[2] if last else 0.0)

        room = mem.budget_bytes / self.share - total(mem.state) / mem.stage_ranks
        held = total(mem.saved) * self.in_flight
        if held <= room:
            return time, held / max(room, 1.0)
        if room <= 0:
            return math.inf, math.inf
        # the planner recomputes (at least) the part of the blocks that does not fit
        return time * (1 + RECOMPUTE_SHARE * (held - room) / held), held / room


def _balanced_by_cost(
    n_blocks: int, stages: int, costs: StageCosts, shape: PipelineShape
) -> list[int]:
    """Blocks per stage (at least one each) making the slowest stage as fast as it can be:
    the first stage also runs `costs.first`, the last `costs.last`, and a stage whose
    activations in flight (`shape.in_flight`) do not fit its rank's memory pays for the
    recomputation that makes them fit (`_StageCost`).  The smallest time T whose block
    capacities hold every block, then blocks taken back from the slowest stages (the fuller
    first, then the outer ones, as `_balanced` does) until they add up.  Where no split
    fits the memory, the split balances time alone (each stage's plan then says how far
    it is over)."""
    cost = [
        _StageCost(costs, s, stages, shape.in_flight(_rank_of(shape, s)), shape.stages_per_rank)
        for s in range(stages)
    ]
    table = [[cost[s](k) for k in range(1, n_blocks + 1)] for s in range(stages)]

    def capacity(t: float) -> list[int]:
        return [sum(1 for time, _ in row if time <= t) for row in table]

    candidates = sorted({time for row in table for time, _ in row if time < math.inf})
    limit = next(
        (t for t in candidates if min(capacity(t)) >= 1 and sum(capacity(t)) >= n_blocks), None
    )
    if limit is None:
        return _balanced_by_cost(n_blocks, stages, replace(costs, memory=None), shape)
    sizes = capacity(limit)
    middle = (stages - 1) / 2
    while sum(sizes) > n_blocks:
        slowest = max(
            (s for s in range(stages) if sizes[s] > 1),
            key=lambda s: (*table[s][sizes[s] - 1], abs(s - middle)),
        )
        sizes[slowest] -= 1
    return sizes


def _rank_of(shape: PipelineShape, stage: int) -> int:
    """The pipeline rank holding `stage` (a V-shaped schedule folds the stages back)."""
    if shape.schedule in _V_SHAPED and stage >= shape.pp:
        return 2 * shape.pp - 1 - stage
    return stage % shape.pp


@dataclass(frozen=True)
class StageIO:
    """What one stage takes and gives per microbatch: meta tensors of the shapes one rank
    sees (its share of the batch; a planner plans the stage for them, over every rank that
    shares its stage: hidden states in, not token ids)."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    first: bool
    last: bool
    stages_per_rank: int = 1  # a rank's memory is shared by the stages it holds
    in_flight: float = 1.0  # microbatches whose activations the stage holds at its peak
    stage: int = 0
    blocks: tuple[int, ...] = ()  # positions of its blocks in the model's container
    container: str = ""  # that container's name (`PipelineSplit.blocks`)

    def describe(self) -> str:
        """`stage 1 (blocks 3-5, 2 microbatches in flight)`."""
        span = f"blocks {self.blocks[0]}-{self.blocks[-1]}" if self.blocks else "no blocks"
        return f"stage {self.stage} ({span}, {self.in_flight:g} microbatches in flight)"


def stage_io(
    model: nn.Module, split: PipelineSplit, plan: StagePlan, microbatch: torch.Tensor, pp: int
) -> list[StageIO]:
    """Every stage's inputs and outputs for the `microbatch` of token ids: one forward of the
    whole meta-device `model`, catching the hidden states where each stage's first block
    reads them (what the model takes in when its first modules are gone)."""
    container = getattr(model, split.blocks)
    keys = list(container.keys())
    caught: dict[int, torch.Tensor] = {}
    handles = []
    for stage, blocks in enumerate(plan.blocks):
        if stage == 0:
            continue

        def catch(_module, args, stage=stage):
            caught[stage] = torch.empty_like(args[0], device="meta")

        handles.append(container[keys[blocks[0]]].register_forward_pre_hook(catch))
    try:
        with torch.no_grad():
            out = model(microbatch.to("meta"))
    finally:
        for h in handles:
            h.remove()
    ins = [microbatch.to("meta"), *(caught[s] for s in range(1, plan.stages))]
    outs = [*ins[1:], torch.empty_like(out, device="meta")]
    last = plan.stages - 1
    shape = plan.shape(pp)
    return [
        StageIO(
            (i,),
            (o,),
            s == 0,
            s == last,
            shape.stages_per_rank,
            shape.in_flight(plan.rank_of(s, pp)),
            s,
            tuple(plan.blocks[s]),
            split.blocks,
        )
        for s, (i, o) in enumerate(zip(ins, outs))
    ]


@dataclass
class _Removed:
    """What one stage lacks of the whole model (meta-device modules)."""

    blocks: dict[str, nn.Module]  # container key -> block
    modules: dict[str, nn.Module]  # attribute on the model -> first/last module
    order: list[str]  # every container key, in the model's order


@dataclass
class PipelineStages:
    """This rank's stages of a model: the stage modules (`parts`, what is parallelised,
    optimised and checkpointed), what each lacks, and — once `start` ran — the schedule."""

    split: PipelineSplit
    plan: StagePlan
    stage_ids: list[int]
    parts: list[nn.Module] = field(default_factory=list)
    removed: list[_Removed] = field(default_factory=list)
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan.stages - 1 in self.stage_ids

    @contextlib.contextmanager
    def whole_model(self, i: int, device: torch.device) -> Iterator[nn.Module]:
        """Part `i` with its missing modules back in their places, allocated on `device`
        for as long as this lasts, so that the model's own `init_weights` walks and draws
        the whole model in its own order (a random fill's draws can depend on the values,
        as torch's rejection-sampling `trunc_normal_`'s do: only a real draw advances the
        generator as one process does)."""
        part, removed = self.parts[i], self.removed[i]
        for module in [*removed.blocks.values(), *removed.modules.values()]:
            module.to_empty(device=device)
        container = getattr(part, self.split.blocks)
        whole = nn.ModuleDict(
            {k: container[k] if k in container else removed.blocks[k] for k in removed.order}
        )
        for name, module in removed.modules.items():
            setattr(part, name, module)
        setattr(part, self.split.blocks, whole)
        try:
            yield part
        finally:
            for name in removed.modules:
                setattr(part, name, None)
            setattr(part, self.split.blocks, container)
            for module in [*removed.blocks.values(), *removed.modules.values()]:
                module.to_empty(device="meta")  # give the memory back

    def start(
        self,
        device: torch.device,
        group,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Build the schedule over the (parallelised, initialised) parts."""
        stages = [
            PipelineStage(part, stage_id, self.plan.stages, device, group=group)
            for part, stage_id in zip(self.parts, self.stage_ids)
        ]
        cls = schedule_class(self.plan.schedule)
        arg = stages if issubclass(cls, PipelineScheduleMulti) else stages[0]
        self.schedule = cls(arg, n_microbatches=self.plan.microbatches, loss_fn=loss_fn)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One schedule run over a local batch: forward and backward of every microbatch;
        the losses of its microbatches on the rank holding the last stage, else []."""
        if self.schedule is None:
            raise RuntimeError("PipelineStages.start() was not called")
        losses: list[torch.Tensor] = []
        target = labels if self.has_last else None
        args = (tokens,) if self.has_first else ()
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None)
        return losses


def split_stages(
    model: nn.Module, split: PipelineSplit, plan: StagePlan, pp_rank: int, pp: int
) -> PipelineStages:
    """This rank's stages of the meta-device `model` (each a copy holding its blocks)."""
    out = PipelineStages(split, plan, plan.stages_of(pp_rank, pp))
    for stage_id in out.stage_ids:
        part = copy.deepcopy(model)
        container = getattr(part, split.blocks)
        order = list(container.keys())
        keep = {order[i] for i in plan.blocks[stage_id]}
        removed = _Removed({}, {}, order)
        for key in order:
            if key not in keep:
                removed.blocks[key] = container[key]
                del container[key]
        names = [
            *(split.first if stage_id > 0 else ()),
            *(split.last if stage_id < plan.stages - 1 else ()),
        ]
        for name in names:
            removed.modules[name] = getattr(part, name)
            setattr(part, name, None)
        out.parts.append(part)
        out.removed.append(removed)
    return out
