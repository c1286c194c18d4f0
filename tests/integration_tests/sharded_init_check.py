"""Multi-rank check of `exact_sharded_init`: run with

    torchrun --standalone --nproc_per_node=4 tests/integration_tests/sharded_init_check.py

Each case is an init function of the kinds real `init_weights` / `_init_weights` /
`reset_parameters` use (random fills, writes through views, indexed writes, copies of plain
tensors into sharded buffers); it runs once on plain tensors (one process) and once on
DTensors under every placement of a 1-D (4) and a 2-D (2, 2) mesh, and the full tensors must
be equal bitwise.  A write that cannot be done must raise naming the parameter.
Prints one line per case and `ALL OK`; exits non-zero on the first failure.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
from rank_checks import check, run_checks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan.exact_init import exact_sharded_init


class Holder(nn.Module):
    """An embedding-shaped weight and a 1-D buffer, like a padded embedding with a rotary table."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 12))
        self.register_buffer("inv_freq", torch.zeros(8))


def embedding_reset(m):  # nn.Embedding.reset_parameters with padding_idx=3
    nn.init.normal_(m.weight)
    with torch.no_grad():
        m.weight[3].fill_(0)


def hf_style(
    m,
):  # transformers' _init_weights: normal, then zeros_ on the padding row; a copied buffer
    m.weight.data.normal_(mean=0.0, std=0.02)
    nn.init.zeros_(m.weight[5])
    m.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)))


def slice_writes(m):  # a column and a block written through views, a view of a view
    nn.init.uniform_(m.weight, -1, 1)
    with torch.no_grad():
        m.weight[:, 0] = 1.0
        m.weight[2:6][1].mul_(3)
        m.weight.t()[4].zero_()
    m.inv_freq.fill_(torch.tensor(2.5))


def indexed_writes(m):  # index_put_ with tensor indices, masked_fill_
    nn.init.normal_(m.weight)
    with torch.no_grad():
        m.weight[torch.tensor([0, 7])] = 0.5
        m.weight.masked_fill_(m.weight > 1.5, 1.5)
    m.inv_freq.copy_(torch.linspace(0, 1, 8))


CASES = {
    "embedding_reset": embedding_reset,
    "hf_style": hf_style,
    "slice_writes": slice_writes,
    "indexed_writes": indexed_writes,
}


def placements(ndim: int):
    options = [Replicate(), Shard(0), Shard(1)]
    return list(itertools.product(options, repeat=ndim))


def sharded_holder(mesh, pl) -> Holder:
    m = Holder()
    buf_pl = tuple(Shard(0) if isinstance(p, Shard) else p for p in pl)
    m.weight = nn.Parameter(distribute_tensor(torch.zeros(8, 12), mesh, pl))
    m.inv_freq = distribute_tensor(torch.zeros(8), mesh, buf_pl)
    return m


def run_cases() -> None:
    for mesh_shape in ((4,), (2, 2)):
        mesh = init_device_mesh("cpu", mesh_shape)
        for case, fn in CASES.items():
            bad = []
            for pl in placements(len(mesh_shape)):
                ref = Holder()
                torch.manual_seed(0)
                with torch.no_grad():
                    fn(ref)
                m = sharded_holder(mesh, pl)
                torch.manual_seed(0)
                with torch.no_grad(), exact_sharded_init(m):
                    fn(m)
                for name in ("weight", "inv_freq"):
                    got = getattr(m, name).full_tensor()
                    if not torch.equal(got, getattr(ref, name)):
                        bad.append(f"{name} on {pl}")
            check(f"init/{'x'.join(map(str, mesh_shape))} {case} bitwise", not bad, str(bad[:3]))


def run_refusal() -> None:
    """An op DTensor cannot do with a plain operand of another shape names the parameter."""
    mesh = init_device_mesh("cpu", (4,))
    m = sharded_holder(mesh, (Shard(0),))
    try:
        with torch.no_grad(), exact_sharded_init(m):
            m.weight.add_(torch.ones(3, 3))
        msg = ""
    except RuntimeError as e:
        msg = str(e)
    check(
        "init/refusal names the parameter", "sharded init" in msg and "'weight'" in msg, msg[:200]
    )


def main() -> None:
    run_cases()
    run_refusal()


if __name__ == "__main__":
    run_checks(main)
