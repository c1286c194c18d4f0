"""DeepSeek-V3's aux-loss-free load balancing: the optimizer step of the expert biases.

After every optimizer step each router's `expert_bias` moves by `bias_update_rate` against
the sign of its load signal (model.py `_LoadSignal`: positive when an expert took more than
its share of the step's tokens), i.e. `b_e += rate * sign(mean load - load_e)`.  The biases
are left out of AdamW (no moments, no weight decay) and their gradients cleared here.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.models.deepseek_v3.model import Router


def _biased_routers(model_parts: list[nn.Module]) -> list[Router]:
    return [
        m for part in model_parts for m in part.modules() if isinstance(m, Router) and m.use_bias
    ]


@torch.no_grad()
def update_expert_biases(routers: list[Router]) -> None:
    for router in routers:
        bias = router.expert_bias
        if bias.grad is not None:
            bias.sub_(router.bias_update_rate * torch.sign(bias.grad))
            bias.grad = None


def build_moe_optimizers(
    model_parts: list[nn.Module], job_config: JobConfig
) -> OptimizersContainer:
    """AdamW (or `[optimizer]`'s choice) for every parameter but the expert biases, which
    `update_expert_biases` steps after it."""
    routers = _biased_routers(model_parts)
    biases = {id(r.expert_bias) for r in routers}
    container = build_optimizers(model_parts, job_config, skip=lambda p: id(p) in biases)
    container.after_step(lambda: update_expert_biases(routers))
    return container
