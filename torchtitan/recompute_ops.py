"""The ops whose outputs selective activation recompute keeps rather than recomputes:
matrix products and attention — expensive to recompute, cheap to hold.

A leaf like `torch_private`: the hand-written op-level AC (`distributed/activation_checkpoint`)
and the planner's "selective" policy (`autoparallel/policies/recompute`) both start from it.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten

KEPT_BY_SELECTIVE = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_mm.default,
        _aten.convolution.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
