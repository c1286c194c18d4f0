"""Expert parallelism: `titan.routed_experts` with the experts split over a process group.

Each of the `G` ranks of the group holds `E / G` consecutive experts (rank r: experts
`r * E/G ...`) and a slice of the tokens.  Forward: the rank orders its (token, k) pairs by
expert, tells every peer how many rows it will send for each of the peer's experts
(an all-to-all of counts), sends the token rows (an all-to-all whose split sizes are known
only now), runs its experts over what it received — ordered by expert, then by source rank,
i.e. in global token order for a token-split batch, as one process orders them — and sends
the results back (the reverse all-to-all), where they are weighted and summed.  Backward:
the same exchange carries each row, its output gradient and its router score to the expert,
and brings back the row's gradient and the score's gradient; weight gradients stay with the
experts.

The two ops take the group by name (a string argument), so a lowered graph that calls them
is a plain graph: the all-to-alls are inside these nodes because their sizes are data
dependent.  Used by the hand-written baseline (`ExpertParallel`) and the planner's lowering.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchtitan.ops.routed_experts import (
    combine,
    expert_order,
    experts_backward,
    experts_forward,
    unsort_pairs,
)
from torchtitan.torch_private import resolve_process_group


class _Exchange:
    """Row counts between the ranks of `group` for pairs sorted by (global) expert."""

    def __init__(self, indices: Tensor, n_local: int, group):
        self.group = group
        size = dist.get_world_size(group)
        self.order, counts = expert_order(indices, n_local * size)
        send = counts.view(size, n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        self.send_splits = send.sum(1).tolist()
        self.recv_splits = recv.sum(1).tolist()
        # received rows are grouped by source rank, then by local expert: the stable sort by
        # local expert puts each expert's rows in source-rank order
        ids = torch.arange(n_local, device=indices.device).repeat(size)
        local_ids = torch.repeat_interleave(ids, recv.reshape(-1))
        self.local_order = torch.sort(local_ids, stable=True).indices
        self.local_counts = recv.sum(0)

    def to_experts(self, rows: Tensor) -> Tensor:
        """Rows sorted by expert, sent to the experts' ranks, grouped by local expert."""
        out = rows.new_empty((sum(self.recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(
            out, rows.contiguous(), self.recv_splits, self.send_splits, group=self.group
        )
        return out[self.local_order]

    def from_experts(self, rows: Tensor) -> Tensor:
        """The inverse of `to_experts`."""
        back = torch.empty_like(rows)
        back[self.local_order] = rows
        out = rows.new_empty((sum(self.send_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, back, self.send_splits, self.recv_splits, group=self.group)
        return out


@torch.library.custom_op("titan::routed_experts_ep", mutates_args=())
def routed_experts_ep(
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    group_name: str,
) -> Tensor:
    """`titan.routed_experts` for this rank's tokens, with the experts split over the group."""
    n_tokens, k = indices.shape
    ex = _Exchange(indices, w1.shape[0], resolve_process_group(group_name))
    rows = ex.to_experts(x[ex.order // k])
    y = ex.from_experts(experts_forward(rows, ex.local_counts, w1, w2, w3))
    return combine(unsort_pairs(y, ex.order, n_tokens), weights, x.dtype)


@routed_experts_ep.register_fake
def _(x, weights, indices, w1, w2, w3, group_name):
    return x.new_empty(x.shape)


@torch.library.custom_op("titan::routed_experts_ep_backward", mutates_args=())
def routed_experts_ep_backward(
    grad: Tensor,
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `routed_experts_ep` w.r.t. x, weights and this rank's w1, w2, w3."""
    n_tokens, k = indices.shape
    ex = _Exchange(indices, w1.shape[0], resolve_process_group(group_name))
    pair = ex.order // k
    rows = ex.to_experts(x[pair])
    grads = ex.to_experts(grad[pair])
    scores = ex.to_experts(weights.reshape(-1)[ex.order])
    d_rows, d_scores, dw1, dw2, dw3 = experts_backward(
        rows, grads, scores, ex.local_counts, w1, w2, w3
    )
    dx = unsort_pairs(ex.from_experts(d_rows), ex.order, n_tokens).sum(1).to(x.dtype)
    d_weights = unsort_pairs(ex.from_experts(d_scores), ex.order, n_tokens)
    return dx, d_weights.to(weights.dtype), dw1, dw2, dw3


@routed_experts_ep_backward.register_fake
def _(grad, x, weights, indices, w1, w2, w3, group_name):
    return (
        x.new_empty(x.shape),
        weights.new_empty(weights.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
        w3.new_empty(w3.shape),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.group_name = inputs[6]


def _backward(ctx, grad):
    x, weights, indices, w1, w2, w3 = ctx.saved_tensors
    grads = routed_experts_ep_backward(grad, x, weights, indices, w1, w2, w3, ctx.group_name)
    dx, d_weights, dw1, dw2, dw3 = grads
    return dx, d_weights, None, dw1, dw2, dw3, None


routed_experts_ep.register_autograd(_backward, setup_context=_setup_context)


WEIGHTS = ("w1", "w2", "w3")


class ExpertParallel(nn.Module):
    """Wraps a routed-experts module (parameters `w1`, `w2`, `w3` stacked over experts, a
    `forward(x, weights, indices)` calling `titan.routed_experts`) whose parameters already
    hold this rank's experts (as DTensors split on dim 0 over the EP mesh, or plain local
    tensors): the same parameter names, the forward through `routed_experts_ep`."""

    def __init__(self, experts: nn.Module, group_name: str):
        super().__init__()
        self.w1, self.w2, self.w3 = (cast(nn.Parameter, getattr(experts, n)) for n in WEIGHTS)
        self.group_name = group_name
        self.init_weights = experts.init_weights

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        return routed_experts_ep(x, weights, indices, w1, w2, w3, self.group_name)


def _local(w: Tensor) -> Tensor:
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w
