"""The user's constraints on a plan (pins and budgets), each named for error messages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from ..errors import ConstraintError
from ..graph import placements as P
from ..trace.joint import TracedGraph


@dataclass(frozen=True)
class Pin:
    """Node `node` (an input or parameter placeholder) outputs `placement`."""

    name: str  # human-readable, used in error messages
    node: fx.Node
    placement: P.Placements


@dataclass(frozen=True)
class OutputPin:
    """Forward output `index` leaves the graph in `placement`."""

    name: str
    index: int
    placement: P.Placements


@dataclass(frozen=True)
class ParameterBudget:
    """Parameter bytes per rank between `low` and `high`, as fractions of all of them."""

    name: str
    low: float | None
    high: float


@dataclass(frozen=True)
class MemoryBudget:
    """Predicted bytes per rank (memory.py) at most `bytes_per_rank`, the activations saved
    for backward counted `in_flight` times (a pipeline stage holds several microbatches'
    at once)."""

    LABEL: ClassVar[str] = "memory budget"  # how its name starts, in an infeasibility message

    name: str
    bytes_per_rank: float
    in_flight: float = 1.0


@dataclass(frozen=True)
class CollectiveDim:
    """Ops with a collective layout (ops/collective_ops.py: the routed experts) use it over
    mesh dim `dim` — expert parallelism over that dim."""

    name: str
    dim: int


UserConstraint = Pin | OutputPin | ParameterBudget | MemoryBudget | CollectiveDim


# ---------------------------------------------------------------------------- from user input
def check_placements(what: str, pl: Sequence[Placement], mesh: DeviceMesh) -> P.Placements:
    """`pl` as a placement tuple for `mesh`, or a `ConstraintError` naming `what`."""
    if not isinstance(pl, (list, tuple)) or not all(isinstance(p, Placement) for p in pl):
        raise ConstraintError(f"{what}: expected a tuple of Placement objects, got {pl!r}")
    if len(pl) != mesh.ndim:
        raise ConstraintError(
            f"{what}: {len(pl)} placement(s) {P.fmt(pl)} for a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}"
        )
    for p in pl:
        if p.is_partial():
            raise ConstraintError(f"{what}: Partial is not allowed in a pin ({P.fmt(pl)})")
    return tuple(pl)


def parameter_budget(low: float | None, high: float | None, world: int) -> ParameterBudget:
    """Parameter bytes per rank as a fraction of all of them; `high=None` is 1/world."""
    if high is None:
        high = 1.0 / world
    for name, v in (("low", low), ("high", high)):
        if v is not None and not (0.0 <= v <= 1.0):
            raise ConstraintError(f"parameter memory {name}={v} must be in [0, 1]")
    if low is not None and low > high:
        raise ConstraintError(f"parameter memory low={low} > high={high}")
    return ParameterBudget(f"parameter memory budget low={low} high={high:.4g}", low, high)


def expert_parallel(mesh: DeviceMesh, dim: int | str) -> CollectiveDim:
    """Experts split over mesh dim `dim` (an index or a name)."""
    names = mesh.mesh_dim_names or ()
    if isinstance(dim, str):
        if dim not in names:
            raise ConstraintError(
                f"expert parallelism over mesh dim {dim!r}: mesh dims are {names}"
            )
        dim = names.index(dim)
    if not 0 <= dim < mesh.ndim:
        raise ConstraintError(f"expert parallelism over mesh dim {dim} of a {mesh.ndim}-D mesh")
    label = names[dim] if names else str(dim)
    return CollectiveDim(f"experts split over mesh dim {label} ({mesh.shape[dim]} ranks)", dim)


def memory_budget(bytes_per_rank: int | float, in_flight: float = 1.0) -> MemoryBudget:
    if not bytes_per_rank or bytes_per_rank <= 0:
        raise ConstraintError(
            f"memory budget must be a positive number of bytes, got {bytes_per_rank}"
        )
    if in_flight < 1:
        raise ConstraintError(f"microbatches in flight must be at least 1, got {in_flight}")
    held = f" ({in_flight:g} microbatches' activations in flight)" if in_flight > 1 else ""
    return MemoryBudget(
        f"{MemoryBudget.LABEL} {bytes_per_rank / 2**30:.4g} GiB per rank{held}",
        float(bytes_per_rank),
        float(in_flight),
    )


def _pin_each(
    what: str, count: int, placements: Sequence[Sequence[Placement] | None], mesh: DeviceMesh
) -> list[tuple[int, P.Placements]]:
    if len(placements) != count:
        raise ConstraintError(f"add_{what}_constraints: {len(placements)} pins for {count} {what}s")
    return [
        (i, check_placements(f"{what} {i}", pl, mesh))
        for i, pl in enumerate(placements)
        if pl is not None
    ]


def input_pins(
    tg: TracedGraph, mesh: DeviceMesh, placements: Sequence[Sequence[Placement] | None]
) -> list[Pin]:
    """One pin per input given a placement tuple (None leaves that input free)."""
    pins = []
    for i, pl in _pin_each("input", len(tg.inputs), placements, mesh):
        _check_even_split(tg, mesh, i, pl)
        pins.append(Pin(f"input {i} pinned to {P.fmt(pl)}", tg.inputs[i], pl))
    return pins


def output_pins(
    tg: TracedGraph, mesh: DeviceMesh, placements: Sequence[Sequence[Placement] | None]
) -> list[OutputPin]:
    """One pin per forward output given a placement tuple (None leaves it free)."""
    return [
        OutputPin(f"output {i} pinned to {P.fmt(pl)}", i, pl)
        for i, pl in _pin_each("output", len(tg.outputs), placements, mesh)
    ]


def parameter_pin(
    tg: TracedGraph,
    mesh: DeviceMesh,
    fqn: str,
    traced: str,
    placements: Sequence[Placement],
    existing: Sequence[UserConstraint],
) -> Pin | None:
    """The pin of parameter `fqn` (traced as `traced`); None when an identical repeated
    block's parameter is pinned the same way already, an error when differently."""
    pl = check_placements(f"parameter '{fqn}'", placements, mesh)
    node = tg.params[traced]
    for c in existing:
        if isinstance(c, Pin) and c.node is node:
            if c.placement != pl:
                raise ConstraintError(
                    f"parameter '{fqn}' pinned to {P.fmt(pl)}, but {c.name}: identical "
                    "repeated blocks share one placement (use share_repeated=False)"
                )
            return None
    return Pin(f"parameter '{fqn}' pinned to {P.fmt(pl)}", node, pl)


def _check_even_split(tg: TracedGraph, mesh: DeviceMesh, i: int, pl: P.Placements) -> None:
    """An input split unevenly (a batch of 6 on 4 ranks) would make every rank's mean
    loss weigh its rows differently from one process: refuse it."""
    shape = tg.inputs[i].meta["val"].shape
    names = mesh.mesh_dim_names or [f"dim{k}" for k in range(mesh.ndim)]
    for d in range(len(shape)):
        dims = [k for k, p in enumerate(pl) if isinstance(p, Shard) and p.dim == d]
        ways = math.prod(mesh.shape[k] for k in dims)
        if ways > 1 and shape[d] % ways:
            raise ConstraintError(
                f"input {i} dim {d} has size {shape[d]}, which the {ways} ranks of mesh "
                f"dim(s) {', '.join(names[k] for k in dims)} cannot split evenly; use a "
                f"size divisible by {ways}"
            )
