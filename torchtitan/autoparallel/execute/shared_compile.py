"""Compile a graph once per machine, not once per rank: graphs that name no rank.

Inductor caches a compiled graph under a key made of its code (and the example inputs'
metadata, inductor's config, torch's version).  The lowered graphs of the ranks of a plan
are usually the same program — every rank of a data-parallel mesh runs the same shard
shapes — yet their code differs in one thing: the collectives name their process group
(`'3'` on one rank, `'4'` on another, c10d's names), so each rank compiles its own.

`name_groups_by_role` renames the groups of the mesh in a graph to names that say the
group's role instead (`rank-free:tp/2#0`: the first tensor-parallel group of 2 this process
named), the same string on every rank, each registered in this process for its own group.
`one_compile_at_a_time` then lets the first rank compile a graph while the ranks with the
same graph wait, and find it in the cache.  (The other thing that named a rank, the chunk a
rank keeps when a replicated value is sharded, is picked at run time: local_shards.py.)  A
graph that still differs between ranks (uneven shards) keeps its own key and is compiled by
its rank; equal code means the same program on every rank, so a rank may run another rank's
compiled graph whatever process group each name resolves to.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from torchtitan.torch_private import FileLock, register_process_group, resolve_process_group

_PREFIX = "rank-free:"
_ALIASES: dict[tuple[str, str], str] = {}  # (c10d's name of a group, role) -> role name


def _role_name(group: Any, role: str) -> str:
    """The role name of `group` in this process (`<role>#<n>`, n counting the groups given
    that role before it), registered with c10d so collectives can resolve it."""
    name = _ALIASES.get((group.group_name, role))
    if name is None:
        n = sum(given == role for _, given in _ALIASES)
        name = _ALIASES[group.group_name, role] = f"{_PREFIX}{role}#{n}"
    try:
        registered = resolve_process_group(name).group_name == group.group_name
    except (RuntimeError, ValueError):  # not registered (yet, or no longer: a new world)
        registered = False
    if not registered:
        register_process_group(name, group)
    return name


def name_groups_by_role(gm: fx.GraphModule, mesh: Any) -> int:
    """Rename, in `gm`, every `group_name` argument naming a group of `mesh` — or another
    group over the same ranks (DTensor may hand out an equal mesh made earlier, whose groups
    are other objects over the same ranks) — to that group's role name (mesh dim name and
    size); returns the number of arguments renamed."""
    role_of_ranks = {_ranks(mesh.get_group(d)): name for d, name in enumerate(role_names(mesh))}
    role_of: dict[str, str | None] = {}

    def role(name: Any) -> str | None:
        if not isinstance(name, str) or name.startswith(_PREFIX):
            return None
        if name not in role_of:
            try:
                role_of[name] = role_of_ranks.get(_ranks(resolve_process_group(name)))
            except (RuntimeError, ValueError):  # not a registered group
                role_of[name] = None
        return role_of[name]

    renamed = 0
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name != "group_name":
                continue
            if i < len(node.args) and (new := role(node.args[i])) is not None:
                node.update_arg(i, new)
                renamed += 1
            elif (new := role(node.kwargs.get("group_name"))) is not None:
                node.update_kwarg("group_name", new)
                renamed += 1
    if renamed:
        gm.recompile()
    return renamed


def role_names(mesh: Any) -> list[str]:
    """The role name of each mesh dim's group in this process (registered with c10d)."""
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    return [
        _role_name(mesh.get_group(d), f"{dim}/{mesh.get_group(d).size()}")
        for d, dim in enumerate(names)
    ]


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


@contextlib.contextmanager
def one_compile_at_a_time(
    gm: fx.GraphModule, examples: Sequence[Any], options: dict | None
) -> Iterator[bool]:
    """Hold a lock, shared by this machine's processes, on compiling `gm`'s code for these
    inputs: the first process compiles it into inductor's cache and the others, waiting,
    read it from there.  Yields whether the graph is still to be compiled into the cache
    (no process has done so: no mark beside the lock; the mark is made when the block ends
    without an error).  No lock when inductor's FX graph cache is off: each process
    compiles, and False is yielded (there is no cache to fill)."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if not (options or {}).get("fx_graph_cache", config.fx_graph_cache) or (
        config.force_disable_caches
    ):
        yield False
        return
    key = hashlib.sha256(gm.code.encode())
    for x in examples:
        meta = (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x
        key.update(repr(meta).encode())
    key.update(repr(sorted((options or {}).items())).encode())
    key.update(repr(torch.compiler.config.cache_key_tag).encode())
    locks = os.path.join(cache_dir(), "locks")
    os.makedirs(locks, exist_ok=True)
    name = os.path.join(locks, f"graph-{key.hexdigest()[:32]}")
    with FileLock(f"{name}.lock"):
        first = not os.path.exists(f"{name}.compiled")
        yield first
        if first:
            open(f"{name}.compiled", "w").close()
