"""Sharding of `titan.routed_experts` (torchtitan/ops/routed_experts.py) and its backward.

Per mesh dim the experts op can take four layouts:

* replicated: every rank computes every token through every expert;
* tokens split (data parallel): x, the routing weights and indices split on dim 0, the
  experts replicated; the backward's expert gradients are partial sums;
* hidden split (tensor parallel inside the experts): w1, w3 split on their hidden dim,
  w2 on its hidden dim, tokens replicated; the output (and the backward's x and routing
  gradients) are partial sums;
* experts split (expert parallelism, collective): tokens split on dim 0 and the experts'
  dim of w1, w2, w3 split over the same mesh dim; each rank dispatches its tokens to the
  experts' ranks and combines the results (`distributed/expert_parallel.py`), so the op
  runs `titan.routed_experts_ep` over that mesh dim's process group.

The first three are DTensor rules of the op (they run on local shards as they are); the
planner adds the fourth.  Every combination over the mesh dims is a candidate, with at most
one expert-parallel dim, whose expert count must divide evenly.

Cost of expert parallelism: the forward makes three all-to-alls (row counts, the rank's
T_local * K routed rows of D values to the experts, their results back), the backward six
(counts; rows, their output gradients and scores to the experts; the rows' and scores'
gradients back), i.e. 2 and 3 exchanges of the routed rows.  Rows are counted
`LOAD_IMBALANCE` times the average (a dropless router lets an expert take more than its
share; DeepSeek-V3's balancing keeps it near 1).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from torchtitan.distributed.expert_parallel import (
    routed_experts_ep,
    routed_experts_ep_backward,
)
from torchtitan.ops.routed_experts import BACKWARD_LAYOUTS as _BACKWARD
from torchtitan.ops.routed_experts import FORWARD_LAYOUTS as _FORWARD

from ..graph import placements as P
from .collective_ops import CollectiveOp, DimOption, register

LOAD_IMBALANCE = 1.25
_S0 = Shard(0)
FORWARD = torch.ops.titan.routed_experts.default
BACKWARD = torch.ops.titan.routed_experts_backward.default
_W1 = {FORWARD: 3, BACKWARD: 4}  # position of w1 among the tensor inputs


def _options(layouts: dict, w1_index: int):
    def options(in_vals: list, out_vals: list, n: int) -> list[DimOption]:
        n_experts = in_vals[w1_index].shape[0]
        out = []
        for name, (outs, ins) in layouts.items():
            collective = name == "experts"
            if collective and n_experts % n:
                continue
            out.append(DimOption(outs, ins, collective))
        return out

    return options


def _comm(w1_index: int, calls: int, row_exchanges: int):
    def comm(in_vals: list, in_pls: list, mesh_shape: tuple[int, ...]) -> tuple[int, float]:
        x, indices = in_vals[w1_index - 3], in_vals[w1_index - 1]
        local_tokens = P.local_shape(x.shape, in_pls[w1_index - 3], mesh_shape)[0]
        row_bytes = x.shape[1] * x.element_size()
        rows = local_tokens * indices.shape[1] * LOAD_IMBALANCE
        return calls, row_exchanges * rows * row_bytes

    return comm


def _expert_dim(w1_index: int):
    """The mesh dim the experts (dim 0 of w1) are split over, if any."""

    def expert_dim(in_pls: list) -> int | None:
        return next((d for d, p in enumerate(in_pls[w1_index]) if p == _S0), None)

    return expert_dim


def _run_local(kernel, w1_index: int):
    def run(args: tuple, out_vals: list, out_pls: list, mesh) -> tuple | None:
        tensors = [a for a in args if isinstance(a, DTensor)]
        dim = _expert_dim(w1_index)([t.placements for t in tensors])
        if dim is None:
            return None
        group = mesh.get_group(dim).group_name
        local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
        outs = kernel(*local, group)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        return tuple(
            DTensor.from_local(o, mesh, pl, run_check=False, shape=v.shape, stride=v.stride())
            for o, v, pl in zip(outs, out_vals, out_pls)
        )

    return run


register(
    FORWARD,
    CollectiveOp(
        _options(_FORWARD, _W1[FORWARD]),
        _expert_dim(_W1[FORWARD]),
        _comm(_W1[FORWARD], calls=3, row_exchanges=2),
        _run_local(routed_experts_ep, _W1[FORWARD]),
    ),
)
register(
    BACKWARD,
    CollectiveOp(
        _options(_BACKWARD, _W1[BACKWARD]),
        _expert_dim(_W1[BACKWARD]),
        _comm(_W1[BACKWARD], calls=6, row_exchanges=3),
        _run_local(routed_experts_ep_backward, _W1[BACKWARD]),
    ),
)
