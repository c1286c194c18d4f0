"""Llama 3: RoPE, grouped-query attention, SwiGLU, RMSNorm.

Architecture and initialisation only — nothing here knows about parallelism.  Reshapes
use -1 for the head count so the same code runs when tensor parallelism has split the
projections across ranks.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.llama3.args import TransformerModelArgs


def precompute_rope_cache(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos/sin table of shape (max_seq_len, head_dim // 2, 2), kept real-valued."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the RoPE angles."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = rope_cache[..., 0].unsqueeze(1)  # (seq, 1, head_dim // 2)
    sin = rope_cache[..., 1].unsqueeze(1)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, seq, kv_heads, head_dim) -> (batch, seq, kv_heads * n_rep, head_dim)."""
    if n_rep == 1:
        return x
    bs, seq, kv_heads, head_dim = x.shape
    return x.unsqueeze(3).expand(bs, seq, kv_heads, n_rep, head_dim).flatten(2, 3)


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if rope_cache.shape[0] != seq:  # given the whole cache (see Transformer.forward)
            rope_cache = rope_cache[:seq]
        q, k = apply_rotary_emb(q, rope_cache), apply_rotary_emb(k, rope_cache)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        # Out-of-place residual adds: FSDP2 drops hooks on in-place ops on views.
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    rope_cache: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # Non-persistent: derived from the args, recomputed by init_weights.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        # A dict keyed by layer index keeps parameter names stable if layers are removed.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def _rope_cache(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer in place.

        Separate from `reset_parameters` on purpose: the trainer builds the model on the
        meta device, parallelises it, allocates with `to_empty()` and only then calls
        this — so it must set everything, in a fixed order (the random draws then match
        across meshes), and must not assume parameters are plain tensors.
        """
        buffer_device = buffer_device or self.rope_cache.device
        with torch.no_grad():
            self.rope_cache = self._rope_cache().to(buffer_device)
            nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                # a TransformerBlock, or a wrapper (activation checkpointing) forwarding to one
                cast(TransformerBlock, layer).init_weights()
            self.norm.reset_parameters()
            std = self.model_args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits.  A model cut into consecutive parts (pipeline
        stages) runs without the modules other parts hold (None): without the embeddings
        it takes hidden states in, without the norm and output it returns them."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            rope_cache = self.rope_cache[: tokens.shape[1]]
        else:  # hidden states, maybe a slice of the sequence: attention takes what it needs
            h, rope_cache = tokens, self.rope_cache
        for layer in self.layers.values():
            h = layer(h, rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
