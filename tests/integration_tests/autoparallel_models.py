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
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n_layers))
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

    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=vocab, max_seq_len=seq,
                               n_layers=n_layers)
    return Transformer(args)
