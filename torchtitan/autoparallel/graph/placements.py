"""Small helpers on placement tuples: text form, validity, local shapes.

A placement tuple has one entry per mesh dimension: `Shard(d)`, `Replicate()` or `Partial()`.
Text form (used in plans and tables): `S(0)`, `R`, `P(sum)`, joined by commas: `S(0),R`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..errors import ConstraintError

Placements = tuple[Placement, ...]


def fmt(pl: Sequence[Placement] | None) -> str:
    if pl is None:
        return "-"
    out = []
    for p in pl:
        if isinstance(p, Shard):
            out.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            out.append("R")
        elif isinstance(p, Partial):
            out.append(f"P({p.reduce_op})")
        else:
            out.append(repr(p))
    return ",".join(out)


_ITEM = re.compile(r"^(R|S\((-?\d+)\)|P\((\w+)\))$")


def parse(text: str) -> Placements:
    """Inverse of `fmt`."""
    out: list[Placement] = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise ConstraintError(f"cannot parse placement '{item}' in '{text}'")
        if m.group(1) == "R":
            out.append(Replicate())
        elif m.group(2) is not None:
            out.append(Shard(int(m.group(2))))
        else:
            out.append(Partial(m.group(3)))
    return tuple(out)


def is_valid(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True if every shard is non-empty (uneven shards are allowed, empty ones are not)."""
    remaining = list(shape)
    for p, n in zip(pl, mesh_shape):
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            if d < 0 or d >= len(shape) or remaining[d] < n:
                return False
            remaining[d] = -(-remaining[d] // n)
    return True


def local_shape(
    shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Largest local shard shape (ceil division per sharded mesh dim)."""
    out = list(shape)
    for p, n in zip(pl, mesh_shape):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // n)
    return tuple(out)


def shard_fraction(
    shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]
) -> float:
    """Local numel / global numel for the largest shard."""
    g = 1
    for s in shape:
        g *= s
    if g == 0:
        return 1.0
    loc = 1
    for s in local_shape(shape, pl, mesh_shape):
        loc *= s
    return loc / g


def all_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every valid {Replicate, Shard(d)} tuple for a tensor of `shape` (no Partial)."""
    opts: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return [
        tuple(c)
        for c in itertools.product(opts, repeat=len(mesh_shape))
        if is_valid(shape, c, mesh_shape)
    ]


def normalize(pl: Sequence[Placement], ndim: int) -> Placements:
    """Make Shard dims non-negative."""
    return tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in pl)
