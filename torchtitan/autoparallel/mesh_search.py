"""Choose the mesh as well as the shardings: plan every candidate mesh, keep the cheapest.

Users know their world size, not which split of it into data and tensor parallelism is
best.  The caller lists the candidate meshes (`factorisations` of the world into the mesh
dims it leaves open, filtered by what its model and machine allow); `search_meshes` plans
each one from a single trace (`AutoParallel.on_mesh`: strategies, costs and program are
per mesh) under the same constraints (`constrain(autop, candidate)` adds them: pins,
budgets), and chooses the smallest predicted step among those that fit.  A candidate the
memory budget rules out, or whose constraints cannot hold, is reported with the reason.
The answer carries the chosen candidate's plan (`MeshSearch.plan`): the caller applies it
on that mesh from the same trace (`autop.on_mesh(mesh).apply_placement(plan)`) instead of
tracing and solving the chosen mesh again.
Steps within `TIE_REL` of each other tie; the caller's `tie_break` key settles it (the
trainer prefers fewer tensor-parallel ranks).

The choice is certified: every solve proves how far its plan may be from that mesh's
optimum (`plan.solver["gap"]`), so no plan on a mesh can beat `step x (1 - gap)`.  When the
chosen step is at most every other candidate's bound, no other mesh holds a cheaper plan
under this cost model; `MeshSearch.proven_margin` says by how much.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from torchtitan.torch_private import planning_mesh

from .child_process import cores, map_in_children
from .errors import PlannerError
from .plan.cache import cached_plan, plan_key
from .plan.plan import Plan
from .solve.problem import PlanningProblem

log = logging.getLogger(__name__)

TIE_REL = 1e-6  # relative step difference below which two meshes tie


@dataclass(frozen=True)
class MeshCandidate:
    names: tuple[str, ...]
    shape: tuple[int, ...]

    def size(self, name: str) -> int:
        return dict(zip(self.names, self.shape)).get(name, 1)

    def label(self) -> str:
        return " x ".join(f"{n} {s}" for n, s in zip(self.names, self.shape))


@dataclass
class CandidateResult:
    mesh: MeshCandidate
    predicted: dict[str, float] = field(default_factory=dict)  # the plan's, when there is one
    gap: float | None = None  # proven relative gap of the plan on this mesh
    objective: float | None = None  # the solver's: step + tie-breaks (solver.TIE_BREAK_US)
    note: str = ""  # why there is no plan ("" when there is one)
    plan_s: float = 0.0
    detail: str = ""  # what else the candidate chose (a pipeline's stages)
    schedule: str = ""  # a pipelined candidate's schedule ("" without pipeline stages)
    microbatch_size: int = 0  # a pipelined candidate's, when searched (0: the job's)

    def label(self) -> str:
        """The mesh, and the schedule (and searched microbatch size) of a pipelined one."""
        text = self.mesh.label() + (f", {self.schedule}" if self.schedule else "")
        return text + (f", microbatch {self.microbatch_size}" if self.microbatch_size else "")

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON values (`from_dict` reads it back)."""
        return {**asdict(self), "mesh": {"names": self.mesh.names, "shape": self.mesh.shape}}

    @classmethod
    def from_dict(cls, r: dict[str, Any]) -> CandidateResult:
        return cls(
            mesh=MeshCandidate(tuple(r["mesh"]["names"]), tuple(r["mesh"]["shape"])),
            predicted=r["predicted"],
            gap=r["gap"],
            objective=r["objective"],
            note=r["note"],
            plan_s=r["plan_s"],
            detail=r.get("detail", ""),
            schedule=r.get("schedule", ""),
            microbatch_size=r.get("microbatch_size", 0),
        )

    @property
    def fits(self) -> bool:
        return not self.note

    @property
    def step_us(self) -> float:
        return self.predicted.get("step_us", math.inf) if self.fits else math.inf

    @property
    def lower_bound(self) -> float:
        """No plan on this mesh has a smaller objective (the solver's proof); inf when the
        mesh has no plan at all."""
        if not self.fits or self.objective is None:
            return math.inf
        return self.objective * (1.0 - (self.gap if self.gap is not None else 1.0))


@dataclass
class MeshSearch:
    world: int
    results: list[CandidateResult]
    chosen: int  # index into results
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (mesh label, why not tried)
    plan: Plan | None = None  # the chosen candidate's plan (None: not kept)

    @property
    def best(self) -> CandidateResult:
        return self.results[self.chosen]

    @property
    def proven_margin(self) -> float | None:
        """min over the other candidates of (their lower bound / the chosen objective) - 1,
        in the solver's objective (the step plus its tie-breaks of 0.01 us per placement
        change): >= 0 means no other mesh can be cheaper; inf when no other mesh has a
        plan; None when there is no other candidate."""
        others = [
            r.lower_bound
            for i, r in enumerate(self.results)
            if i != self.chosen and i not in self.tied
        ]
        best = self.best.objective
        if not others or best is None:
            return None
        return min(others) / best - 1.0

    @property
    def tied(self) -> list[int]:
        """Other candidates whose predicted step equals the chosen one's (within TIE_REL):
        the caller's tie-break chose between them."""
        best = self.best.step_us
        return [
            i
            for i, r in enumerate(self.results)
            if i != self.chosen and r.fits and abs(r.step_us - best) <= TIE_REL * abs(best)
        ]

    def table(self) -> str:
        rows = [("", "mesh", "step ms", "exposed comm ms", "memory/rank GiB", "fits", "plan s")]
        for i, r in enumerate(self.results):
            p = r.predicted
            rows.append(
                (
                    "*" if i == self.chosen else "",
                    r.label(),
                    f"{r.step_us / 1e3:.2f}" if r.fits else "-",
                    f"{p['exposed_comm_us'] / 1e3:.2f}" if r.fits else "-",
                    f"{p['peak_bytes_per_rank'] / 2**30:.2f}" if r.fits else "-",
                    "yes" if r.fits else f"no: {r.note}",
                    f"{r.plan_s:.1f}",
                )
            )
        widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]) - 1)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)).rstrip() + "  " + row[-1]
            for row in rows
        ]
        lines += [f"   {r.label()}: {r.detail}" for r in self.results if r.detail]
        lines += [f"   {label}: not planned, {why}" for label, why in self.skipped]
        return "\n".join(lines)

    def verdict(self) -> str:
        best, margin = self.best, self.proven_margin
        ties = ", ".join(self.results[i].label() for i in self.tied)
        if margin is None:
            proof = f"tied with {ties}" if ties else "the only candidate"
        elif margin == math.inf:
            proof = "the only one with a plan"
        elif margin >= 0:
            proof = f"proven best: every other mesh's plans are at least {margin:.2%} slower"
        else:
            proof = f"best found; the solver's gaps leave {-margin:.2%} for another mesh"
        if ties and margin is not None:
            proof = f"tied with {ties}; {proof}"
        return (
            f"mesh search (world {self.world}, {len(self.results)} candidates): "
            f"{best.label()}, predicted step {best.step_us / 1e3:.2f} ms ({proof})"
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "world": self.world,
                "chosen": self.chosen,
                "results": [r.to_dict() for r in self.results],
                "skipped": self.skipped,
                "proven_margin": (
                    None if self.proven_margin in (None, math.inf) else self.proven_margin
                ),
                "plan": json.loads(self.plan.to_json()) if self.plan is not None else None,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> MeshSearch:
        data = json.loads(text)
        results = [CandidateResult.from_dict(r) for r in data["results"]]
        skipped = [tuple(s) for s in data["skipped"]]
        plan = data.get("plan")
        plan = Plan.from_json(json.dumps(plan)) if plan is not None else None
        return cls(data["world"], results, data["chosen"], skipped, plan)


def proven_gap(plan: Plan) -> float | None:
    """The relative gap the plan's solve proved, None when it proved none (no bound)."""
    gap = plan.solver.get("gap")
    return gap if gap is not None and math.isfinite(gap) else None


def factorisations(world: int, dims: Sequence[tuple[str, int | None]]) -> list[dict[str, int]]:
    """Every assignment of sizes to the dims given as None (the others keep theirs) whose
    product is `world`, in order of the sizes of the dims as listed."""
    fixed = math.prod(size for _, size in dims if size is not None)
    if world % fixed:
        return []
    open_dims = [name for name, size in dims if size is None]

    def split(rest: int, names: list[str]) -> list[dict[str, int]]:
        if not names:
            return [{}] if rest == 1 else []
        if len(names) == 1:
            return [{names[0]: rest}]
        return [
            {names[0]: d, **tail}
            for d in range(1, rest + 1)
            if rest % d == 0
            for tail in split(rest // d, names[1:])
        ]

    return [
        {name: (size if size is not None else sizes[name]) for name, size in dims}
        for sizes in split(world // fixed, open_dims)
    ]


def search_meshes(
    autop: Any,
    candidates: Sequence[MeshCandidate],
    constrain: Callable[[Any, MeshCandidate], None],
    tie_break: Callable[[MeshCandidate], Any] | None = None,
    cache_dir: str | Path | None = None,
    device_type: str = "cpu",
    skipped: Sequence[tuple[str, str]] = (),
    workers: int | None = None,
) -> MeshSearch:
    """Plan `autop`'s model (an entered `AutoParallel`) on every candidate and choose;
    the answer holds the chosen candidate's plan (`MeshSearch.plan`), to apply from
    `autop`'s trace on the real mesh of that shape without solving it again.

    Runs in this process only (the candidates' meshes have no process groups); a trainer
    calls it on one rank and shares the answer (`to_json` carries the plan).  With
    `cache_dir` every candidate's plan is read from / written to the plan cache, so a
    restart repeats the search from the cache.  `workers`: how many candidates' programs
    are solved at once (`plan_candidates`).
    """
    if not candidates:
        raise PlannerError("mesh search: no candidate mesh")
    planned = plan_candidates(autop, candidates, constrain, cache_dir, device_type, workers)
    return choose(planned, tie_break, skipped)


def plan_candidates(
    autop: Any,
    candidates: Sequence[MeshCandidate],
    constrain: Callable[[Any, MeshCandidate], None],
    cache_dir: str | Path | None = None,
    device_type: str = "cpu",
    workers: int | None = None,
) -> list[tuple[CandidateResult, Plan | None]]:
    """Each candidate's result and plan (None where it has none: the result says why),
    planned from `autop`'s trace under `constrain`'s constraints.

    Each candidate's program is made here, one after another (strategies on its mesh,
    constraints); the distinct programs are then solved side by side, each in a forked
    child process, `workers` at a time (default: the cores this process may run on).  A
    candidate whose program is one already listed under other mesh-dim names (dp_replicate
    4 beside dp_shard 4: the planner places the parameters itself, so the names do not
    change the program) takes that plan, renamed, without solving."""
    prepared: list[tuple[CandidateResult, Any, PlanningProblem | None, str | None]] = []
    for cand in candidates:
        t0 = time.perf_counter()
        sub = autop.on_mesh(planning_mesh(device_type, cand.shape, cand.names))
        result = CandidateResult(cand)
        try:
            constrain(sub, cand)
            problem = sub.problem()
            prepared.append((result, sub, problem, plan_key(problem, names=False)))
        except PlannerError as e:  # a pin that cannot hold on this mesh
            result.note = _first_line(e)
            prepared.append((result, sub, None, None))
        result.plan_s = time.perf_counter() - t0
    first_of: dict[str, int] = {}  # program key -> the first candidate with that program
    for i, (*_, key) in enumerate(prepared):
        if key is not None:
            first_of.setdefault(key, i)
    solving = list(first_of.values())

    def solve(i: int) -> str:
        _, sub, problem, _ = prepared[i]
        t0 = time.perf_counter()
        plan = sub.solve_problem(problem, cache_dir)
        return json.dumps({"plan": plan.to_json(), "seconds": time.perf_counter() - t0})

    fns = [partial(solve, i) for i in solving]
    answers = dict(zip(solving, map_in_children(fns, workers or cores())))
    out = []
    for i, (result, _, problem, key) in enumerate(prepared):
        plan: Plan | None = None
        if key is not None and problem is not None:
            first = first_of[key]
            answer = answers[first]
            if isinstance(answer, PlannerError):  # infeasible under the budget, say
                result.note = _first_line(answer)
            elif isinstance(answer, Exception):
                raise answer
            else:
                solved = json.loads(answer)
                plan = Plan.from_json(solved["plan"])
                if first == i:
                    result.plan_s += solved["seconds"]
                else:
                    plan = _renamed(plan, problem, cache_dir)
                    twin = prepared[first][0].mesh.label()
                    result.detail = f"the program of {twin} under other names: its plan"
                result.predicted = dict(plan.predicted)
                result.gap = proven_gap(plan)
                result.objective = plan.solver.get("objective")
        log.info(
            "mesh %s: %s in %.1fs",
            result.mesh.label(),
            f"step {result.step_us / 1e3:.2f} ms" if result.fits else result.note,
            result.plan_s,
        )
        out.append((result, plan))
    return out


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _renamed(plan: Plan, problem: PlanningProblem, cache_dir: str | Path | None) -> Plan:
    """`plan` for `problem`'s mesh-dim names (cached under its own key, like a solved one)."""
    names = list(problem.mesh.mesh_dim_names or ())
    return cached_plan(problem, cache_dir, lambda: dataclasses.replace(plan, mesh_dim_names=names))


def choose(
    planned: Sequence[tuple[CandidateResult, Plan | None]],
    tie_break: Callable[[MeshCandidate], Any] | None = None,
    skipped: Sequence[tuple[str, str]] = (),
) -> MeshSearch:
    """The fastest of the planned candidates that fit (the caller's `tie_break` key among
    those within `TIE_REL`), or a `PlannerError` listing why none has a plan."""
    results = [r for r, _ in planned]
    fitting = [i for i, r in enumerate(results) if r.fits]
    if not fitting:
        notes = "; ".join(f"{r.label()}: {r.note}" for r in results)
        raise PlannerError(f"mesh search: no candidate mesh has a plan ({notes})")
    fastest = min(results[i].step_us for i in fitting)
    tied = [i for i in fitting if results[i].step_us <= fastest * (1 + TIE_REL)]
    chosen = min(tied, key=lambda i: tie_break(results[i].mesh)) if tie_break else tied[0]
    world = math.prod(results[0].mesh.shape)
    return MeshSearch(world, results, chosen, list(skipped), planned[chosen][1])
