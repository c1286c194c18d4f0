"""The planning problem: everything one solve depends on, in one frozen object.

`AutoParallel` (api.py) assembles it from the trace, the strategy table of its mesh, the
settings and the user's constraints; the solver, the report that writes the plan and the plan
cache read only this.  Changing a setting or a constraint makes a new problem.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..cost.model import CostModel
from ..policies import recompute as recompute_policy
from ..policies.regather import Regather, regather_setting
from ..strategies.table import StrategyTable
from ..trace import repeat
from ..trace.joint import TracedGraph
from .constraints import UserConstraint
from .prices import GraphPrices


@dataclass(frozen=True)
class PlanSettings:
    """How to plan: `recompute` per block (a policy, "auto", or block label -> policy),
    `reshard_after_forward` ("always", "never", "default" or "auto"), and the solver's
    time limit and proof limit in seconds."""

    recompute: str | Mapping[str, str] = "none"
    reshard_after_forward: str = "always"
    time_limit: float = 300.0
    proof_limit: float = 15.0


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of the whole model (not its trace): parameter shapes and buffer
    names in model order, and its FSDP units (policies/units.py)."""

    param_shapes: Mapping[str, list[int]]
    buffer_names: tuple[str, ...]
    units: tuple[str, ...]


@dataclass(frozen=True)
class PlanningProblem:
    """One solve's input.  `tg` is the planning trace (shallow when `blocks` repeat);
    `prices` memoises what the program prices on this graph and mesh; `rep` maps each node
    to the one whose variables it shares (strategies/cluster.py; None: no sharing)."""

    tg: TracedGraph
    table: StrategyTable
    mesh: DeviceMesh
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    cost_model: CostModel
    prices: GraphPrices
    blocks: tuple[repeat.RepeatedBlocks, ...]
    model: ModelFacts
    settings: PlanSettings
    constraints: tuple[UserConstraint, ...]
    rep: Mapping | None

    def traced_name(self, fqn: str) -> str:
        """Name in the traced graph of the model's parameter or buffer `fqn`."""
        return repeat.reduced_fqn(fqn, list(self.blocks)) if self.tg.shallow else fqn

    @functools.cached_property
    def regather(self) -> Regather:
        """The keep-or-gather-again setting in the trace's parameter names."""
        return regather_setting(
            self.settings.reshard_after_forward,
            list(self.model.param_shapes),
            list(self.model.units),
            self.traced_name,
        )

    @functools.cached_property
    def recompute(self) -> str | dict[str, dict[str, int]]:
        """The program's recompute setting for this trace (raises for a model it cannot
        apply to)."""
        return recompute_policy.solver_setting(
            self.settings.recompute, self.blocks, self.tg.shallow
        )

    def recompute_policies(self, counts: dict[str, dict[str, int]]) -> dict[str, str]:
        """Each block's policy in the whole model for the solver's per-traced-block counts."""
        return recompute_policy.whole_model_policies(
            self.settings.recompute, counts, self.blocks, self.tg.shallow
        )
