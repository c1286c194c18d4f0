"""`AutoParallel`: the public entry point tying the stages together.

    with AutoParallel(meta_model, input_fn, mesh, mp_policy=None, cost_model="h100") as autop:
        autop.add_parameter_memory_constraint(high=None)       # default 1/world: FSDP-like
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_output_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
        parallel_model = autop.apply_placement(plan)

Entering traces the model and enumerates strategies; `optimize_placement` builds and solves
the program and returns a `Plan`; `apply_placement` accepts that plan (or one loaded from
JSON) and returns the parallel module.  Stage timings are logged and stored in `plan.timings`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from .cost.model import CostModel, Estimator, resolve_cost_model
from .errors import ConstraintError, PlannerError
from .execute.apply import GraphRunner, build_parallel_module
from .graph import placements as P
from .plan.cache import cached_or_solved
from .plan.expand import expand_plan
from .plan.plan import Plan
from .plan.report import solution_to_plan
from .policies.recompute import check_policy
from .policies.regather import check_reshard_policy, regather_setting
from .policies.units import fsdp_units
from .solve.constraints import MemoryBudget, OutputPin, ParameterBudget, Pin, UserConstraint
from .solve.precision import cast_edges
from .solve.prune import prune_unreachable
from .solve.solver import PlacementSolver
from .strategies.cluster import cluster_nodes
from .strategies.table import build_strategies
from .trace import repeat
from .trace.joint import check_on_meta, trace_joint

log = logging.getLogger(__name__)


def _is_multirank() -> bool:
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and dist.get_backend() != "fake"
    )


def on_rank0(fn: Callable[[], str]) -> str:
    """Run `fn` on rank 0 only and return its text on every rank (as is without a multi-rank
    process group).  An error there is raised on every rank: a `PlannerError` as the same
    error with the same message, anything else as a RuntimeError naming it — never a rank
    left waiting in the broadcast."""
    if not _is_multirank():
        return fn()
    import torch.distributed as dist

    from . import errors

    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failure = e
            box = [("error", type(e).__name__, str(e), isinstance(e, PlannerError))]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0][0] == "ok":
        return box[0][1]
    _tag, name, message, planner = box[0]
    if planner:
        raise getattr(errors, name, PlannerError)(message)
    raise RuntimeError(f"planning failed on rank 0 with {name}: {message}")


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
    or a device name ("cpu", "a100", "h100", "h200").  `grad_reduction="mean"` divides output
    gradients by the number of batch shards (DDP/FSDP semantics for a per-rank mean loss).
    `solver_time_limit` bounds the solve; once it holds a plan near the relaxation's bound,
    the search for a cheaper one stops after `solver_proof_limit` seconds (the plan records
    the gap it proved, solver.py).

    Execution (`apply_placement`): `executor="lowered"` runs the plan as local forward and
    backward graphs (lower.py, executor.py; "dtensor" interprets it over DTensors, a reference
    path); `reshard_after_forward` says which units gather their parameters again in the
    backward instead of keeping them (regather.py): True/"always", False/"never",
    torchtitan's "default" (all but the root and the last unit), or "auto": the solver
    decides per unit, pricing the backward's gathers against the memory kept (under
    `add_memory_constraint`; without a budget keeping is free); `bucket` merges each unit's
    parameter gathers and gradient reductions (buckets.py).

    `recompute`: what each repeated block recomputes in the backward instead of keeping it
    (recompute.py): "none", "selective" or "full" for every block; a dict from block label
    (`"layers#3"`: container FQN, '#', position) to policy, "none" for blocks it leaves out;
    or "auto" to let the solver choose per block under the memory budget
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
        grad_reduction: str = "mean",
        share_repeated: bool = True,
        backward: str = "plan",
        executor: str = "lowered",
        reshard_after_forward: bool | str = True,
        bucket: bool = True,
        recompute: str | dict[str, str] = "none",
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
        self.time_limit = solver_time_limit
        self.proof_limit = solver_proof_limit
        self.grad_reduction = grad_reduction
        self.share_repeated = share_repeated
        self.backward = backward
        self.executor = executor
        self.reshard_after_forward = check_reshard_policy(reshard_after_forward)
        self.bucket = bucket
        if isinstance(recompute, dict):
            recompute = {str(b): check_policy(p) for b, p in recompute.items()}
        elif recompute != "auto":
            check_policy(recompute)
        self.recompute = recompute  # checked against the model's blocks once traced
        self.timings: dict[str, float] = {}
        self._constraints: list[UserConstraint] = []
        self._inputs_set = self._outputs_set = False
        self.tg = None
        self.table = None
        self._param_shapes: dict[str, list[int]] | None = None
        self._clustered_for: frozenset | None = None  # the pinned nodes `_cluster` last saw
        self._rep: dict | None = None  # node -> representative sharing its variables

    # ------------------------------------------------------------------
    def __enter__(self) -> "AutoParallel":
        t = time.perf_counter()
        # stacks of identical blocks are planned from a shallow copy (repeat.py)
        self.blocks = repeat.find_repeated_blocks(self.model) if self.share_repeated else []
        try:
            self.tg = trace_joint(
                self.model, self.input_fn, self.param_dtype, self.blocks, shallow=bool(self.blocks)
            )
        except PlannerError:
            raise
        except Exception as e:  # noqa: BLE001
            if not self.blocks:
                raise
            # a forward that indexes its stack (`self.norms[3]`) cannot run on a shallow copy
            log.info("shallow trace failed (%s: %s); tracing the whole model", type(e).__name__, e)
            self.blocks = []
            self.tg = trace_joint(self.model, self.input_fn, self.param_dtype)
        self._full_tg = None if self.blocks else self.tg
        self.timings["trace"] = time.perf_counter() - t
        if self.blocks:
            log.info(
                "repeated blocks: %s; traced the first, second and last of each",
                ", ".join(f"{b.container} x{len(b.keys)}" for b in self.blocks),
            )
        return self

    def on_mesh(self, mesh: DeviceMesh) -> "AutoParallel":
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
        other.table = None
        other._clustered_for = other._rep = None
        return other

    def param_shapes(self) -> dict[str, list[int]]:
        """Shape of every parameter of the model, by its fully qualified name."""
        if self._param_shapes is None:
            self._param_shapes = {f: list(p.shape) for f, p in self.model.named_parameters()}
        return dict(self._param_shapes)

    def _traced_name(self, fqn: str) -> str:
        """Name in the traced graph of the model's parameter/buffer `fqn`."""
        return repeat.reduced_fqn(fqn, self.blocks) if self.tg.shallow else fqn

    def full_graph(self):
        """The joint graph of the whole model (traced on first use when planning was shallow)."""
        if self._full_tg is None:
            t = time.perf_counter()
            self._full_tg = trace_joint(self.model, self.input_fn, self.param_dtype, self.blocks)
            self.timings["trace_full"] = time.perf_counter() - t
        return self._full_tg

    def __exit__(self, *exc) -> None:
        return None

    def _prepare(self) -> None:
        """Strategies, pruning and grouping (lazy: ranks that only apply a plan skip them)."""
        if self.table is not None:
            return
        t = time.perf_counter()
        self.table = build_strategies(self.tg, self.mesh)
        self.timings["strategies"] = time.perf_counter() - t
        log.info(
            "traced %d nodes in %.2fs; strategies in %.2fs (memo %d hits / %d misses)",
            len(self.tg.gm.graph.nodes),
            self.timings["trace"],
            self.timings["strategies"],
            self.table.memo_hits,
            self.table.memo_misses,
        )
        self.estimator = Estimator(self.cost_model, tuple(self.mesh.shape))
        self.solver = PlacementSolver(
            self.tg,
            self.table,
            self.estimator,
            no_comm_edges=cast_edges(self.tg, self.table) if self.param_dtype is not None else (),
            regather=self._regather_setting(),
            recompute=self._recompute_setting(),
        )
        t = time.perf_counter()
        removed = prune_unreachable(self.table, self.estimator, self.solver.prices.no_comm_edges)
        self._cluster()
        self.timings["prune+cluster"] = time.perf_counter() - t
        log.info("pruned %d unreachable strategies", removed)

    def set_reshard_after_forward(self, policy: bool | str) -> None:
        """Change the `reshard_after_forward` setting (see the class docstring) before
        solving."""
        self.reshard_after_forward = check_reshard_policy(policy)
        if self.table is not None:
            self.solver.regather = self._regather_setting()

    def _regather_setting(self):
        return regather_setting(
            self.reshard_after_forward,
            list(self.param_shapes()),
            fsdp_units(self.model),
            self._traced_name,
        )

    def set_recompute(self, recompute: str | dict[str, str]) -> None:
        """Change the `recompute` setting (see the class docstring) before solving; a dict
        may name blocks of `self.blocks` once entered."""
        self._require_entered()
        if isinstance(recompute, dict):
            recompute = {str(b): check_policy(p) for b, p in recompute.items()}
        elif recompute != "auto":
            check_policy(recompute)
        self.recompute = recompute
        setting = self._recompute_setting()  # raises for a model it cannot apply to
        if self.table is not None:
            self.solver.recompute = setting

    def _recompute_setting(self) -> str | dict[str, dict[str, int]]:
        """The solver's recompute setting (recompute_program.py) for this model's trace."""
        if self.recompute in ("none", "auto") and not self.blocks:
            return "none"
        if not self.blocks:
            raise PlannerError(
                f"recompute={self.recompute!r} recomputes repeated blocks, and the model has "
                f"no stack of {repeat.MIN_BLOCKS} or more identical blocks (or "
                "share_repeated=False); use recompute='none'"
            )
        if isinstance(self.recompute, str):
            return self.recompute
        known = {lab for lab, _cls in self._block_classes()}
        unknown = sorted(set(self.recompute) - known)
        if unknown:
            raise PlannerError(
                f"recompute names block {unknown[0]!r}, which the model does not have; its "
                f"blocks are {sorted(known)[0]} ... {sorted(known)[-1]}"
            )
        counts: dict[str, dict[str, int]] = {}
        for lab, cls in self._block_classes():
            p = self.recompute.get(lab, "none")
            counts.setdefault(cls, {}).setdefault(p, 0)
            counts[cls][p] += 1
        return counts

    def _block_classes(self) -> list[tuple[str, str]]:
        """(label of each block of the whole model, label of the traced block for it)."""
        out = []
        for b in self.blocks:
            for i in range(len(b.keys)):
                j = b.representative(i) if self.tg.shallow else i
                out.append((f"{b.container}#{i}", f"{b.container}#{j}"))
        return out

    def recompute_policies(self, counts: dict[str, dict[str, int]]) -> dict[str, str]:
        """Each block's policy in the whole model, for the solver's per traced block
        `counts` (a pinned dict is returned as given)."""
        if not counts:
            return {}
        if isinstance(self.recompute, dict):
            return {lab: self.recompute.get(lab, "none") for lab, _cls in self._block_classes()}
        return {lab: next(iter(counts[cls])) for lab, cls in self._block_classes()}

    def _cluster(self) -> None:
        """Group identical nodes (cluster.py), keeping pinned nodes apart; redone when the pins
        change, so a pin never lands on a group shared with an unpinned node."""
        if not self.share_repeated:
            return
        pinned = frozenset(c.node for c in self._constraints if isinstance(c, Pin))
        if self._clustered_for == pinned:
            return
        names = {n: f for f, n in {**self.tg.params, **self.tg.buffers}.items()}
        self._rep = cluster_nodes(self.table, unique=pinned, names=names)
        self._clustered_for = pinned
        log.info(
            "%d nodes share %d variable groups", len(self.table.nodes), len(set(self._rep.values()))
        )

    def prepare(self) -> None:
        """Enumerate strategies, prune and group repeated nodes now (otherwise done lazily by
        the first `optimize_placement`); lets callers time the stages separately."""
        self._require_entered()
        self._prepare()

    def clear_constraints(self) -> None:
        """Drop every pin and budget added so far (to solve again under other constraints)."""
        self._constraints = []

    def _require_entered(self) -> None:
        if self.tg is None:
            raise PlannerError(
                "use AutoParallel as a context manager ('with AutoParallel(...) as autop')"
            )

    # ------------------------------------------------------------------ constraints
    def _check_placements(self, what: str, pl: Sequence[Placement]) -> P.Placements:
        if not isinstance(pl, (list, tuple)) or not all(isinstance(p, Placement) for p in pl):
            raise ConstraintError(f"{what}: expected a tuple of Placement objects, got {pl!r}")
        if len(pl) != self.mesh.ndim:
            raise ConstraintError(
                f"{what}: {len(pl)} placement(s) {P.fmt(pl)} for a {self.mesh.ndim}-D mesh "
                f"{tuple(self.mesh.shape)}"
            )
        for p in pl:
            if p.is_partial():
                raise ConstraintError(f"{what}: Partial is not allowed in a pin ({P.fmt(pl)})")
        return tuple(pl)

    def add_parameter_memory_constraint(
        self, low: float | None = None, high: float | None = None
    ) -> None:
        """Bound parameter bytes per rank, as a fraction of all parameter bytes.

        `high=None` means 1/world_size (fully sharded where shapes allow); `high=1.0` means no
        limit (the solver then usually replicates, DDP-like).  Each parameter's share is
        floored at its smallest achievable fraction, so unshardable tensors don't make it
        infeasible.
        """
        self._require_entered()
        if high is None:
            high = 1.0 / self.mesh.size()
        for name, v in (("low", low), ("high", high)):
            if v is not None and not (0.0 <= v <= 1.0):
                raise ConstraintError(f"parameter memory {name}={v} must be in [0, 1]")
        if low is not None and low > high:
            raise ConstraintError(f"parameter memory low={low} > high={high}")
        self._constraints = [c for c in self._constraints if not isinstance(c, ParameterBudget)]
        self._constraints.append(
            ParameterBudget(f"parameter memory budget low={low} high={high:.4g}", low, high)
        )

    def add_memory_constraint(self, bytes_per_rank: int | float) -> None:
        """Bound predicted bytes per rank: parameters + gradients + AdamW state (2 fp32 per
        element) + saved activations (forward tensors the backward reads), see memory.py."""
        self._require_entered()
        if not bytes_per_rank or bytes_per_rank <= 0:
            raise ConstraintError(
                f"memory budget must be a positive number of bytes, got {bytes_per_rank}"
            )
        self._constraints = [c for c in self._constraints if not isinstance(c, MemoryBudget)]
        self._constraints.append(
            MemoryBudget(
                f"memory budget {bytes_per_rank / 2**30:.4g} GiB per rank", float(bytes_per_rank)
            )
        )

    def add_input_constraints(self, placements: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple per flattened input (None leaves that input free)."""
        self._pin_each(
            "input",
            placements,
            lambda i, pl: Pin(f"input {i} pinned to {P.fmt(pl)}", self.tg.inputs[i], pl),
        )
        for i, pl in enumerate(placements):
            if pl is not None:
                self._check_even_split(i, pl)

    def _check_even_split(self, i: int, pl: Sequence[Placement]) -> None:
        """An input split unevenly (a batch of 6 on 4 ranks) would make every rank's mean
        loss weigh its rows differently from one process: refuse it."""
        shape = self.tg.inputs[i].meta["val"].shape
        names = self.mesh.mesh_dim_names or [f"dim{k}" for k in range(self.mesh.ndim)]
        for d in range(len(shape)):
            dims = [k for k, p in enumerate(pl) if isinstance(p, Shard) and p.dim == d]
            ways = math.prod(self.mesh.shape[k] for k in dims)
            if ways > 1 and shape[d] % ways:
                raise ConstraintError(
                    f"input {i} dim {d} has size {shape[d]}, which the {ways} ranks of mesh "
                    f"dim(s) {', '.join(names[k] for k in dims)} cannot split evenly; use a "
                    f"size divisible by {ways}"
                )

    def add_output_constraints(self, placements: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple per flattened forward output (None leaves it free)."""
        self._pin_each(
            "output",
            placements,
            lambda i, pl: OutputPin(f"output {i} pinned to {P.fmt(pl)}", i, pl),
        )

    def _pin_each(self, what: str, placements, make_constraint) -> None:
        self._require_entered()
        count = len(self.tg.inputs if what == "input" else self.tg.outputs)
        if len(placements) != count:
            raise ConstraintError(
                f"add_{what}_constraints: {len(placements)} pins for {count} {what}s"
            )
        for i, pl in enumerate(placements):
            if pl is not None:
                self._constraints.append(
                    make_constraint(i, self._check_placements(f"{what} {i}", pl))
                )

    def add_parameter_constraint(self, fqn: str, placements: Sequence[Placement]) -> None:
        """Pin one parameter's placement (call before `optimize_placement`)."""
        self._require_entered()
        if fqn not in self.param_shapes():
            raise ConstraintError(f"no parameter named '{fqn}'")
        pl = self._check_placements(f"parameter '{fqn}'", placements)
        node = self.tg.params[self._traced_name(fqn)]
        for c in self._constraints:
            if isinstance(c, Pin) and c.node is node:
                if c.placement != pl:
                    raise ConstraintError(
                        f"parameter '{fqn}' pinned to {P.fmt(pl)}, but {c.name}: identical "
                        "repeated blocks share one placement (use share_repeated=False)"
                    )
                return
        self._constraints.append(Pin(f"parameter '{fqn}' pinned to {P.fmt(pl)}", node, pl))

    # ------------------------------------------------------------------ solve
    def optimize_placement(
        self, verbose: bool = False, broadcast: bool = False, cache_dir: str | Path | None = None
    ) -> Plan:
        """Solve and return the plan.

        With `broadcast=True` and a real multi-rank process group, *all* ranks must call this:
        only rank 0 builds and solves the program and the others receive its plan (as JSON),
        so every rank applies the identical plan and the CPU cost is paid once.  With the
        default `False` the call is local (no collectives).  With `cache_dir` the plan is
        looked up there first and a new one is written there (plan_cache.py).
        """
        self._require_entered()
        if not broadcast and cache_dir is None:
            return self._solve_local(verbose)

        def plan_text() -> str:
            if cache_dir is None:
                return self._solve_local(verbose).to_json()
            return cached_or_solved(self, Path(cache_dir), lambda: self._solve_local(verbose))

        text = on_rank0(plan_text) if broadcast else plan_text()
        return Plan.from_json(text)

    def _solve_local(self, verbose: bool) -> Plan:
        self._prepare()
        self._cluster()
        sol = self.solver.solve(
            self._constraints, self.time_limit, verbose, rep=self._rep, proof_limit=self.proof_limit
        )
        self.timings["build"], self.timings["solve"] = sol.build_s, sol.solve_s
        plan = solution_to_plan(self, sol)
        log.info("plan:\n%s", plan.table())
        return plan

    # ------------------------------------------------------------------ apply
    def apply_placement(self, plan: Plan | None = None) -> nn.Module:
        self._require_entered()
        if plan is None:
            plan = self.optimize_placement()
        if not isinstance(plan, Plan):
            raise PlannerError(f"apply_placement expects a Plan, got {type(plan).__name__}")
        tg = self.tg
        if plan.blocks:  # planned on a shallow trace: run it on the whole model's graph
            tg = self.full_graph()
            plan = expand_plan(plan, tg)
        t = time.perf_counter()
        runner = GraphRunner(
            tg,
            plan,
            self.mesh,
            self.reduce_dtype,
            self.grad_reduction,
            self.backward,
            self.executor,
            self.reshard_after_forward,
            self.bucket,
            fsdp_units(self.model),
        )
        pm = build_parallel_module(self.model, tg, plan, self.mesh, runner)
        self.timings["apply"] = time.perf_counter() - t
        plan.timings["apply"] = self.timings["apply"]
        log.info("apply in %.2fs", self.timings["apply"])
        return pm
