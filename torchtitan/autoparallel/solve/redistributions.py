"""Which redistributions the program offers on an edge, and the example value of a source."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from ..graph import placements as P


@functools.cache
def direct(o: P.Placements, r: P.Placements) -> bool:
    """Redistributions the program may use: at most one collective (slicing is free).

    Dropping multi-collective changes (except "to fully replicated") keeps edge variables near
    O(placements) per edge instead of O(placements^2); since every placement can reach
    all-Replicate, and every op has an all-Replicate strategy, the program stays feasible.
    """
    if o == r:
        return True
    if all(isinstance(p, Replicate) for p in r):
        return True
    return sum(a != b and not isinstance(a, Replicate) for a, b in zip(o, r)) <= 1


@functools.cache
def finite(o: P.Placements, r: P.Placements) -> bool:
    """Whether the cost model allows o -> r at all (shape-independent: only Partial targets
    fail)."""
    return all(a == b or not b.is_partial() for a, b in zip(o, r))


def source_value(src: tuple[fx.Node, int]) -> torch.Tensor:
    node, idx = src
    v = node.meta["val"]
    if isinstance(v, (list, tuple)):
        return v[idx]
    return v
