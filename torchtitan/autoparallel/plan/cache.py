"""Plans cached as JSON files, keyed by everything the solver's answer depends on.

`cached_or_solved(autop, folder, solve)` returns the text of `folder/<key>.json` when that
file holds a plan this model and mesh can run (`Plan.check_applicable`), else solves,
writes the file atomically (temporary name, rename) and returns the new plan.  A file that
is truncated, edited or impossible is named in a warning and replaced, never applied.  The
key hashes the traced graph, the mesh, every constraint (pins, budgets), the precision,
the cost model and the torch version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import PlannerError
from ..graph import placements as P
from .plan import Plan, graph_fingerprint

log = logging.getLogger(__name__)


def plan_key(autop: Any) -> str:
    constraints = [
        {
            "type": type(c).__name__,
            **{
                f.name: (
                    getattr(c, f.name).name
                    if f.name == "node"
                    else P.fmt(getattr(c, f.name))
                    if f.name == "placement"
                    else getattr(c, f.name)
                )
                for f in dataclasses.fields(c)
            },
        }
        for c in autop._constraints
    ]
    blob = json.dumps(
        {
            "graph": graph_fingerprint(autop.tg.gm),
            "mesh": [list(autop.mesh.shape), list(autop.mesh.mesh_dim_names or ())],
            "constraints": constraints,
            "precision": [str(autop.param_dtype), str(autop.reduce_dtype)],
            "cost_model": repr(autop.cost_model),
            "recompute": autop.recompute,
            "reshard_after_forward": str(autop.reshard_after_forward),
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _usable(autop: Any, path: Path) -> str | None:
    """The cached plan's text, or None (with a warning naming the file) when there is none
    or it cannot be applied to this model and mesh."""
    if not path.exists():
        return None
    try:
        text = path.read_text()
        shapes = {fqn: tuple(p.shape) for fqn, p in autop.model.named_parameters()}
        Plan.from_json(text).check_applicable(
            shapes, list(autop.mesh.shape), list(autop.mesh.mesh_dim_names or ())
        )
    except (OSError, UnicodeDecodeError, PlannerError) as e:
        log.warning("cached plan %s is unusable (%s); planning again and replacing it", path, e)
        return None
    log.info("reusing cached plan %s", path)
    return text


def cached_or_solved(autop: Any, folder: Path, solve: Callable[[], Plan]) -> str:
    path = folder / f"{plan_key(autop)}.json"
    if (text := _usable(autop, path)) is not None:
        return text
    text = solve().to_json()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # never leave a half-written plan behind
    return text
