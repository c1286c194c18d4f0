"""Replicate → Shard in a graph that names no rank.

A replicated value becomes sharded without communication: each rank keeps its own chunk.
DTensor does that by splitting the local tensor and taking chunk `k`, this rank's coordinate
on the mesh dim — a constant in the traced graph, so the lowered graphs of two ranks would
differ in a slice offset and each rank would compile its own (shared_compile.py).

Inside `rank_free_shards()` (the lowering's trace) that step picks the chunk at run time
instead: `group_rank`, an op returning this process's rank in a named group as a one-element
tensor, indexes the chunk dim of the value viewed as (chunks, chunk size).  The group name is
the one `name_groups_by_role` renames, so the graph is the same on every rank.  The chunk is
laid out as DTensor's clone of it is (`copy_order`).  Only even splits are taken this way;
an uneven one has a rank-dependent shape anyway and stays DTensor's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchtitan.torch_private import DTensorShard, resolve_process_group


@torch.library.custom_op("autoparallel::group_rank", mutates_args=())
def group_rank(group_name: str, device: torch.device) -> torch.Tensor:
    """This process's rank in the process group `group_name`, as a 1-element int64 tensor."""
    rank = resolve_process_group(group_name).rank()
    return torch.full((1,), rank, dtype=torch.int64, device=device)


@group_rank.register_fake
def _(group_name: str, device: torch.device) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64, device=device)


def copy_order(sizes: list[int], strides: tuple[int, ...]) -> list[int]:
    """The dims of a tensor of these sizes and strides from outermost to innermost, as torch
    lays out a copy of it that preserves its layout (`clone`, `empty_like`): by stride, the
    larger outer; of equal strides the larger size outer; a dim of stride 0 (broadcast) is
    ordered against none and keeps its place."""

    def outer(a: int, b: int) -> bool | None:  # is dim a outside dim b? None: no order
        if strides[a] == 0 or strides[b] == 0:
            return None
        if strides[a] != strides[b]:
            return strides[a] > strides[b]
        return True if sizes[a] > sizes[b] else None

    inner_first = list(range(len(sizes)))[::-1]
    for i in range(1, len(inner_first)):  # a stable insertion sort, innermost first
        j = i
        for k in range(i - 1, -1, -1):
            order = outer(inner_first[k], inner_first[j])
            if order is None:
                continue
            if not order:
                break
            inner_first[k], inner_first[j] = inner_first[j], inner_first[k]
            j = k
    return inner_first[::-1]


def this_chunk(x: torch.Tensor, dim: int, chunks: int, group_name: str) -> torch.Tensor:
    """Chunk `rank in group` of `x` split evenly into `chunks` along `dim`: a new tensor laid
    out as DTensor's clone of the chunk is (later views rely on it)."""
    size = x.size(dim)
    if size % chunks:
        raise ValueError(f"dim {dim} of size {size} does not split evenly into {chunks}")
    sizes = list(x.shape)
    sizes[dim] = size // chunks
    order = copy_order(sizes, x.stride())
    at = order.index(dim)  # the split dim among the dims, outermost first
    laid_out = x.permute(order).unflatten(at, (chunks, size // chunks))
    picked = laid_out.index_select(at, group_rank(group_name, x.device)).squeeze(at)
    return picked.permute([order.index(d) for d in range(x.dim())])


@contextlib.contextmanager
def rank_free_shards() -> Iterator[None]:
    """While active, DTensor's Replicate → Shard steps on even splits pick this rank's chunk
    at run time (`this_chunk`) rather than at trace time."""
    original = DTensorShard._replicate_to_shard

    def replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        chunks = mesh.size(mesh_dim)
        if (
            type(self) is not DTensorShard
            or local_tensor.size(self.dim) % chunks
            or shard_index != mesh.get_local_rank(mesh_dim)
        ):
            return original(self, local_tensor, mesh, mesh_dim, shard_index)
        return this_chunk(local_tensor, self.dim, chunks, mesh.get_group(mesh_dim).group_name)

    DTensorShard._replicate_to_shard = replicate_to_shard
    try:
        yield
    finally:
        DTensorShard._replicate_to_shard = original
