"""Errors raised by the planner.

Every user-facing failure is a `PlannerError` (a `ValueError`) with a one-line message that
names the offending thing (a node, an op, a pin), so callers can catch one type.
"""


class PlannerError(ValueError):
    """A problem with the planner's inputs or with a plan; the message names the culprit."""


class UnsupportedOpError(PlannerError):
    """An op in the traced graph has no sharding rule (DTensor's or ours)."""


class InfeasiblePlanError(PlannerError):
    """The solver found no placement satisfying the constraints (the message names them)."""


class ConstraintError(PlannerError):
    """A user constraint is malformed (wrong number of mesh dims, wrong count, bad type)."""
