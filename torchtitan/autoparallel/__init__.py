"""Automatic sharding planner: trace -> strategies -> cost -> solve -> apply.

A standalone library (no trainer imports).  See `api.AutoParallel` for the entry point.
"""

from .api import AutoParallel
from .cost.model import DEVICES, LINKS, CostModel, DeviceSpec, LinkSpec
from .errors import ConstraintError, InfeasiblePlanError, PlannerError, UnsupportedOpError
from .plan.plan import Plan

__all__ = [
    "AutoParallel",
    "Plan",
    "CostModel",
    "DeviceSpec",
    "LinkSpec",
    "DEVICES",
    "LINKS",
    "PlannerError",
    "ConstraintError",
    "InfeasiblePlanError",
    "UnsupportedOpError",
]
