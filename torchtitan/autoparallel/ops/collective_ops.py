"""Ops whose sharding strategies include a collective inside the op.

DTensor's rules describe ops that run on local shards as they are.  Some layouts of an op
need ranks to exchange data in the middle of it — expert parallelism sends each token to
the rank holding its expert, with sizes known only at run time.  An op registered here
states, per mesh dim, the options it can take (`DimOption`, one marked `collective` when
the op exchanges data over that mesh dim), the communication that costs, and how to run it
on local tensors:

* the strategy table (strategies/table.py) takes the product of the options over the mesh
  dims, at most one of them collective, instead of asking DTensor;
* the cost model adds `comm(...)` to the op's compute time;
* the interpreter (and so the lowering) calls `run_local(...)` when the strategy the plan
  chose has a collective dim; other strategies run through DTensor's own rules, which the
  op registers for its collective-free options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch._ops import OpOverload
from torch.distributed.tensor import Placement


@dataclass(frozen=True)
class DimOption:
    """One mesh dim's placement of each output and each tensor input."""

    out: tuple[Placement, ...]
    ins: tuple[Placement, ...]
    collective: bool = False


@dataclass(frozen=True)
class CollectiveOp:
    # (node's tensor input values, output values, size of the mesh dim) -> its options
    options: Callable[[list, list, int], list[DimOption]]
    # (tensor input placements of a strategy) -> the mesh dim it exchanges data over, or None
    collective_dim: Callable[[list], int | None]
    # (tensor input values, their placements, mesh shape) -> (all-to-alls, bytes each rank
    # sends in all of them) over the collective dim, for a strategy that has one
    comm: Callable[[list, list, tuple[int, ...]], tuple[int, float]]
    # (args with DTensor inputs already in the plan's placements, the output values (global
    # shapes), the plan's output placements, mesh) -> the outputs as DTensors, or None when
    # no dim of that strategy is collective
    run_local: Callable[[tuple, list, list, object], tuple | None]


# keyed by op; looked up with any fx node target
COLLECTIVE_OPS: dict[Any, CollectiveOp] = {}


def register(op: OpOverload, rule: CollectiveOp) -> None:
    COLLECTIVE_OPS[op] = rule
