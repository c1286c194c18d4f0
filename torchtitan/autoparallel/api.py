"""`AutoParallel`: the public entry point tying the stages together.

    with AutoParallel(meta_model, input_fn, mesh, mp_policy=None, cost_model="h100") as autop:
        autop.add_memory_constraint(72 * 2**30)                 # bytes per rank
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_output_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
        parallel_model = autop.apply_placement(plan)

Entering traces the model (trace/; with `trace_on_enter=False` on first need, for a process
that may receive its plan from another); `optimize_placement` enumerates strategies on first use
(strategies/), freezes everything a solve depends on into a `PlanningProblem`
(solve/problem.py), solves it (solve/) and writes the `Plan` (plan/); `apply_placement`
accepts that plan (or one loaded from JSON) and returns the parallel module (execute/).
Stage timings are logged and stored in `plan.timings`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from .child_process import raise_as_sent, run_in_child
from .cost.model import CostModel, resolve_cost_model
from .errors import ConstraintError, PlannerError
from .execute.apply import build_parallel_module, lowered_executor
from .graph.placements import parse as parse_placements
from .plan.cache import cached_plan
from .plan.display import plan_table
from .plan.expand import expand_plan
from .plan.plan import Plan
from .plan.plan_file import check_plan_file, edited_parameters, parse_plan_file, read_plan_text
from .plan.report import solution_to_plan
from .policies.recompute import check_setting as check_recompute_setting
from .policies.recompute import solver_setting
from .policies.regather import check_reshard_policy
from .policies.units import fsdp_units
from .solve.candidates import Candidates
from .solve.constraints import (
    CollectiveDim,
    MemoryBudget,
    ParameterBudget,
    Pin,
    UserConstraint,
    expert_parallel,
    input_pins,
    memory_budget,
    output_pins,
    parameter_budget,
    parameter_pin,
)
from .solve.problem import ModelFacts, PlanningProblem, PlanSettings
from .solve.solver import PlacementSolver
from .trace import repeat
from .trace.joint import check_on_meta
from .trace.planning import PlanningTrace

log = logging.getLogger(__name__)


def _is_multirank() -> bool:
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and dist.get_backend() != "fake"
    )


def on_rank0(fn: Callable[[], str], group=None, meanwhile: Callable[[], None] | None = None) -> str:
    """Run `fn` on rank 0 of `group` (default: every rank) only and return its text on every
    rank of it (as is without a multi-rank process group); the other ranks run `meanwhile()`
    while they wait.  An error there is raised on every rank: a `PlannerError` as the same
    error with the same message, anything else as a RuntimeError naming it — never a rank
    left waiting in the broadcast."""
    if not _is_multirank():
        return fn()
    import torch.distributed as dist

    box: list = [None]
    failure = None
    if dist.get_rank(group) != 0 and meanwhile is not None:
        meanwhile()
    if dist.get_rank(group) == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failure = e
            box = [("error", type(e).__name__, str(e), isinstance(e, PlannerError))]
    dist.broadcast_object_list(box, group=group, group_src=0)
    if failure is not None:
        raise failure
    if box[0][0] == "ok":
        return box[0][1]
    _tag, name, message, planner = box[0]
    raise_as_sent(name, message, planner, "on rank 0")


def _mp_dtypes(mp_policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) from an FSDP2 MixedPrecisionPolicy-like object."""
    if mp_policy is None:
        return None, None
    param = getattr(mp_policy, "param_dtype", None)
    reduce = getattr(mp_policy, "reduce_dtype", None)
    return param, (reduce if reduce is not None else param)


class AutoParallel:
    """Plan and apply a sharding for `model` (built on meta) on `mesh`.

    `input_fn()` returns global-shaped example inputs (a tensor or a tuple of tensors); it is
    called under a fake tensor mode, so it allocates nothing.  `cost_model` is a `CostModel`
    or a device name ("cpu", "a100", "h100", "h200").  Output gradients are divided by the
    number of batch shards (DDP/FSDP semantics for a per-rank mean loss).
    `solver_time_limit` bounds the solve; once it holds a plan near the relaxation's bound,
    the search for a cheaper one stops after `solver_proof_limit` seconds (the plan records
    the gap it proved, solve/milp.py).  `share_repeated=False` plans every block of a stack
    on its own (trace/repeat.py).  The repeated blocks are found by structure (a stack of
    `MIN_BLOCKS` or more identical children); `block_containers` names containers whose
    children are blocks however few there are (a pipeline stage's share of a stack), so
    that per-block recomputation and re-gathering apply to them too.
    `trace_on_enter=False` makes the planning trace when first needed (planning, or
    `tg`), not on entering, and checks the constraints added before it against it then: a
    process that receives its plan (`optimize_placement(broadcast=True)` off rank 0) never
    makes it, and traces only the whole model, which `apply_placement` runs the plan on.

    `reshard_after_forward` says which FSDP units gather their parameters again in the
    backward instead of keeping them (policies/regather.py): True/"always", False/"never",
    torchtitan's "default" (all but the root and the last unit), or "auto": the solver
    decides per unit, pricing the backward's gathers against the memory kept (under
    `add_memory_constraint`; without a budget keeping is free).

    `recompute`: what each repeated block recomputes in the backward instead of keeping it
    (policies/recompute.py): "none", "selective" or "full" for every block; a dict from block
    label (`"layers#3"`: container FQN, '#', position) to policy, "none" for blocks it leaves
    out; or "auto" to let the solver choose per block under the memory budget
    (`add_memory_constraint`), pricing the recomputation's time against the sharding choices.
    """

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any],
        mesh: DeviceMesh,
        mp_policy=None,
        cost_model: CostModel | str | None = None,
        solver_time_limit: float = 300.0,
        solver_proof_limit: float = 15.0,
        share_repeated: bool = True,
        reshard_after_forward: bool | str = True,
        recompute: str | dict[str, str] = "none",
        block_containers: Sequence[str] = (),
        trace_on_enter: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise PlannerError(f"model must be an nn.Module, got {type(model).__name__}")
        check_on_meta(model)
        if not isinstance(mesh, DeviceMesh):
            raise PlannerError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        self.model = model
        self.input_fn = input_fn
        self.mesh = mesh
        self.param_dtype, self.reduce_dtype = _mp_dtypes(mp_policy)
        self.cost_model = resolve_cost_model(cost_model)
        self.share_repeated = share_repeated
        self.block_containers = tuple(block_containers)
        self.trace_on_enter = trace_on_enter
        # checked now; recompute is checked against the model's blocks once traced
        self.settings = PlanSettings(
            recompute=check_recompute_setting(recompute),
            reshard_after_forward=check_reshard_policy(reshard_after_forward),
            time_limit=solver_time_limit,
            proof_limit=solver_proof_limit,
        )
        self.model_facts = ModelFacts(
            param_shapes={f: list(p.shape) for f, p in model.named_parameters()},
            buffer_names=tuple(f for f, _b in model.named_buffers()),
            units=tuple(fsdp_units(model)),
        )
        self.timings: dict[str, float] = {}
        self._constraints: list[UserConstraint] = []
        # what the constraint methods do once the planning trace is made, in their order
        self._pending: list[Callable[[PlanningTrace], None]] = []
        self._trace: PlanningTrace | None = None
        self._mesh_stage: Candidates | None = None
        # strategy memos per mesh shape, shared with the `on_mesh` planners of this trace
        self._strategy_memos: dict[tuple[int, ...], dict] = {}

    # ------------------------------------------------------------------ stage 1: trace
    def __enter__(self) -> AutoParallel:
        self._trace = PlanningTrace(
            self.model, self.input_fn, self.param_dtype, self.share_repeated, self.block_containers
        )
        if self.trace_on_enter:
            self._traced()
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def tg(self):
        """The planning trace (shallow when the model repeats blocks)."""
        return self._traced().tg

    @property
    def blocks(self) -> list[repeat.RepeatedBlocks]:
        """The model's stacks of identical blocks planned from a shallow trace."""
        return list(self._require_entered().blocks)

    def _require_entered(self) -> PlanningTrace:
        if self._trace is None:
            raise PlannerError(
                "use AutoParallel as a context manager ('with AutoParallel(...) as autop')"
            )
        return self._trace

    def _traced(self) -> PlanningTrace:
        """The planning trace, made now if it was not yet, with the constraints added before
        it applied to it."""
        trace = self._require_entered()
        if not trace.made:
            trace.make()
            self.timings["trace"] = trace.seconds
        while self._pending:
            self._pending.pop(0)(trace)
        return trace

    def _when_traced(self, step: Callable[[PlanningTrace], None]) -> None:
        """Run `step` on the planning trace now if it exists, else once it is made."""
        trace = self._require_entered()
        if trace.made and not self._pending:
            step(trace)
        else:
            self._pending.append(step)

    def on_mesh(self, mesh: DeviceMesh) -> AutoParallel:
        """The same model, trace and settings on another mesh, with no constraints yet.

        The trace holds global shapes only, so it is shared; strategies, costs and the
        program are the new mesh's own (built on first use).  The mesh search plans every
        candidate this way from one trace."""
        self._require_entered()
        if not isinstance(mesh, DeviceMesh):
            raise PlannerError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        other = copy.copy(self)
        other.mesh = mesh
        other.timings = {"trace": 0.0}
        other._constraints = []
        other._pending = []
        other._mesh_stage = None
        return other

    def param_shapes(self) -> dict[str, list[int]]:
        """Shape of every parameter of the model, by its fully qualified name."""
        return {f: list(s) for f, s in self.model_facts.param_shapes.items()}

    def full_graph(self):
        """The joint graph of the whole model (traced on first use when planning was shallow)."""
        trace = self._require_entered()
        full = trace.full
        if trace.full_seconds:
            self.timings["trace_full"] = trace.full_seconds
        return full

    def trace_for_apply(self) -> None:
        """Trace the whole model now if it traces, for `apply_placement` (run while another
        process makes the plan); a failure is left to `apply_placement`, which traces again
        and raises it once the plan, or the planning's own error, has arrived."""
        try:
            self.full_graph()
        except Exception as e:  # noqa: BLE001 - raised again where it matters (apply)
            log.info("tracing the whole model ahead of apply failed (%s); left to apply", e)

    # ------------------------------------------------------------------ stage 2: strategies
    def prepare(self) -> None:
        """Enumerate strategies and prune them now (otherwise done lazily by the first
        `optimize_placement`); lets callers time the stages separately."""
        self._strategies()

    def _strategies(self) -> Candidates:
        if self._mesh_stage is None:
            self._mesh_stage = Candidates.build(
                self._traced().tg,
                self.mesh,
                self.cost_model,
                self.param_dtype,
                self._strategy_memos.setdefault(tuple(self.mesh.shape), {}),
            )
            self.timings.update(self._mesh_stage.timings)
        return self._mesh_stage

    # ------------------------------------------------------------------ settings
    def set_reshard_after_forward(self, policy: bool | str) -> None:
        """Change the `reshard_after_forward` setting (see the class docstring) before
        solving."""
        policy = check_reshard_policy(policy)
        self.settings = dataclasses.replace(self.settings, reshard_after_forward=policy)

    def set_recompute(self, recompute: str | dict[str, str]) -> None:
        """Change the `recompute` setting (see the class docstring) before solving; a dict
        may name blocks of `self.blocks` once entered."""
        recompute = check_recompute_setting(recompute)

        def check(trace: PlanningTrace) -> None:  # raises if it cannot apply to the blocks
            solver_setting(recompute, trace.blocks, trace.tg.shallow)

        self._when_traced(check)
        self.settings = dataclasses.replace(self.settings, recompute=recompute)

    def clear_constraints(self) -> None:
        """Drop every pin and budget added so far (to solve again under other constraints)."""
        self._when_traced(lambda _trace: self._constraints.clear())

    # ------------------------------------------------------------------ constraints
    def add_parameter_memory_constraint(
        self, low: float | None = None, high: float | None = None
    ) -> None:
        """Bound parameter bytes per rank, as a fraction of all parameter bytes.

        `high=None` means 1/world_size (fully sharded where shapes allow); `high=1.0` means no
        limit (the solver then usually replicates, DDP-like).  Each parameter's share is
        floored at its smallest achievable fraction, so unshardable tensors don't make it
        infeasible.
        """
        self._replace(ParameterBudget, parameter_budget(low, high, self.mesh.size()))

    def add_memory_constraint(self, bytes_per_rank: int | float, in_flight: float = 1.0) -> None:
        """Bound predicted bytes per rank: parameters + gradients + AdamW state (2 fp32 per
        element) + saved activations (forward tensors the backward reads), see cost/memory.py.
        A pipeline stage holds `in_flight` microbatches' saved activations at once: the
        plan must fit with that many."""
        self._replace(MemoryBudget, memory_budget(bytes_per_rank, in_flight))

    def add_expert_parallel_constraint(self, mesh_dim: int | str) -> None:
        """Split the routed experts (`titan.routed_experts`) over `mesh_dim` (an index or a
        name), tokens dispatched to them by all-to-all; without it the solver chooses
        between that and replicated or hidden-split experts on every mesh dim."""
        self._replace(CollectiveDim, expert_parallel(self.mesh, mesh_dim))

    def _replace(self, kind: type, constraint: UserConstraint) -> None:
        def replace(_trace: PlanningTrace) -> None:
            self._constraints[:] = [c for c in self._constraints if not isinstance(c, kind)]
            self._constraints.append(constraint)

        self._when_traced(replace)

    def add_input_constraints(self, placements: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple per flattened input (None leaves that input free)."""
        self._when_traced(
            lambda trace: self._constraints.extend(input_pins(trace.tg, self.mesh, placements))
        )

    def add_output_constraints(self, placements: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple per flattened forward output (None leaves it free)."""
        self._when_traced(
            lambda trace: self._constraints.extend(output_pins(trace.tg, self.mesh, placements))
        )

    def add_parameter_constraint(self, fqn: str, placements: Sequence[Placement]) -> None:
        """Pin one parameter's placement (call before `optimize_placement`)."""
        if fqn not in self.model_facts.param_shapes:
            raise ConstraintError(f"no parameter named '{fqn}'")

        def pin_it(trace: PlanningTrace) -> None:
            traced = trace.traced_name(fqn)
            pin = parameter_pin(trace.tg, self.mesh, fqn, traced, placements, self._constraints)
            if pin is not None:
                self._constraints.append(pin)

        self._when_traced(pin_it)

    # ------------------------------------------------------------------ stages 4, 4b: solve
    def problem(self) -> PlanningProblem:
        """Everything the next solve depends on, frozen (solve/problem.py)."""
        trace = self._traced()
        stage = self._strategies()
        t = time.perf_counter()
        pinned = frozenset(c.node for c in self._constraints if isinstance(c, Pin))
        rep = stage.clustered(pinned, trace.tg) if self.share_repeated else None
        self.timings["prune+cluster"] = stage.timings["prune"] + time.perf_counter() - t
        return PlanningProblem(
            tg=trace.tg,
            table=stage.table,
            mesh=self.mesh,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            cost_model=self.cost_model,
            prices=stage.prices,
            blocks=tuple(trace.blocks),
            model=self.model_facts,
            settings=self.settings,
            constraints=tuple(self._constraints),
            rep=rep,
        )

    def optimize_placement(
        self,
        verbose: bool = False,
        broadcast: bool = False,
        cache_dir: str | Path | None = None,
        in_child: bool = False,
    ) -> Plan:
        """Solve and return the plan.

        With `broadcast=True` and a real multi-rank process group, *all* ranks must call this:
        only rank 0 builds and solves the program and the others receive its plan (as JSON),
        so every rank applies the identical plan and the CPU cost is paid once.  With the
        default `False` the call is local (no collectives).  With `cache_dir` the plan is
        looked up there first and a new one is written there (plan/cache.py).  With
        `in_child` the strategies, the program and the solve are made in a forked child
        process, whose memory goes back to the system when it exits (child_process.py): for
        a process that goes on to train.  Such a process applies the plan next, so while the
        plan is made (here by the child, elsewhere by rank 0) it traces the whole model for
        `apply_placement` (`trace_for_apply`).
        """
        self._require_entered()
        if not (broadcast or in_child) and cache_dir is None:
            return self._solve(self.problem(), verbose)

        def plan_text() -> str:
            return self.solve_problem(self.problem(), cache_dir, verbose).to_json()

        meanwhile = self.trace_for_apply if in_child else None

        def made() -> str:
            return run_in_child(plan_text, meanwhile) if in_child else plan_text()

        text = on_rank0(made, self._mesh_group(), meanwhile) if broadcast else made()
        return Plan.from_json(text)

    def solve_problem(
        self, problem: PlanningProblem, cache_dir: str | Path | None = None, verbose: bool = False
    ) -> Plan:
        """The plan of `problem` (`problem()`), in this process: looked up in `cache_dir` first
        and written there when new, if given."""
        return cached_plan(problem, cache_dir, lambda: self._solve(problem, verbose))

    def plan_from_file(
        self,
        path: str | Path,
        broadcast: bool = False,
        cache_dir: str | Path | None = None,
        in_child: bool = False,
    ) -> Plan:
        """The plan in file `path` (`scripts/plan.py`'s plan.json, a run's cached plan,
        possibly edited by hand), after the constraints are set: checked against this
        model, mesh and constraints (a `PlannerError` naming the first difference), then
        returned as written, or, when its parameter placements were edited, solved again
        with every parameter pinned where the file puts it (plan/plan_file.py).
        `broadcast`, `cache_dir` and `in_child` (for the solve) as for `optimize_placement`
        (rank 0 reads the file)."""
        self._require_entered()
        if broadcast:
            text = on_rank0(lambda: read_plan_text(path), self._mesh_group())
        else:
            text = read_plan_text(path)
        plan = parse_plan_file(text, path)
        check_plan_file(plan, self.problem(), path)
        edited = edited_parameters(plan)
        if not edited:
            log.info("plan file %s: applied as written", path)
            return plan
        log.info(
            "plan file %s: %d parameter placement(s) edited (%s, ...): solving again with "
            "every parameter pinned where the file puts it",
            path,
            len(edited),
            edited[0],
        )
        for fqn, placement in plan.params.items():
            self.add_parameter_constraint(fqn, parse_placements(placement))
        return self.optimize_placement(broadcast=broadcast, cache_dir=cache_dir, in_child=in_child)

    def _mesh_group(self):
        """The process group of the mesh's ranks, which share one plan; None (every rank)
        when the mesh holds them all, else a part of the world (a pipeline stage's ranks)."""
        import torch.distributed as dist

        if not _is_multirank() or self.mesh.size() == dist.get_world_size():
            return None
        if self.mesh.ndim == 1:
            return self.mesh.get_group()
        return self.mesh._flatten().get_group()

    def _solve(self, problem: PlanningProblem, verbose: bool) -> Plan:
        """The solver's plan; under a budget with microbatches in flight, its predicted
        figures also hold the peak with them (the solver's memory rows count the other
        microbatches' saved values: program.memory_rows)."""
        sol = PlacementSolver(problem).solve(verbose)
        self.timings["build"], self.timings["solve"] = sol.build_s, sol.solve_s
        plan = solution_to_plan(problem, sol, self.timings)
        budget = next((c for c in problem.constraints if isinstance(c, MemoryBudget)), None)
        if budget is not None and budget.in_flight > 1:
            p = plan.predicted
            p["in_flight_peak_bytes_per_rank"] = (
                p["peak_bytes_per_rank"]
                + (budget.in_flight - 1) * p["saved_at_boundary_bytes_per_rank"]
            )
        log.info("plan:\n%s", plan_table(plan))
        return plan

    # ------------------------------------------------------------------ stage 5: apply
    def apply_placement(self, plan: Plan | None = None) -> nn.Module:
        self._require_entered()
        if plan is None:
            plan = self.optimize_placement()
        if not isinstance(plan, Plan):
            raise PlannerError(f"apply_placement expects a Plan, got {type(plan).__name__}")
        if plan.blocks:  # planned on a shallow trace: run it on the whole model's graph
            tg = self.full_graph()
            plan = expand_plan(plan, tg)
        else:
            tg = self.tg
        t = time.perf_counter()
        executor = lowered_executor(
            tg, plan, self.mesh, self.reduce_dtype, list(self.model_facts.units)
        )
        pm = build_parallel_module(self.model, plan, self.mesh, executor)
        self.timings["apply"] = time.perf_counter() - t
        plan.timings["apply"] = self.timings["apply"]
        log.info("apply in %.2fs", self.timings["apply"])
        return pm
