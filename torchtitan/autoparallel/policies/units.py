"""FSDP units: the wrapping torchtitan applies by hand, found from the module structure.

Every child of the outermost module containers (`ModuleList`, `ModuleDict`, `Sequential` — a
transformer's blocks) is a unit; everything else belongs to the root unit (`""`).  The units
are where parameters are gathered and gradients reduced together (execute/buckets.py), and
what the reshard-after-forward setting decides for (regather.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn


def fsdp_units(model: nn.Module) -> list[str]:
    """FQN prefixes of the units: every child of the outermost module containers."""
    units: list[str] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            units.extend(prefix + name for name, _c in mod.named_children())
            return
        for name, child in mod.named_children():
            visit(child, prefix + name + ".")

    visit(model, "")
    return units


def unit_of(fqn: str | None, units: list[str]) -> str:
    best = ""
    for u in units:
        if fqn is not None and fqn.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


def regathered_params(fqns: Iterable[str], policy: bool | str, units: list[str]) -> frozenset[str]:
    """Parameters gathered again in the backward under a reshard-after-forward policy (True /
    "always": all; False / "never": none; "default", torchtitan's: all but the root's and the
    last unit's, which the backward needs first)."""
    policy = policy if isinstance(policy, str) else {True: "always", False: "never"}[policy]
    if policy == "never":
        return frozenset()
    if policy == "always":
        return frozenset(fqns)
    last = units[-1] if units else ""
    return frozenset(f for f in fqns if unit_of(f, units) not in ("", last))
