"""Replicate → Shard in a graph that names no rank.

A replicated value becomes sharded without communication: each rank keeps its own chunk.
DTensor does that by splitting the local tensor and taking chunk `k`, this rank's coordinate
on the mesh dim — a constant in the traced graph, so the lowered graphs of two ranks would
differ in a slice offset and each rank would compile its own (shared_compile.py).

Inside `rank_free_shards()` (the lowering's trace) that step picks the chunk at run time
instead: `group_rank`, an op returning this process's rank in a named group as a one-element
tensor, indexes the chunk dim of the value viewed as (chunks, chunk size).  The group name is
the one `name_groups_by_role` renames, so the graph is the same on every rank.  The chunk is
laid out in the value's memory order, as DTensor's clone of it is.  Only even splits of
values dense in some order are taken this way; an uneven split has a rank-dependent shape
anyway and stays DTensor's.
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


def memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of `x` from the largest stride to the smallest, when `x` is dense in that
    order (permuted by it, contiguous); None otherwise."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return order if x.permute(order).is_contiguous() else None


def this_chunk(x: torch.Tensor, dim: int, chunks: int, group_name: str) -> torch.Tensor:
    """Chunk `rank in group` of `x` split evenly into `chunks` along `dim`: a new tensor laid
    out as `x` is (the layout DTensor's clone of the chunk has; later views rely on it)."""
    size, order = x.size(dim), memory_order(x)
    if size % chunks or order is None:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} and strides {x.stride()} does not split "
            f"evenly and densely into {chunks} along dim {dim}"
        )
    at = order.index(dim)  # the split dim among the dims in memory order
    dense = x.permute(order).unflatten(at, (chunks, size // chunks))
    picked = dense.index_select(at, group_rank(group_name, x.device)).squeeze(at)
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
            or memory_order(local_tensor) is None
            or shard_index != mesh.get_local_rank(mesh_dim)
        ):
            return original(self, local_tensor, mesh, mesh_dim, shard_index)
        return this_chunk(local_tensor, self.dim, chunks, mesh.get_group(mesh_dim).group_name)

    DTensorShard._replicate_to_shard = replicate_to_shard
    try:
        yield
    finally:
        DTensorShard._replicate_to_shard = original
