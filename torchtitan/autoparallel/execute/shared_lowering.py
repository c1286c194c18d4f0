"""Lower a plan once per job, not once per rank: most ranks load graphs another rank made.

Every rank of a data-parallel mesh runs the same local program, and the lowering (tracing
the joint graph over DTensors, partitioning, bucketing) costs each of them the same seconds
of CPU at its first step.  Most of what names a rank is taken out of the graphs: the
collectives name their groups by role (shared_compile.py) and a replicated value's chunk is
picked at run time (local_shards.py).  Not all: an uneven shard has a rank's own shape, and
DTensor fixes a rank's index at trace time in other places (an embedding's masked partial
offsets, gloo's all-to-all done as a gather and a chunk).  Those are found by comparison,
not by a list:

* the *reference* rank (coordinate 0 on every mesh dim the ranks share graphs across) and
  the *witness* (the last coordinate on each of those dims) both lower;
* the reference publishes its graphs in the job's store (graph_bytes.py) once the
  witness's code equals its own, else that each rank lowers for itself;
* every other rank with the same key waits for that verdict and loads the graphs, or
  lowers.  The ranks that load run the reference's code, so compiled ranks also share
  inductor's cache entries.

The comparison finds an index fixed at trace time wherever it differs between the first
and the last coordinate (an offset, a chunk index, a step only the first rank takes, a
process group left named by its ranks that is not every such rank's group: these two
differ on every shared dim, so they hold different groups then too); a
rule that gave those two one graph and a rank between them another would go unseen (none
of DTensor's does on even shards; uneven ones are kept apart by the key, below).

`lowering_key(...)` hashes what the graphs depend on — the traced graph, the plan, the
mesh and the role names of its groups in this process, the local signature, the lowering's
settings — and, for each mesh dim that shards some value unevenly, this rank's coordinate
on it: ranks that hold shards of other shapes never share graphs.  An op that
communicates inside the model (the routed experts' all-to-all) is no exception: it finds
its rank in its group when it runs, and an index it fixed at trace time would show in the
comparison like any other.  Without a store (one process, a fake process group) or with no
mesh dim to share across, every rank lowers for itself.  A rank that fails to lower as
reference or witness publishes the failure, so the waiting ranks stop with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ..errors import PlannerError
from ..graph import graph_bytes
from ..graph import placements as P
from ..graph.job_store import WAIT, job_store
from ..graph.nodes import is_getitem
from ..plan.plan import graph_fingerprint
from .interpret import PlanInterpreter
from .lower import Partition
from .shared_compile import role_names

log = logging.getLogger(__name__)

_PREFIX = "autoparallel/lowered/"
_OWN = b"own"  # the graphs differ between ranks: each rank lowers for itself
_FAILED = b"failed:"


def uneven_mesh_dims(interp: PlanInterpreter) -> set[int]:
    """The mesh dims on which some value of the plan is sharded unevenly (a rank's local
    shape depends on its coordinate there).  A tensor dim sharded on several mesh dims,
    by any of the placements the value takes (its own, each consumer's, its hub's), must
    divide by all their sizes at once: a redistribution between two of those placements
    may pass through a placement that shards it on all of them."""
    mesh_shape = list(interp.mesh.shape)
    placed: dict[fx.Node, list[P.Placements]] = {}

    def add(node: Any, pl: P.Placements | None) -> None:
        if isinstance(node, fx.Node) and pl is not None:
            placed.setdefault(node, []).append(pl)

    tg = interp.tg
    for node in tg.gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node):
            continue
        tensor_args: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), tensor_args.append)
        tensor_args = [a for a in tensor_args if isinstance(a.meta.get("val"), torch.Tensor)]
        for a, pl in zip(tensor_args, interp.ins.get(node.name, [])):
            add(a, pl)
        outs = interp.outs.get(node.name, [])
        if len(outs) == 1:
            add(node, outs[0])
        else:
            for user in node.users:
                if is_getitem(user) and isinstance(user.args[1], int) and user.args[1] < len(outs):
                    add(user, outs[user.args[1]])
    for node, pl in interp.hubs.items():
        add(node, pl)
    for node, pl in zip(tg.inputs, interp.input_pls):
        add(node, pl)
    for node, pl in zip(tg.outputs, interp.output_pls):
        add(node, pl)
    for fqn, pl in interp.grad_pls.items():
        add(tg.grads.get(fqn), pl)

    uneven: set[int] = set()
    for node, pls in placed.items():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for k, size in enumerate(val.shape):
            dims, factor = set(), 1
            for pl in pls:
                for d, p in enumerate(pl):
                    if isinstance(p, Shard) and p.dim == k and mesh_shape[d] > 1:
                        dims.add(d)
                        factor = max(factor, getattr(p, "split_factor", 1))
            if dims and int(size) % (factor * math.prod(mesh_shape[d] for d in dims)):
                uneven |= dims
    return uneven


@dataclasses.dataclass(frozen=True)
class LoweringKey:
    """Where ranks with the same local program meet in the store, and this rank's part."""

    digest: str
    role: str  # REFERENCE, WITNESS or READER
    store: Any  # the job's store (c10d's `Store`)


REFERENCE, WITNESS, READER = "reference", "witness", "reader"


def lowering_key(
    interp: PlanInterpreter,
    keys: Sequence[fx.Node],
    placements: Sequence[P.Placements],
    locals_: Sequence[torch.Tensor],
    settings: dict[str, Any],
) -> LoweringKey | None:
    """The key under which ranks share the lowered graphs of this input signature, or None
    when this rank lowers for itself (see the module docstring)."""
    store = job_store()
    if store is None:
        return None
    tg, mesh = interp.tg, interp.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    uneven = uneven_mesh_dims(interp)
    shared_dims = [d for d, n in enumerate(mesh.shape) if n > 1 and d not in uneven]
    if not shared_dims:
        return None
    plan = dataclasses.replace(interp.plan, timings={})
    blob = {
        "torch": torch.__version__,
        "graph": graph_fingerprint(tg.gm),
        "values": [
            [str(k.meta["val"].dtype), list(k.meta["val"].shape), P.fmt(pl)]
            for k, pl in zip(keys, placements)
        ],
        "locals": [[str(x.dtype), list(x.shape), list(x.stride()), x.device.type] for x in locals_],
        "plan": plan.to_json(),
        "mesh": [list(mesh.shape), list(mesh.mesh_dim_names or [])],
        "roles": role_names(mesh),
        "rank": {d: coordinate[d] for d in sorted(uneven)},
        "reduce_dtype": str(interp.reduce_dtype),
        "settings": settings,
    }
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True, default=repr).encode())
    on_shared = [coordinate[d] for d in shared_dims]
    if all(c == 0 for c in on_shared):
        role = REFERENCE
    elif all(c == mesh.shape[d] - 1 for c, d in zip(on_shared, shared_dims)):
        role = WITNESS
    else:
        role = READER
    return LoweringKey(digest.hexdigest(), role, store)


def lowered_once(
    key: LoweringKey | None, lower: Callable[[], tuple[Partition, dict]]
) -> tuple[Partition, dict]:
    """`lower()`'s partition and statistics: this rank's own, or the reference rank's when
    the witness's graphs showed them to be every rank's (see the module docstring).  The
    statistics say which (`"loaded"`: True when another rank lowered them)."""
    part, stats, loaded = _lowered_once(key, lower)
    return part, {**stats, "loaded": loaded}


def _lowered_once(
    key: LoweringKey | None, lower: Callable[[], tuple[Partition, dict]]
) -> tuple[Partition, dict, bool]:
    if key is None:
        return (*lower(), False)
    store = key.store
    verdict_key = f"{_PREFIX}{key.digest}"
    witness_key = f"{verdict_key}/witness"
    if key.role == READER:
        store.wait([verdict_key], WAIT)
        data = store.get(verdict_key)
        _raise_if_failed(data)
        if data == _OWN:
            return (*lower(), False)
        log.info("lowered graphs: loaded what another rank lowered (%d KiB)", len(data) // 1024)
        return (*_loads(data), True)
    publish = verdict_key if key.role == REFERENCE else witness_key
    try:
        part, stats = lower()
    except BaseException as e:
        store.set(publish, _FAILED + f"{type(e).__name__}: {e}".encode())
        raise
    code = _code(part)
    if key.role == WITNESS:
        store.set(witness_key, code)
        return part, stats, False
    store.wait([witness_key], WAIT)
    theirs = store.get(witness_key)
    if theirs.startswith(_FAILED):
        store.set(verdict_key, theirs)
        _raise_if_failed(theirs)
    if theirs != code:
        store.set(verdict_key, _OWN)
        log.info("lowered graphs: they differ between ranks; each rank lowers its own")
        return part, stats, False
    try:
        data = _dumps(part, stats)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # an op pickle cannot name
        store.set(verdict_key, _OWN)
        log.info("lowered graphs: not shared (%s); each rank lowers its own", e)
        return part, stats, False
    store.set(verdict_key, data)
    log.info("lowered graphs: published for the ranks with this program (%d KiB)", len(data) >> 10)
    return part, stats, False


def _code(part: Partition) -> bytes:
    return (part.fwd.code + "\n# backward\n" + part.bwd.code).encode()


def _raise_if_failed(data: bytes) -> None:
    if data.startswith(_FAILED):
        raise PlannerError(
            f"another rank failed to lower this plan ({data[len(_FAILED) :].decode()}); "
            "its log has the traceback"
        )


def _dumps(part: Partition, stats: dict) -> bytes:
    rest = {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}
    graphs = [graph_bytes.dumps(rest.pop("fwd")), graph_bytes.dumps(rest.pop("bwd"))]
    return pickle.dumps((graphs, rest, stats))


def _loads(data: bytes) -> tuple[Partition, dict]:
    graphs, rest, stats = pickle.loads(data)
    fwd, bwd = (graph_bytes.loads(g)[0] for g in graphs)
    return Partition(fwd=fwd, bwd=bwd, **rest), stats
