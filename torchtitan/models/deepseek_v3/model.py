"""A mixture-of-experts decoder: Llama 3 attention, DeepSeek-V3 / Qwen3-MoE feed-forwards.

Architecture and initialisation only — nothing here knows about parallelism.  The first
`n_dense_layers` blocks have a dense SwiGLU; the others a mixture of experts: a router
(softmax or sigmoid scores, top-k token choice), shared experts every token visits, and
routed experts stacked as `[E, ...]` weights that `titan.routed_experts` runs dropless.

Routing is decided per token from its own fp32 router scores, so it is the same in every
layout that computes those scores alike; the top-k is taken from `torch.topk` over the
expert dim of each token's row.

Load balancing (`load_balancing`):
* "aux_loss": DeepSeek-V3's sequence-wise balance loss `coef * E * sum_i f_i * P_i` (f_i the
  fraction of a sequence's routed slots that chose expert i, P_i its mean normalised score),
  averaged over sequences.  The model returns logits only, so the loss enters as gradient:
  `_BalanceLossGrad` is the identity on the layer's output forward and adds the loss's
  gradient backward — as if the trainer's loss included it.
* "bias": DeepSeek-V3's aux-loss-free balancing; a per-expert `expert_bias` (model state,
  saved with it) is added to the scores when choosing experts, not when weighting them, and
  after every optimizer step moves by `bias_update_rate` against its expert's excess load
  (`balancing.py`).  The load reaches it as its gradient (`_LoadSignal`), so it is summed
  over the batch however the batch is split, with no buffer written in the forward.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.deepseek_v3.args import MoEModelArgs
from torchtitan.models.llama3.model import Attention, FeedForward, precompute_rope_cache
from torchtitan.ops.routed_experts import routed_experts

# the expert bias's "gradient" is its layer's load imbalance in units of 2^-40: integer
# counts stay exact, and the value is far below anything a gradient norm can register
LOAD_SIGNAL_SCALE = 2.0**-40


class _LoadSignal(torch.autograd.Function):
    """Identity on the routing weights; backward hands the expert bias its layer's load
    imbalance, `(n_experts * tokens_e - routed pairs) * LOAD_SIGNAL_SCALE` per expert e,
    as its gradient (positive: expert e took more than its share)."""

    @staticmethod
    def forward(ctx, weights, bias, indices):
        ctx.save_for_backward(bias, indices)
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        bias, indices = ctx.saved_tensors
        flat = indices.reshape(-1)
        ones = torch.ones_like(flat, dtype=torch.float32)
        counts = torch.zeros_like(bias, dtype=torch.float32).scatter_add(0, flat, ones)
        signal = (counts * bias.shape[0] - flat.shape[0]) * LOAD_SIGNAL_SCALE
        return grad, signal.to(bias.dtype), None


class Router(nn.Module):
    """Top-k token choice: per token, the K experts with the highest (biased) scores and
    their (unbiased, optionally normalised and scaled) scores as weights."""

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm, self.route_scale = args.route_norm, args.route_scale
        self.use_bias = args.load_balancing == "bias"
        self.bias_update_rate = args.bias_update_rate
        if self.use_bias:
            # a parameter only to carry its load signal as a gradient (`_LoadSignal`): the
            # optimizer leaves it alone, `balancing.update_expert_biases` moves it
            self.expert_bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.use_bias:
            nn.init.zeros_(self.expert_bias)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.score_func == "softmax":
            return torch.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (scores [T, E], weights [T, K], indices [T, K])."""
        scores = self.scores(x)
        choice = scores + self.expert_bias.detach() if self.use_bias else scores
        indices = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.use_bias:
            weights = _LoadSignal.apply(weights, self.expert_bias, indices)
        if self.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, weights * self.route_scale, indices


class RoutedExperts(nn.Module):
    """`n_routed_experts` SwiGLU experts, stacked: w1, w3 [E, H, D], w2 [E, D, H]."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        return routed_experts(x, weights, indices, self.w1, self.w2, self.w3)


class _BalanceLossGrad(torch.autograd.Function):
    """Identity on `out`; backward also returns d(loss)/d(loss) = 1 for the balance loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient) for scores
    [B, S, E] and chosen indices [B, S, K], averaged over the B sequences."""
    seq_len, top_k = indices.shape[1], indices.shape[2]
    chosen = torch.zeros_like(scores).scatter(-1, indices, 1.0)  # [B, S, E], K ones per token
    f = chosen.sum(dim=1) * (n_experts / (top_k * seq_len))  # [B, E]
    p = (scores / scores.sum(-1, keepdim=True)).mean(dim=1)  # [B, E]
    return (f * p).sum(-1).mean()


class MoE(nn.Module):
    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.router = Router(args)
        self.experts = RoutedExperts(args.dim, args.moe_hidden_dim, args.n_routed_experts)
        self.shared_experts = (
            FeedForward(args.dim, args.n_shared_experts * args.moe_hidden_dim)
            if args.n_shared_experts > 0
            else None
        )
        self.n_experts = args.n_routed_experts
        self.aux_loss_coef = args.aux_loss_coef if args.load_balancing == "aux_loss" else 0.0

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        tokens = x.reshape(bs * seq, dim)
        scores, weights, indices = self.router(tokens)
        out = self.experts(tokens, weights, indices)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(bs, seq, dim)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            loss = balance_loss(scores.view(bs, seq, -1), indices.view(bs, seq, -1), self.n_experts)
            out = _BalanceLossGrad.apply(out, self.aux_loss_coef * loss)
        return out


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward: nn.Module = (
            MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.ffn_hidden_dim)
        )
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        cast(MoE, self.feed_forward).init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class MoETransformer(nn.Module):
    rope_cache: torch.Tensor

    def __init__(self, model_args: MoEModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): MoEBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def _rope_cache(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer in place, in a fixed order (see
        `llama3.model.Transformer.init_weights`)."""
        buffer_device = buffer_device or self.rope_cache.device
        with torch.no_grad():
            self.rope_cache = self._rope_cache().to(buffer_device)
            nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                cast(MoEBlock, layer).init_weights()
            self.norm.reset_parameters()
            std = self.model_args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        rope_cache = self.rope_cache[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope_cache)
        return self.output(self.norm(h))
