"""Why each parameter group is placed as it is, read off plans already solved: the
collectives its placement implies, and what each other priced plan that places the group
differently predicts (the hand-written plans `scripts/plan.py` prices, the alternatives
`--explain` solves).

A parameter group is the parameters the plan summary shows on one line (same name up to
the layer index, same shape).  For each other plan that places the group another way, a
reason gives the predicted step of both and the group's own redistributions in both (its
gathers, its gradient's reduction where it is redistributed as a gradient, and those of
the values it feeds directly: `Plan.param_comm_us`; a collective the placement moves onto
the activations shows in the step, not here).  Per other placement of the group only the
fastest plan that has it counts; the top reasons are those whose step the chosen plan
beats by the most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..graph import placements as P
from ..trace.repeat import name_pattern
from .plan import Plan


@dataclass(frozen=True)
class Reason:
    """The chosen plan against one other plan that places the group differently."""

    label: str  # the other plan's name: "FSDP+TP", "w2 at S(0),R", ...
    placement: str  # the group's placement there
    group_comm_us: tuple[float, float]  # the group's communication: chosen, other
    step_us: tuple[float, float]  # the predicted step: chosen, other

    def __str__(self) -> str:
        (mine, its), (step, other_step) = self.group_comm_us, self.step_us
        other = self.label if self.placement in self.label else f"{self.label} ({self.placement})"
        return (
            f"vs {other}: step {step / 1e3:.3f} vs {other_step / 1e3:.3f} ms "
            f"({(step - other_step) / 1e3:+.3f}); this group's own redistributions "
            f"{mine / 1e3:.3f} vs {its / 1e3:.3f} ms"
        )


def parameter_groups(plan: Plan) -> dict[str, list[str]]:
    """Group pattern (layer index as `*`) -> its parameters, in the plan's order; one group
    per pattern and shape."""
    groups: dict[str, list[str]] = {}
    for fqn in plan.params:
        shape = "x".join(map(str, plan.param_shapes.get(fqn, [])))
        groups.setdefault(f"{name_pattern(fqn)} {shape}".strip(), []).append(fqn)
    return groups


def implied_collectives(plan: Plan, fqn: str) -> str:
    """What `fqn`'s placement means for communication, mesh dim by mesh dim: over a dim
    that splits the batch, a split parameter is gathered before use and its gradient
    reduce-scattered (FSDP-like), a replicated one has its gradient all-reduced (DDP-like);
    over any other dim a split parameter is used in slices (tensor parallel: the
    activations communicate instead), a replicated one is used whole."""
    batch_dims = _batch_dims(plan)
    parts = []
    for k, (name, p) in enumerate(zip(plan.mesh_dim_names, P.parse(plan.params[fqn]))):
        if plan.mesh_shape[k] == 1:
            continue
        if k in batch_dims:
            what = "all-gather, gradient reduce-scatter" if p.is_shard() else "gradient all-reduce"
        else:
            what = "used in slices, activations communicate" if p.is_shard() else "used whole"
        parts.append(f"{name}: {what}")
    return "; ".join(parts) or "one rank: no communication"


def group_reasons(
    chosen: Plan, others: Mapping[str, Plan], top: int = 3
) -> dict[str, list[Reason]]:
    """Group -> up to `top` reasons, one per other placement of the group (its fastest
    plan), most step saved first; groups no other plan places differently have none."""
    out: dict[str, list[Reason]] = {}
    for group, fqns in parameter_groups(chosen).items():
        reasons = []
        for label, other in others.items():
            if any(f not in other.params for f in fqns):
                continue
            if all(other.params[f] == chosen.params[f] for f in fqns):
                continue
            reasons.append(
                Reason(
                    label,
                    other.params[fqns[0]],
                    (_comm(chosen, fqns), _comm(other, fqns)),
                    (chosen.predicted["step_us"], other.predicted["step_us"]),
                )
            )
        best: dict[str, Reason] = {}  # per other placement, the fastest plan that has it
        for r in reasons:
            if r.placement not in best or r.step_us[1] < best[r.placement].step_us[1]:
                best[r.placement] = r
        ranked = sorted(best.values(), key=lambda r: r.step_us[0] - r.step_us[1])
        if ranked:
            out[group] = ranked[:top]
    return out


def _comm(plan: Plan, fqns: Sequence[str]) -> float:
    return sum(plan.param_comm_us.get(f, 0.0) for f in fqns)


def _batch_dims(plan: Plan) -> set[int]:
    """Mesh dims over which the first input (the batch) is split along dim 0."""
    if not plan.inputs:
        return set()
    return {k for k, p in enumerate(P.parse(plan.inputs[0])) if p.is_shard(0)}
