"""`compile_per_rank` (torchtitan/distributed/utils.py): a function compiled under this
rank's cache tag, so graphs that name this rank's process groups are not shared with the
other ranks through the compile caches; the process's own tag is left as it was."""

from __future__ import annotations

import functools

import torch
import torch.compiler.config as compiler_config
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed.utils import compile_per_rank


def _compiled_with_recorded_tags(monkeypatch, fn):
    """`compile_per_rank(fn)` compiled by a backend that records the cache tag it saw."""
    seen: list[str] = []

    def backend(gm, _examples):
        seen.append(compiler_config.cache_key_tag)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    return compile_per_rank(fn), seen


def test_each_compile_and_recompile_sees_this_ranks_tag_and_the_process_tag_stays(
    monkeypatch,
):
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        with compiler_config.patch(cache_key_tag="job"):
            loss, seen = _compiled_with_recorded_tags(monkeypatch, lambda x: (x * 2).sum())
            assert loss(torch.ones(3)).item() == 6.0
            assert loss(torch.ones(2, 5)).item() == 20.0  # another input rank: a recompile
            assert compiler_config.cache_key_tag == "job"
    finally:
        dist.destroy_process_group()
    assert seen == ["job-rank3", "job-rank3"]


def test_one_process_without_a_process_group_is_rank_0(monkeypatch):
    torch._dynamo.reset()
    with compiler_config.patch(cache_key_tag=""):
        loss, seen = _compiled_with_recorded_tags(monkeypatch, lambda x: x.sum())
        assert loss(torch.ones(4)).item() == 4.0
        assert compiler_config.cache_key_tag == ""
    assert seen == ["rank0"]
