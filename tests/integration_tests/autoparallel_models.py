"""Small test models for the planner tests (an MLP stack, a GPT-2 style block, tiny Llama3).

Each model has `init_weights()` so the sharded-init path is exercised, and a `make_batch`
giving (inputs, labels) with global shapes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPStack(nn.Module):
    """Linear+GELU blocks with biases; output is a regression head."""

    def __init__(self, dim: int = 32, hidden: int = 64, n_layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.05)
                nn.init.uniform_(m.bias, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class GPT2Block(nn.Module):
    """Token + learned position embeddings, one pre-LN attention/MLP block, LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, max_seq: int = 16):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj2 = nn.Linear(4 * dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        q, k, v = self.c_attn(self.ln_1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(a.transpose(1, 2).reshape(b, s, -1))
        x = x + self.c_proj2(F.gelu(self.c_fc(self.ln_2(x))))
        return self.lm_head(self.ln_f(x))


def tiny_llama(n_layers: int = 2, vocab: int = 256, seq: int = 16):
    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.model import Transformer

    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=vocab, max_seq_len=seq, n_layers=n_layers
    )
    return Transformer(args)


def tiny_moe(n_layers: int = 3, vocab: int = 256, seq: int = 16, **overrides):
    """The MoE decoder (1 dense layer, then MoE layers of 8 experts, top 2, one shared), small."""
    from torchtitan.models.deepseek_v3.args import moe_configs
    from torchtitan.models.deepseek_v3.model import MoETransformer

    small = dict(dim=64, n_heads=4, n_kv_heads=2, moe_hidden_dim=128)
    args = dataclasses.replace(
        moe_configs["debugmodel"],
        vocab_size=vocab,
        max_seq_len=seq,
        n_layers=n_layers,
        **{**small, **overrides},
    )
    return MoETransformer(args)


class TiedLM(nn.Module):
    """GPT-style LM with learned positions, LayerNorm blocks and an LM head tied to the token
    embedding (one parameter under two FQNs); `dropout` > 0 adds train-mode dropout."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        n_layers: int = 2,
        max_seq: int = 16,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim),
                nn.Linear(dim, 2 * dim),
                nn.GELU(),
                nn.Linear(2 * dim, dim),
                nn.Dropout(dropout),
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.1)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.uniform_(m.bias, -0.1, 0.1)
            if isinstance(m, nn.LayerNorm):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class Mixer(nn.Module):
    """MLP-Mixer-like: LayerNorm, token mixing (an MLP across the sequence, via transposes)
    and channel mixing per block, then a regression head."""

    def __init__(self, seq: int = 8, dim: int = 32, n_layers: int = 2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * n_layers))
        self.token_mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(seq, 2 * seq), nn.GELU(), nn.Linear(2 * seq, seq))
            for _ in range(n_layers)
        )
        self.channel_mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.1)
                nn.init.uniform_(m.bias, -0.1, 0.1)
            if isinstance(m, nn.LayerNorm):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (tok, ch) in enumerate(zip(self.token_mlps, self.channel_mlps)):
            x = x + tok(self.norms[2 * i](x).transpose(1, 2)).transpose(1, 2)
            x = x + ch(self.norms[2 * i + 1](x))
        return self.head(x)


class Indexing(nn.Module):
    """Advanced indexing between two linear layers: a two-index-tensor read (`index.Tensor`),
    an accumulating indexed write (`index_put`), `gather` and `scatter_add` along the
    sequence, with index tables held in buffers that `init_weights` fills by `copy_`."""

    def __init__(self, seq: int = 8, dim: int = 32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, dim)
        self.register_buffer("perm", torch.zeros(seq, dtype=torch.long))
        self.register_buffer("bucket", torch.zeros(seq, dtype=torch.long))

    def init_weights(self) -> None:
        for m in (self.proj, self.head):
            nn.init.normal_(m.weight, std=0.1)
            nn.init.uniform_(m.bias, -0.1, 0.1)
        seq = self.perm.shape[0]
        self.perm.copy_(torch.tensor([(3 * i + 1) % seq for i in range(seq)]))
        self.bucket.copy_(torch.arange(seq) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.proj(x)
        rows = torch.arange(b, device=x.device)[:, None]
        permuted = h[rows, self.perm[None, :]]  # index.Tensor with two index tensors
        pooled = torch.zeros(b, s // 2, d, device=x.device, dtype=h.dtype).index_put(
            (rows, self.bucket[None, :]), permuted, accumulate=True
        )
        idx = self.perm[None, :, None].expand(b, s, d)
        gathered = torch.gather(h, 1, idx)
        scattered = torch.zeros_like(h).scatter_add(1, idx, h * 0.5)
        return self.head(permuted + gathered + scattered) + pooled.mean(1, keepdim=True)


class Elementwise(nn.Module):
    """Ops DTensor has no rule for (softplus' backward, floor_divide) and a constant the
    forward makes from Python numbers (`torch.tensor([...])`, a graph attribute)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        for m in (self.proj, self.head):
            nn.init.normal_(m.weight, std=0.1)
            nn.init.uniform_(m.bias, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.softplus(self.proj(x))
        pos = torch.floor_divide(torch.arange(x.shape[1], device=x.device), 2)
        h = h + pos[None, :, None].to(h.dtype) * torch.tensor([0.25, 0.5], device=x.device).sum()
        return self.head(h)
