"""Attention as one op the planner can split by batch and by head.

Traced through the MATH backend, `F.scaled_dot_product_attention` becomes matmuls over a
flattened `[batch * heads, seq, head_dim]` view.  With the batch split on one mesh dim and the
heads on another, that flattened dim is a `_StridedShard` the strategies drop, so head-parallel
(Megatron) attention could not be planned, and the `seq x seq` probabilities were saved for
backward.

While tracing, `route_attention()` sends every SDPA call without dropout or grouped heads —
with or without a mask that needs no gradient (a boolean one becomes additive, as SDPA makes
it; transformers' decoders pass one while traced) — to `torch.ops.titan.sdpa` (forward) and
`torch.ops.titan.sdpa_backward`, so the joint graph holds attention as two nodes.  Their
sharding rules (registered with DTensor, so the same rules serve planning and execution) split
batch or heads on any mesh dim; the saved activations are those of a flash kernel (q, k, v,
the output and its log-sum-exp), never the `seq x seq` probabilities. On CPU both run torch's
fused flash kernels — the very calls the unplanned model makes, so the backward reuses the
forward's log-sum-exp; elsewhere the forward is `F.scaled_dot_product_attention` and the
backward recomputes (the flash kernel on a GPU in 16 bits, else the textbook gradient).  Other SDPA
calls keep the MATH decomposition.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

_aten = torch.ops.aten


def _output_strides(like: Tensor, shape: torch.Size) -> tuple[int, ...]:
    """The strides of a result of `shape` made from `like`: `like`'s memory layout (as
    torch's fused CPU kernels write their output and gradients) when the shapes agree, else
    contiguous.  A model's q is usually a transpose of a [batch, seq, heads, head_dim]
    tensor; so are the output and q's gradient then, and the transposes back that merge
    the heads copy nothing."""
    if tuple(shape) == tuple(like.shape):
        return torch.empty_like(like, device="meta").stride()
    return torch.empty(shape, device="meta").stride()


def _laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    """`t` with exactly `_output_strides` (a copy only where the kernel wrote another)."""
    strides = _output_strides(like, t.shape)
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _grads_laid_out(grads, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v, each in its input's layout (`sdpa_backward`'s contract)."""
    dq, dk, dv = grads
    return _laid_out_like(dq, q), _laid_out_like(dk, k), _laid_out_like(dv, v)


def _attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return _laid_out_like(out, q), q.new_zeros(q.shape[:-1], dtype=torch.float32)  # unset


@torch.library.custom_op("titan::sdpa", mutates_args=())
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Attention over [batch, heads, seq, head_dim]; `mask` (or None) is added to the scores
    (q's dtype, broadcastable to [batch, heads, q_seq, k_seq]).  Returns the output (in q's
    memory layout, `_output_strides`) and each query's log-sum-exp of its scores ([batch,
    heads, q_seq], float32), which the backward reuses where the device's fused kernel gives
    it (`_fused_on_cpu`); elsewhere it is left unset (zeros) and the backward recomputes what
    it needs."""
    return _attention(q, k, v, mask, is_causal, scale)


def _fused_on_cpu(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The fused CPU kernels take these (their one limit here: equal head dims)."""
    return q.shape[-1] == k.shape[-1] == v.shape[-1]


@sdpa.register_kernel("cpu")
def _(q, k, v, mask, is_causal, scale):
    if not _fused_on_cpu(q, k, v):
        return _attention(q, k, v, mask, is_causal, scale)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return _laid_out_like(out, q), lse.float().contiguous()


@sdpa.register_fake
def _(q, k, v, mask, is_causal, scale):
    shape = torch.Size((*q.shape[:-1], v.shape[-1]))
    out = q.new_empty_strided(shape, _output_strides(q, shape))
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


def softmax_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention w.r.t. q, k, v from the textbook formulas (probabilities
    recomputed in float32), for any device; contiguous (`sdpa_backward` lays them out)."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * s
    if mask is not None:
        scores = scores + mask.float()
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    g = grad_out.float()
    d_probs = torch.matmul(g, v.float().transpose(-2, -1))
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * s
    dq = torch.matmul(d_scores, k.float())
    dk = torch.matmul(d_scores.transpose(-2, -1), q.float())
    dv = torch.matmul(probs.transpose(-2, -1), g)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@torch.library.custom_op("titan::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `sdpa` w.r.t. q, k, v, from its inputs, output and log-sum-exp (or
    recomputing the forward where the device's kernel left that unset), each laid out like
    its input (`_output_strides`)."""
    return _grads_laid_out(
        softmax_attention_backward(grad_out, q, k, v, mask, is_causal, scale), q, k, v
    )


@sdpa_backward.register_kernel("cpu")
def _(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    if not _fused_on_cpu(q, k, v):
        grads = softmax_attention_backward(grad_out, q, k, v, mask, is_causal, scale)
    else:
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    return _grads_laid_out(grads, q, k, v)


@sdpa_backward.register_kernel("cuda")
def _(grad_out, q, k, v, _out, _lse, mask, is_causal, scale):
    # 16-bit with equal head dims and no mask: recompute with the flash kernel, then its
    # backward (no seq x seq tensor); anything else takes the textbook gradient
    if (
        q.dtype not in (torch.float16, torch.bfloat16)
        or mask is not None
        or not q.shape[-1] == k.shape[-1] == v.shape[-1]
    ):
        grads = softmax_attention_backward(grad_out, q, k, v, mask, is_causal, scale)
        return _grads_laid_out(grads, q, k, v)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _mask = (
        _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    )
    grads = _aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        is_causal,
        seed,
        offset,
        scale=scale,
    )
    return _grads_laid_out(grads[:3], q, k, v)


@sdpa_backward.register_fake
def _(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    return tuple(x.new_empty_strided(x.shape, _output_strides(x, x.shape)) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = sdpa_backward(grad_out, q, k, v, out, lse, mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup_context)


# ---- sharding: every tensor split alike on batch (dim 0) or heads (dim 1), or all replicated;
# the mask follows where it has that dim and is replicated where it broadcasts (size 1)
def _split_alike(n_out: int, n_tensor_in: int, mask) -> list:
    rules: list[tuple[list, list]] = []
    for p in (Replicate(), Shard(0), Shard(1)):
        if mask is None:
            mask_pl = None
        else:
            mask_pl = p if isinstance(p, Replicate) or mask.shape[p.dim] > 1 else Replicate()
        rules.append(([p] * n_out, [p] * n_tensor_in + [mask_pl, None, None]))
    return rules


@register_sharding(torch.ops.titan.sdpa.default)
def _sdpa_sharding(q, k, v, mask, is_causal, scale):
    return _split_alike(2, 3, mask)


@register_sharding(torch.ops.titan.sdpa_backward.default)
def _sdpa_backward_sharding(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    return _split_alike(3, 6, mask)


# ---- FLOPs for the cost model: 2 matmuls forward; the backward's 4, priced with the 2 of
# the forward it recomputes off CPU
def _attention_flops(q_shape, k_shape, v_shape) -> int:
    *batch, lq, e = q_shape
    return 2 * math.prod(batch) * lq * k_shape[-2] * (e + v_shape[-1])


@register_flop_formula(torch.ops.titan.sdpa)
def _sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.titan.sdpa_backward)
def _sdpa_backward_flops(
    g_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    return 3 * _attention_flops(q_shape, k_shape, v_shape)


# ---- routing F.scaled_dot_product_attention while tracing
def _sdpa_args(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> dict:
    return dict(
        q=query,
        k=key,
        v=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _routable(a: dict) -> bool:
    q, k, v, mask = a["q"], a["k"], a["v"], a["attn_mask"]
    return (
        a["dropout_p"] == 0.0
        and not a["enable_gqa"]
        and all(isinstance(t, Tensor) and t.ndim == 4 for t in (q, k, v))
        and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and k.shape[2] == v.shape[2]
        and q.dtype == k.dtype == v.dtype
        and (mask is None or _routable_mask(mask, q, k))
    )


def _routable_mask(mask, q: Tensor, k: Tensor) -> bool:
    """A bool or q-dtype mask over [[batch or 1,] [heads or 1,] q_seq, k_seq] that needs no
    gradient (`titan.sdpa` gives none: a learned bias, T5's relative positions, keeps the
    MATH decomposition, whose gradient reaches it)."""
    if not (
        isinstance(mask, Tensor) and 2 <= mask.ndim <= 4 and mask.dtype in (torch.bool, q.dtype)
    ):
        return False
    if mask.requires_grad and torch.is_grad_enabled():
        return False
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return (
        shape[0] in (1, q.shape[0])
        and shape[1] in (1, q.shape[1])
        and shape[2:] == (q.shape[2], k.shape[2])
    )


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask as 4-D scores to add: a boolean one (True = attend) as SDPA derives it."""
    if mask is None:
        return None
    mask = mask.view((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


class _RouteAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = _sdpa_args(*args, **kwargs)
            if _routable(a):
                mask = _additive(a["attn_mask"], a["q"].dtype)
                out, _lse = sdpa(a["q"], a["k"], a["v"], mask, bool(a["is_causal"]), a["scale"])
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def route_attention():
    """While tracing: routable SDPA calls become `titan.sdpa`; the rest decompose through the
    MATH backend (bmm / softmax, which DTensor has rules for)."""
    with sdpa_kernel(SDPBackend.MATH), _RouteAttention():
        yield
