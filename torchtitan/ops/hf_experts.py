"""transformers' mixture-of-experts modules through `titan.routed_experts`.

transformers (5.x) dispatches the forward of every experts module decorated with
`use_experts_implementation` (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, ...) through its
`ExpertsInterface`, chosen by `config._experts_implementation`.  `use_routed_experts(model)`
registers `titan_routed_experts` there and selects it for the model's experts modules: the
stacked `gate_up_proj` ([E, 2H, D], gate rows first) and `down_proj` ([E, D, H]) become the
op's w1 / w3 (two views) and w2, so the planner sees the experts as one op it can split
(tokens, hidden units, experts).  A module whose layout the op does not compute (biases,
transposed or interleaved weights, another gate or activation than SwiGLU, a norm after the
experts) keeps transformers' `grouped_mm` implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.ops.routed_experts import routed_experts

NAME = "titan_routed_experts"


def _computable(experts: nn.Module) -> bool:
    """The module is gate/up SwiGLU experts in the plain stacked layout."""
    from transformers.integrations.moe import _default_apply_gate

    return (
        getattr(experts, "has_gate", False)
        and not getattr(experts, "has_bias", True)
        and not getattr(experts, "is_transposed", True)
        and getattr(experts, "is_concatenated", False)
        and not getattr(experts, "has_post_expert_norm", True)
        and getattr(type(experts), "_apply_gate", None) is _default_apply_gate
        and getattr(getattr(experts, "config", None), "hidden_act", None) == "silu"
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


def routed_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An `ExpertsInterface` implementation: the module's experts as `titan.routed_experts`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if not _computable(self):
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)
    gate_up = self.gate_up_proj
    assert isinstance(gate_up, torch.Tensor)
    hidden = gate_up.shape[1] // 2
    out = routed_experts(
        hidden_states,
        top_k_weights,
        top_k_index.long(),
        gate_up[:, :hidden],
        self.down_proj,
        gate_up[:, hidden:],
    )
    return out.to(hidden_states.dtype)


def use_routed_experts(model: nn.Module) -> int:
    """Route the experts modules of `model` this op computes through it; returns how many."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, routed_experts_forward)
    routed = 0
    for module in model.modules():
        if _computable(module):
            setattr(module.config, "_experts_implementation", NAME)  # noqa: B010
            routed += 1
    return routed
