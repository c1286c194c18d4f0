"""Keep or gather again: what the backward does with the parameters the forward gathered.

Before the forward uses a parameter it makes the parameter's *chain*: its cast, transpose
and the all-gathers the plan puts on them.  The backward needs some of those values again
(a linear layer's input gradient reads its weight).  For every FSDP unit
(`units.fsdp_units`: each block of a stack, and the root with the rest) the plan either

* **keeps** them: the forward's values stay alive until the unit's backward has used them
  (memory), or
* **gathers them again**: the backward makes the chain again from the sharded parameters,
  collectives included (communication, overlappable like the forward's), and frees it
  after use.

This is FSDP2's reshard after forward, decided per unit.  `reshard_after_forward` pins it
(True / "always": every unit gathers again; False / "never": every unit keeps; torchtitan's
"default": all but the root and the last unit, whose backward comes first) or, with "auto",
leaves it to the solver (regather_program.py prices both sides; memory.py's rows carry the
bytes each side holds).  Activation recompute policies (recompute.py) never recompute a
value computed from parameters alone: in a recomputing block those are kept or gathered again
by this decision only.

A shallow trace (repeat.py) has one unit per traced block; the traced interior block's unit
decides for every interior block it stands for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import PlannerError
from .units import regathered_params, unit_of

POLICIES = ("always", "never", "default", "auto")


def check_reshard_policy(policy: bool | str) -> str:
    """The policy name of a `reshard_after_forward` setting (True/False as always/never)."""
    name = policy if isinstance(policy, str) else {True: "always", False: "never"}[policy]
    if name not in POLICIES:
        raise PlannerError(
            "reshard_after_forward must be True, False, 'always', 'never', 'default' or "
            f"'auto', got {policy!r}"
        )
    return name


@dataclass(frozen=True)
class Regather:
    """The re-gather setting of one traced graph, in the trace's parameter names.

    `unit`: traced parameter -> the unit deciding for it, named after the first unit of the
    whole model it stands for; `fixed`: parameters gathered again whatever the plan;
    `free`: parameters whose unit the solver decides; `members`: each unit -> the units of
    the whole model it stands for."""

    unit: dict[str, str] = field(default_factory=dict)
    fixed: frozenset[str] = frozenset()
    free: frozenset[str] = frozenset()
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def free_units(self) -> list[str]:
        return sorted({self.unit[f] for f in self.free})

    def regathered(self, units: Iterable[str]) -> frozenset[str]:
        """Traced parameters gathered again when the solver picks `units` of `free_units`."""
        chosen = set(units)
        return self.fixed | {f for f in self.free if self.unit[f] in chosen}

    def model_units(self, regathered: Iterable[str]) -> dict[str, bool]:
        """Every unit of the whole model (with parameters) -> whether it gathers again, for
        the traced parameters `regathered`."""
        traced = {self.unit[f] for f in regathered}
        every = sorted({m for ms in self.members.values() for m in ms}, key=_unit_order)
        again = {m for u in traced for m in self.members[u]}
        return {m: m in again for m in every}


# every parameter kept, nothing decided by the solver
NO_REGATHER = Regather()


def regather_setting(
    policy: bool | str,
    model_params: list[str],
    units: list[str],
    traced: Callable[[str], str] = lambda f: f,
) -> Regather:
    """The setting for a reshard-after-forward `policy`, from the whole model's parameter
    FQNs (in order), its units, and `traced` (whole-model FQN -> traced FQN)."""
    policy = check_reshard_policy(policy)
    unit: dict[str, str] = {}
    members: dict[str, dict[str, None]] = defaultdict(dict)
    for f in model_params:
        t = traced(f)
        unit.setdefault(t, unit_of(f, units))
        members[unit[t]][unit_of(f, units)] = None
    fixed: frozenset[str]
    if policy == "auto":
        fixed, free = frozenset(), frozenset(unit)
    else:
        fixed = frozenset(traced(f) for f in regathered_params(model_params, policy, units))
        free = frozenset()
    return Regather(unit, fixed, free, {u: tuple(m) for u, m in members.items()})


def _unit_order(unit: str) -> tuple:
    """Units in model order: the root first, then by container and position."""
    head, _, tail = unit.rpartition(".")
    return (unit != "", head, int(tail) if tail.isdigit() else -1, tail)


def describe_units(decisions: dict[str, bool]) -> str:
    """`layers.0-6 gather again; root, layers.7 keep` (unit -> gathers again?): runs of
    consecutive units."""
    runs: list[list] = []  # [container, first, last, gather again?]
    for u in sorted(decisions, key=_unit_order):
        head, _, tail = u.rpartition(".")
        i = int(tail) if tail.isdigit() else None
        again = decisions[u]
        last = runs[-1] if runs else None
        if last and i is not None and last[0] == head and last[2] == i - 1 and last[3] == again:
            last[2] = i
        else:
            runs.append([head if i is not None else u, i, i, again])

    def name(run: list) -> str:
        head, a, b, _again = run
        if a is None:
            return head or "root"
        return f"{head}.{a}" + ("" if a == b else f"-{b}")

    parts = []
    for again in (True, False):
        names = [name(r) for r in runs if r[3] == again]
        if names:
            parts.append(f"{', '.join(names)} {'gather again' if again else 'keep'}")
    return "; ".join(parts)
