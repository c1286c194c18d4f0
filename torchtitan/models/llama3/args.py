"""Llama 3 hyper-parameters and the public flavors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.protocols.model import BaseModelArgs

LLAMA3_VOCAB_SIZE = 128_256


@dataclass
class TransformerModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means one per query head."""
    vocab_size: int = LLAMA3_VOCAB_SIZE
    """Replaced by the tokenizer's vocabulary size when training."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    max_seq_len: int = 2048
    """Length of the RoPE table; set from `training.seq_len`."""
    depth_init: bool = True
    """Scale output-projection init by layer depth (True) or by total depth (False)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def tensor_parallel_sizes(self) -> dict[str, int]:
        return {
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads or self.n_heads,
            "dim": self.dim,
            "ffn_hidden_dim": self.ffn_hidden_dim,
            "vocab_size": self.vocab_size,
        }

    def update_from_config(self, job_config: JobConfig, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.max_seq_len = job_config.training.seq_len

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token, counted as torchtitan does.

        6 FLOPs per non-embedding parameter per token (forward 2, backward 4), plus the
        attention score and value matmuls: 2 matmuls × 3 (fwd + 2 bwd) × 2 (mul + add)
        = 12 · layers · heads · head_dim · seq_len.  Causal masking and activation
        recomputation are not counted (the usual MFU convention).
        """
        nparams = sum(p.numel() for p in model.parameters())
        nparams_embedding = sum(
            p.numel() for n, p in model.named_parameters() if "tok_embeddings" in n
        )
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return nparams, 6 * (nparams - nparams_embedding) + attention


llama3_configs: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500_000.0),
    # where compute weighs more than per-op overhead on CPU (benchmarks/auto_vs_manual.py)
    "debugmodel_large": TransformerModelArgs(dim=512, n_layers=8, n_heads=16, rope_theta=500_000.0),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}
