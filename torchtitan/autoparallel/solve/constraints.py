"""The user's constraints on a plan (pins and budgets), each named for error messages."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..graph import placements as P


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
    """Predicted bytes per rank (memory.py) at most `bytes_per_rank`."""

    name: str
    bytes_per_rank: float


UserConstraint = Pin | OutputPin | ParameterBudget | MemoryBudget
