"""Two plans side by side: their meshes, predicted costs, and the parameters placed apart.

Parameters are compared by name pattern (layer indices as `*`, repeat.py): a pattern is listed
when its placements differ between the plans (or it is in one plan only), each side as the
set of placements its parameters take, written per mesh dim (`dp:S(0), tp:R`).  Works across
meshes and precisions: what differs is shown, never refused.
"""

from __future__ import annotations

from collections import defaultdict

from ..trace.repeat import name_pattern
from .display import describe
from .plan import Plan

# predicted figures compared, with how to print them
_FIGURES = (
    ("step_us", "predicted step ms", 1e-3),
    ("compute_us", "compute ms", 1e-3),
    ("comm_us", "communication ms", 1e-3),
    ("exposed_comm_us", "exposed communication ms", 1e-3),
    ("peak_bytes_per_rank", "peak memory GiB/rank", 2.0**-30),
)


def _placements_by_pattern(plan: Plan) -> dict[str, set[str]]:
    names = plan.mesh_dim_names or [f"d{i}" for i in range(len(plan.mesh_shape))]
    out: dict[str, set[str]] = defaultdict(set)
    for fqn, pl in plan.params.items():
        out[name_pattern(fqn)].add(describe(pl, names))
    return out


def _mesh(plan: Plan) -> str:
    names = plan.mesh_dim_names or [f"d{i}" for i in range(len(plan.mesh_shape))]
    return " x ".join(f"{n}={s}" for n, s in zip(names, plan.mesh_shape))


def plan_diff(a: Plan, b: Plan, labels: tuple[str, str] = ("a", "b")) -> str:
    """A text report of what differs between plans `a` and `b`."""
    la, lb = labels
    lines = [f"mesh: {la} {_mesh(a)} | {lb} {_mesh(b)}", ""]
    lines.append(f"{'':<28} {la:>16} {lb:>16}")
    for key, label, scale in _FIGURES:
        if key in a.predicted or key in b.predicted:
            va, vb = (
                f"{p.predicted[key] * scale:.3f}" if key in p.predicted else "-" for p in (a, b)
            )
            lines.append(f"{label:<28} {va:>16} {vb:>16}")
    pa, pb = _placements_by_pattern(a), _placements_by_pattern(b)
    differ = [p for p in sorted(pa.keys() | pb.keys()) if pa.get(p) != pb.get(p)]
    lines.append("")
    if not differ:
        lines.append(f"every parameter is placed alike ({len(pa)} patterns)")
        return "\n".join(lines)
    lines.append(f"{len(differ)} of {len(pa.keys() | pb.keys())} parameter patterns placed apart:")
    for pattern in differ:
        left = " | ".join(sorted(pa.get(pattern, {"(absent)"})))
        right = " | ".join(sorted(pb.get(pattern, {"(absent)"})))
        lines.append(f"  {pattern}\n    {la}: {left}\n    {lb}: {right}")
    return "\n".join(lines)
