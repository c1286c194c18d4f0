"""Mixture-of-experts decoder hyper-parameters (DeepSeek-V3 / Qwen3-MoE style) and flavors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.models.llama3.args import TransformerModelArgs

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("none", "aux_loss", "bias")


@dataclass
class MoEModelArgs(TransformerModelArgs):
    """Llama 3 attention and dense feed-forwards for the first `n_dense_layers` layers, a
    mixture of experts as the feed-forward of the rest."""

    n_dense_layers: int = 1
    dense_hidden_dim: int | None = None
    """Hidden size of the dense layers' SwiGLU; None: Llama 3's rule (`ffn_hidden_dim`)."""
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    """Experts every token goes through (one SwiGLU of `n_shared_experts * moe_hidden_dim`)."""
    top_k: int = 2
    moe_hidden_dim: int = 256
    score_func: str = "softmax"
    """Router scores: softmax over experts (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3)."""
    route_norm: bool = False
    """Divide each token's top-k scores by their sum."""
    route_scale: float = 1.0
    load_balancing: str = "aux_loss"
    """"aux_loss": DeepSeek-V3's sequence-wise balance loss, weighted `aux_loss_coef`;
    "bias": aux-loss-free, a per-expert bias (model state) shifts which experts are chosen;
    "none"."""
    aux_loss_coef: float = 1e-3
    bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.score_func not in SCORE_FUNCTIONS:
            raise ValueError(
                f"score_func must be one of {SCORE_FUNCTIONS}, got {self.score_func!r}"
            )
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(
                f"load_balancing must be one of {LOAD_BALANCING}, got {self.load_balancing!r}"
            )
        if not 0 < self.top_k <= self.n_routed_experts:
            raise ValueError(
                f"top_k {self.top_k} must be between 1 and n_routed_experts {self.n_routed_experts}"
            )

    @property
    def ffn_hidden_dim(self) -> int:
        if self.dense_hidden_dim is not None:
            return self.dense_hidden_dim
        return super().ffn_hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    def routed_experts(self) -> int:
        return self.n_routed_experts

    def tensor_parallel_sizes(self) -> dict[str, int]:
        sizes = super().tensor_parallel_sizes()
        sizes["moe_hidden_dim"] = self.moe_hidden_dim
        return sizes

    def update_from_config(self, job_config: JobConfig, tokenizer: Any) -> None:
        super().update_from_config(job_config, tokenizer)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """All parameters, and training FLOPs per token counting only the experts a token
        visits (top_k routed of n_routed_experts, plus the shared ones)."""
        nparams = sum(p.numel() for p in model.parameters())
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        embedding = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" in n)
        active = nparams - embedding - routed + routed * self.top_k // self.n_routed_experts
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return nparams, 6 * active + attention


moe_configs: dict[str, MoEModelArgs] = {
    # 1 dense + 3 MoE layers of 8 experts (top 2, one shared): 10 steps on 4 CPU ranks in
    # about a minute
    "debugmodel": MoEModelArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=8, n_dense_layers=1, moe_hidden_dim=256
    ),
    "debugmodel_bias": MoEModelArgs(
        dim=256,
        n_layers=4,
        n_heads=16,
        n_kv_heads=8,
        n_dense_layers=1,
        moe_hidden_dim=256,
        score_func="sigmoid",
        route_norm=True,
        load_balancing="bias",
    ),
    # DeepSeek-V2-Lite / Moonlight-16B-A3B class (attention as GQA, not MLA)
    "16B": MoEModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=102_400,
        n_dense_layers=1,
        dense_hidden_dim=10944,
        n_routed_experts=64,
        n_shared_experts=2,
        top_k=6,
        moe_hidden_dim=1408,
        score_func="softmax",
        load_balancing="bias",
    ),
    # DeepSeek-V3 671B (attention as multi-head GQA, not MLA; dense layers of 18432)
    "671B": MoEModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129_280,
        n_dense_layers=3,
        dense_hidden_dim=18432,
        n_routed_experts=256,
        n_shared_experts=1,
        top_k=8,
        moe_hidden_dim=2048,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        load_balancing="bias",
    ),
    # Qwen3-30B-A3B class: 128 experts, top 8, no shared expert, every layer MoE
    "qwen3_30b_a3b": MoEModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151_936,
        n_dense_layers=0,
        n_routed_experts=128,
        n_shared_experts=0,
        top_k=8,
        moe_hidden_dim=768,
        score_func="softmax",
        route_norm=True,
        rope_theta=1_000_000.0,
        load_balancing="aux_loss",
    ),
}
