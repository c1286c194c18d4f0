"""Names of the places where the placement program redistributes a value (solve/program.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class ConsumerEdge:
    """Input `arg` of `node`: where a value is redistributed for its consumer."""

    node: fx.Node
    arg: int


@dataclass(frozen=True)
class HubEdge:
    """Output `index` of `node` into its hub (one redistribution shared by consumers)."""

    node: fx.Node
    index: int


@dataclass(frozen=True)
class GradEdge:
    """The gradient of parameter `fqn` into the parameter's placement."""

    fqn: str


@dataclass(frozen=True)
class InputGradEdge:
    """The gradient of input `index` into the input's placement."""

    index: int


@dataclass(frozen=True)
class OutputEdge:
    """Forward output `index` into its sink placement."""

    index: int


EdgeKey = ConsumerEdge | HubEdge | GradEdge | InputGradEdge | OutputEdge
