"""Parameter placements pinned from the config: `--autoparallel.pin 'PATTERN=PLACEMENTS;...'`.

Each entry names parameters by a glob over their names (`layers.*.feed_forward.w1.weight`)
and gives one placement per mesh dim in the plan's text form (`S(0),R`: split dim 0 over
the first mesh dim, replicated over the second; mesh dims outermost first, as the plan
summary lists them).  The solver then chooses everything else around the pins; pins that
cannot all hold together (with each other, the parameter budget or the memory budget) are
reported by the solver naming a smallest clashing set.

Pins are checked before any rank starts (the spec's `check_parallelism_fn`): a malformed
entry, a pattern no parameter matches, the wrong number of placements for the mesh, a
split the parameter's shape cannot take, or two patterns that pin one parameter two ways
are each one error line.  Identical repeated blocks share one placement in the planner, so
pinning one block's parameter pins that parameter in every block like it.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Placement, Shard

from torchtitan.autoparallel.errors import ConstraintError
from torchtitan.autoparallel.graph import placements as P
from torchtitan.errors import UserInputError

OPTION = "--autoparallel.pin"


@dataclass(frozen=True)
class PinRequest:
    """One `PATTERN=PLACEMENTS` entry of the option."""

    pattern: str
    placements: tuple[Placement, ...]

    def __str__(self) -> str:
        return f"{self.pattern}={P.fmt(self.placements)}"


def parse_pins(setting: str) -> list[PinRequest]:
    """The entries of `setting` (separated by ';'; empty entries ignored)."""
    requests = []
    for entry in (e.strip() for e in setting.split(";")):
        if not entry:
            continue
        pattern, sep, text = (part.strip() for part in entry.partition("="))
        if not sep or not pattern or not text:
            raise UserInputError(
                f"{OPTION} {entry!r}: expected PATTERN=PLACEMENTS, e.g. "
                "'layers.*.attention.wo.weight=S(0),S(1)'"
            )
        try:
            placements = P.parse(text)
        except ConstraintError as e:
            raise UserInputError(
                f"{OPTION} {entry!r}: {e}; write one of R, S(dim) per mesh dim, comma-separated"
            ) from None
        if any(p.is_partial() for p in placements):
            raise UserInputError(
                f"{OPTION} {entry!r}: a parameter cannot be pinned to a partial sum; "
                "use R or S(dim)"
            )
        requests.append(PinRequest(pattern, placements))
    return requests


def match_pins(
    requests: Sequence[PinRequest],
    param_shapes: Mapping[str, Sequence[int]],
    mesh: Sequence[tuple[str, int]],
) -> dict[str, tuple[Placement, ...]]:
    """{parameter name: placements} for `requests` on a mesh of (name, size) dims, outermost
    first; a `UserInputError` for the first request that cannot apply."""
    names = ", ".join(f"{n} {s}" for n, s in mesh)
    sizes = [s for _, s in mesh]
    pinned: dict[str, tuple[Placement, ...]] = {}
    by: dict[str, PinRequest] = {}
    for req in requests:
        if len(req.placements) != len(mesh):
            raise UserInputError(
                f"{OPTION} '{req}': {len(req.placements)} placement(s) for a "
                f"{len(mesh)}-D mesh ({names}); give one per mesh dim"
            )
        matched = [n for n in param_shapes if fnmatch.fnmatchcase(n, req.pattern)]
        if not matched:
            raise UserInputError(
                f"{OPTION} '{req}': no parameter matches {req.pattern!r}"
                f"{_closest(req.pattern, param_shapes)}"
            )
        for name in matched:
            shape = list(param_shapes[name])
            _check_split(req, name, shape, sizes)
            if name in pinned and pinned[name] != req.placements:
                raise UserInputError(
                    f"{OPTION}: '{by[name]}' and '{req}' pin {name} two ways; make the "
                    "patterns disjoint"
                )
            pinned[name], by[name] = req.placements, req
    return pinned


def _check_split(req: PinRequest, name: str, shape: list[int], sizes: list[int]) -> None:
    for p in req.placements:
        if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):
            raise UserInputError(
                f"{OPTION} '{req}': {name} has {len(shape)} dim(s) {tuple(shape)}, no dim {p.dim}"
            )
    if not P.is_valid(shape, req.placements, sizes):
        raise UserInputError(
            f"{OPTION} '{req}': {name} {tuple(shape)} cannot be split that way over a mesh "
            f"of {tuple(sizes)} (some ranks would hold nothing)"
        )


def _closest(pattern: str, names: Mapping[str, Any]) -> str:
    """A parameter name like `pattern`: among those ending as it does ("w1.weight"), if any,
    else among all."""
    tail = pattern.split(".")[-2:]
    same_tail = [n for n in names if n.split(".")[-len(tail) :] == tail]
    pool, cutoff = (same_tail, 0.0) if same_tail else (list(names), 0.6)
    near = difflib.get_close_matches(pattern.replace("*", "0"), pool, n=1, cutoff=cutoff)
    return f" (did you mean {near[0]!r}?)" if near else " (the plan summary lists the names)"


def job_pins(job_config: Any) -> list[PinRequest]:
    """The pins of the job's `[autoparallel]` section (none without the section)."""
    section = getattr(job_config, "autoparallel", None)
    return parse_pins(getattr(section, "pin", "") or "")
