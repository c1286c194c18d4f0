"""Replicate -> Shard in lowered graphs (execute/local_shards.py): the chunk a rank keeps is
picked at run time, so every rank traces the same graph and each still keeps its own chunk."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.autoparallel.execute.local_shards import copy_order, rank_free_shards

FULL = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)


@contextlib.contextmanager
def _rank_of_four(rank: int):
    """A fake world of 4 in which this process is `rank`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _to(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    replicated = DTensor.from_local(full, mesh, (Replicate(), Replicate()), run_check=False)
    return replicated.redistribute(mesh, placements).to_local()


def _groups_by_dim(code: str, mesh) -> str:
    """`code` with each group's name replaced by its mesh dim's (as name_groups_by_role
    does, without registering names in a world that is about to end)."""
    for dim in ("dp", "tp"):
        code = code.replace(repr(mesh.get_group(dim).group_name), repr(dim))
    return code


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Shard(0), Shard(0))])
def test_every_rank_traces_one_graph_and_keeps_its_own_chunk(placements):
    codes = []
    for rank in range(4):
        with _rank_of_four(rank) as mesh, rank_free_shards():
            graph = make_fx(lambda x: _to(x, mesh, placements), tracing_mode="fake")(FULL)
            codes.append(_groups_by_dim(graph.code, mesh))
            kept = _to(FULL, mesh, placements)
        with _rank_of_four(rank) as mesh:  # DTensor's own step: the chunk at the coordinate
            assert torch.equal(kept, _to(FULL, mesh, placements)), rank
            assert torch.equal(kept, graph(FULL)), rank
    assert "group_rank.default('dp'" in codes[0] and "group_rank.default('tp'" in codes[0]
    assert "split" not in codes[0]
    assert codes[1:] == codes[:-1]  # one graph for the 4 ranks


def test_a_chunk_is_laid_out_as_dtensors_clone_of_it():
    """A transposed value (heads before sequence in memory, as attention's are) keeps its
    layout in the chunk, a broadcast one (stride 0) is laid out as torch copies it: a later
    view that merges dims relies on it."""
    transposed = torch.arange(4 * 8 * 6 * 2, dtype=torch.float32).view(4, 6, 8, 2).transpose(1, 2)
    broadcast = torch.arange(4 * 8, dtype=torch.float32).view(4, 8, 1, 1).expand(4, 8, 6, 2)
    cases = [(transposed, (Shard(0), Shard(1))), (transposed, (Shard(1), Shard(2)))]
    cases += [(broadcast, (Shard(0), Shard(2))), (broadcast.transpose(0, 2), (Shard(1), Shard(0)))]
    for full, placements in cases:
        with _rank_of_four(3) as mesh, rank_free_shards():
            kept = _to(full, mesh, placements)
            to_placements = functools.partial(_to, mesh=mesh, placements=placements)
            graph = make_fx(to_placements, tracing_mode="fake")(full)
        with _rank_of_four(3) as mesh:
            expected = _to(full, mesh, placements)
        assert torch.equal(kept, expected) and kept.stride() == expected.stride(), placements
        assert "group_rank" in graph.code and "split" not in graph.code, placements


def _dense_strides(sizes: list[int], order: list[int]) -> list[int]:
    strides, step = [0] * len(sizes), 1
    for d in reversed(order):
        strides[d], step = step, step * sizes[d]
    return strides


def test_copy_order_is_the_layout_torch_gives_a_copy():
    """Against `clone` itself, over permuted, sliced, broadcast and size-1 layouts."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        sizes = torch.randint(1, 4, (4,), generator=g).tolist()
        x = torch.empty(sizes).permute(torch.randperm(4, generator=g).tolist())
        if torch.rand(1, generator=g) < 0.5:  # broadcast one dim
            d = int(torch.randint(0, 4, (1,), generator=g))
            x = x.narrow(d, 0, 1).expand(*[n if i != d else 3 for i, n in enumerate(x.shape)])
        if torch.rand(1, generator=g) < 0.5:  # a chunk of another dim
            d = int(torch.randint(0, 4, (1,), generator=g))
            x = x.narrow(d, 0, max(1, x.size(d) // 2))
        order = copy_order(list(x.shape), x.stride())
        copied = x.clone()
        got = _dense_strides(list(x.shape), order)
        # a size-1 dim's stride is free (no index moves along it)
        assert all(n == 1 or a == b for n, a, b in zip(x.shape, got, copied.stride())), (
            tuple(x.shape),
            x.stride(),
            copied.stride(),
            got,
        )


def test_an_uneven_split_stays_dtensors_and_names_the_rank():
    full = FULL[:5]  # 5 rows over 2 ranks: 3 and 2
    codes, placements = [], (Shard(0), Replicate())
    for rank in (0, 2):  # dp coordinate 0 and 1
        with _rank_of_four(rank) as mesh, rank_free_shards():
            graph = make_fx(lambda x: _to(x, mesh, placements), tracing_mode="fake")(full)
            codes.append(graph.code)
            assert torch.equal(graph(full), full[:3] if rank == 0 else full[3:])
    assert "group_rank" not in codes[0] and codes[0] != codes[1]
