"""What a lowered plan's graphs (lower.Partition) do with the parameters, read off the graphs:
shared by the executor's and re-gather's unit tests and the 4-rank numerics checks."""

from __future__ import annotations

from torchtitan.autoparallel.execute.buckets import AG
from torchtitan.autoparallel.graph.nodes import param_side
from torchtitan.autoparallel.policies.units import unit_of


def param_gathers(part, graph: str) -> list:
    """All-gathers of `graph` ("fwd" or "bwd") computed from parameters alone (the plan may
    gather activations too)."""
    gm = getattr(part, graph)
    names = part.fwd_names if graph == "fwd" else part.saved_names
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    side = param_side(gm.graph.nodes, {n for n, f in zip(phs, names) if f is not None})
    return [n for n in gm.graph.nodes if n.target is AG and n in side]


def gathered_units(part, ag, units: list[str]) -> set[str]:
    """The FSDP units (`units`: units.fsdp_units) of the parameters backward gather `ag`
    reads."""
    phs = [n for n in part.bwd.graph.nodes if n.op == "placeholder"]
    fqn = {n: f for n, f in zip(phs, part.saved_names) if f is not None}
    seen, stack = set(), [ag]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return {unit_of(fqn[n], units) for n in seen if n in fqn}


def backward_gathered_units(part, units: list[str]) -> set[str]:
    """The units whose parameters the backward all-gathers."""
    return set().union(*(gathered_units(part, ag, units) for ag in param_gathers(part, "bwd")))
