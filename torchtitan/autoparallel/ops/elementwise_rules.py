"""Sharding rules for elementwise ATen ops DTensor has none for (seen in real models).

DTensor registers its elementwise rules from the `pointwise` op tag plus a list; a few ops
that models produce are in neither: `softplus_backward` (Mamba-style gates, softplus
activations), `floor_divide` (expert and bucket indices), the functional `copy` (an in-place
`copy_` after functionalization), `lift_fresh_copy` (a constant the forward makes with
`torch.tensor(...)`).  Each is elementwise with broadcasting, so DTensor's own
elementwise rule (any dim split alike on every input, or all replicated) is registered for
them — with DTensor itself, so planning, the lowering (which runs on DTensors) and the
DTensor reference executor all use the same rule.  Imported for its side effect.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan.torch_private import register_single_dim_pointwise

_aten = torch.ops.aten

ELEMENTWISE_WITHOUT_RULES = (
    _aten.softplus_backward.default,
    _aten.floor_divide.default,
    _aten.floor_divide.Scalar,
    _aten.copy.default,
    _aten.lift_fresh_copy.default,
)


def _register() -> None:
    prop = DTensor._op_dispatcher.sharding_propagator
    for op in ELEMENTWISE_WITHOUT_RULES:
        if op not in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
            register_single_dim_pointwise(op)


_register()
