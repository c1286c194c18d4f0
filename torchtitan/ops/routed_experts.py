"""Routed experts as one op: `torch.ops.titan.routed_experts` (and its backward).

A mixture-of-experts layer routes every token to `K` of `E` SwiGLU experts and sums their
outputs weighted by the router's scores.  Model code computes the routing (scores, top-k)
and calls this op for the experts, so the planner sees the expert computation as one node
whose sharding it can choose — tokens split (data parallel), the experts' hidden dim split
(tensor parallel inside the experts) or the experts themselves split with tokens dispatched
to them (expert parallelism, `torchtitan/distributed/expert_parallel.py`) — instead of the
data-dependent sort / histogram / grouped GEMM / scatter it is made of.

    out[t] = sum_k weights[t, k] * expert[indices[t, k]](x[t])
    expert[e](v) = w2[e] @ (silu(w1[e] @ v) * (w3[e] @ v))

Shapes: x [T, D], weights [T, K] (any float dtype), indices [T, K] int64, w1 and w3
[E, H, D], w2 [E, D, H] (each expert as `nn.Linear` weights).  The kernel is dropless:
every (token, expert) pair is computed.  Pairs are ordered by expert with a stable sort, so
an expert sees its tokens in token order, whatever the layout; each token's `K` results
are summed in `k` order.  So the arithmetic per token is the same in every layout that
keeps an expert's tokens together, and results do not depend on how ties sort.

The fake kernels accept every float dtype (torch's own `_grouped_mm` fake kernel demands
bf16, so a model calling it directly cannot be traced in fp32); the CPU and CUDA kernels use
`torch._grouped_mm` where its alignment rules hold and one matmul per expert elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils.flop_counter import register_flop_formula


def _wide(t: Tensor) -> Tensor:
    """`t` in at least float32 (16-bit values are accumulated in float32)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ---- the per-expert computation on rows already grouped by expert
def _aligned(*tensors: Tensor) -> bool:
    return all(
        t.dtype in (torch.float32, torch.bfloat16)
        and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
        and t.stride()[-1] == 1
        for t in tensors
    )


def grouped_matmul(rows: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """rows [N, A] grouped by expert (`counts[e]` rows each) times w[e].T ([E, B, A])
    -> [N, B]."""
    wt = w.transpose(-2, -1)
    if rows.shape[0] > 0 and rows.dtype == w.dtype and w.is_contiguous() and _aligned(rows, wt):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(rows, wt, offs=offs)
    out = rows.new_empty((rows.shape[0], w.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):
        torch.matmul(rows[start : start + n], wt[e], out=out[start : start + n])
        start += n
    return out


def grouped_weight_grad(left: Tensor, right: Tensor, counts: Tensor) -> Tensor:
    """sum over each expert's rows of left.T @ right: [N, B], [N, A] -> [E, B, A]."""
    out = left.new_zeros((counts.shape[0], left.shape[1], right.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            torch.matmul(left[start : start + n].t(), right[start : start + n], out=out[e])
        start += n
    return out


def experts_forward(rows: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """SwiGLU of every row by its expert."""
    h = F.silu(grouped_matmul(rows, w1, counts)) * grouped_matmul(rows, w3, counts)
    return grouped_matmul(h, w2, counts)


def experts_backward(
    rows: Tensor,
    grads: Tensor,
    scores: Tensor,
    counts: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """For rows whose outputs were scaled by `scores` and received `grads`: the gradient of
    each row, of each score, and of w1, w2, w3 (the forward is recomputed)."""
    h1 = grouped_matmul(rows, w1, counts)
    h3 = grouped_matmul(rows, w3, counts)
    act = F.silu(h1)
    h = act * h3
    y = grouped_matmul(h, w2, counts)
    d_scores = (_wide(grads) * _wide(y)).sum(-1)
    dy = (_wide(grads) * _wide(scores)[:, None]).to(rows.dtype)
    dh = grouped_matmul(dy, w2.transpose(-2, -1), counts)
    sig = torch.sigmoid(h1)
    dh1 = dh * h3 * (sig * (1 + h1 * (1 - sig)))
    dh3 = dh * act
    d_rows = grouped_matmul(dh1, w1.transpose(-2, -1), counts) + grouped_matmul(
        dh3, w3.transpose(-2, -1), counts
    )
    dw1 = grouped_weight_grad(dh1, rows, counts)
    dw2 = grouped_weight_grad(dy, h, counts)
    dw3 = grouped_weight_grad(dh3, rows, counts)
    return d_rows, d_scores, dw1, dw2, dw3


# ---- pairs (token, k) ordered by expert, and back
def expert_order(indices: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """The (token, k) pairs sorted by expert, stably (a permutation of T*K), and the number
    of pairs per expert."""
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts)
    return order, counts


def unsort_pairs(sorted_rows: Tensor, order: Tensor, n_tokens: int) -> Tensor:
    """Rows in expert order back to [T, K, ...] pair order."""
    out = torch.empty_like(sorted_rows)
    out[order] = sorted_rows
    return out.view(n_tokens, -1, *sorted_rows.shape[1:])


def combine(pair_out: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """sum_k weights[t, k] * pair_out[t, k] in (at least) float32, in k order."""
    return (_wide(pair_out) * _wide(weights)[..., None]).sum(1).to(dtype)


# ---- the op
@torch.library.custom_op("titan::routed_experts", mutates_args=())
def routed_experts(
    x: Tensor, weights: Tensor, indices: Tensor, w1: Tensor, w2: Tensor, w3: Tensor
) -> Tensor:
    """Every token through its K experts, weighted and summed (module docstring)."""
    n_tokens, k = indices.shape
    order, counts = expert_order(indices, w1.shape[0])
    rows = x[order // k]
    y = experts_forward(rows, counts, w1, w2, w3)
    return combine(unsort_pairs(y, order, n_tokens), weights, x.dtype)


@routed_experts.register_fake
def _(x, weights, indices, w1, w2, w3):
    return x.new_empty(x.shape)


@torch.library.custom_op("titan::routed_experts_backward", mutates_args=())
def routed_experts_backward(
    grad: Tensor, x: Tensor, weights: Tensor, indices: Tensor, w1: Tensor, w2: Tensor, w3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `routed_experts` w.r.t. x, weights, w1, w2, w3."""
    n_tokens, k = indices.shape
    order, counts = expert_order(indices, w1.shape[0])
    pair = order // k
    d_rows, d_scores, dw1, dw2, dw3 = experts_backward(
        x[pair], grad[pair], weights.reshape(-1)[order], counts, w1, w2, w3
    )
    dx = unsort_pairs(d_rows, order, n_tokens).sum(1).to(x.dtype)
    d_weights = unsort_pairs(d_scores, order, n_tokens).to(weights.dtype)
    return dx, d_weights, dw1, dw2, dw3


@routed_experts_backward.register_fake
def _(grad, x, weights, indices, w1, w2, w3):
    return (
        x.new_empty(x.shape),
        weights.new_empty(weights.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
        w3.new_empty(w3.shape),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, weights, indices, w1, w2, w3 = ctx.saved_tensors
    dx, d_weights, dw1, dw2, dw3 = routed_experts_backward(grad, x, weights, indices, w1, w2, w3)
    return dx, d_weights, None, dw1, dw2, dw3


routed_experts.register_autograd(_backward, setup_context=_setup_context)


# ---- FLOPs: three matmuls per (token, expert) pair forward; backward recomputes them and
# adds six (the input gradients of three, the weight gradients of three)
def experts_flops(x_shape, indices_shape, w1_shape) -> int:
    pairs = indices_shape[0] * indices_shape[1]
    return 2 * 3 * pairs * w1_shape[1] * w1_shape[2]


@register_flop_formula(torch.ops.titan.routed_experts)
def _forward_flops(x_shape, weights_shape, indices_shape, w1_shape, *args, out_shape=None, **kw):
    return experts_flops(x_shape, indices_shape, w1_shape)


@register_flop_formula(torch.ops.titan.routed_experts_backward)
def _backward_flops(
    g_shape, x_shape, w_shape, indices_shape, w1_shape, *args, out_shape=None, **kw
):
    return 3 * experts_flops(x_shape, indices_shape, w1_shape)


# ---- layouts per mesh dim, as (outputs, tensor inputs in argument order); all but
# "experts" run on local shards as they are and are the op's DTensor rules; "experts"
# (expert parallelism) needs the all-to-alls of distributed/expert_parallel.py
_R, _S0, _S1, _S2, _P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
FORWARD_LAYOUTS = {  # x, weights, indices, w1, w2, w3 -> out
    "replicated": ((_R,), (_R,) * 6),
    "tokens": ((_S0,), (_S0, _S0, _S0, _R, _R, _R)),
    "hidden": ((_P,), (_R, _R, _R, _S1, _S2, _S1)),
    "experts": ((_S0,), (_S0,) * 6),
}
BACKWARD_LAYOUTS = {  # grad, x, weights, indices, w1, w2, w3 -> dx, d_weights, dw1, dw2, dw3
    "replicated": ((_R,) * 5, (_R,) * 7),
    "tokens": ((_S0, _S0, _P, _P, _P), (_S0, _S0, _S0, _S0, _R, _R, _R)),
    "hidden": ((_P, _P, _S1, _S2, _S1), (_R, _R, _R, _R, _S1, _S2, _S1)),
    "experts": ((_S0,) * 5, (_S0,) * 7),
}


def _local_rules(layouts: dict) -> list:
    return [(list(o), list(i)) for name, (o, i) in layouts.items() if name != "experts"]


@register_sharding(torch.ops.titan.routed_experts.default)
def _forward_sharding(x, weights, indices, w1, w2, w3):
    return _local_rules(FORWARD_LAYOUTS)


@register_sharding(torch.ops.titan.routed_experts_backward.default)
def _backward_sharding(grad, x, weights, indices, w1, w2, w3):
    return _local_rules(BACKWARD_LAYOUTS)
