"""Activation checkpointing of transformer blocks: none, full, every Nth block, or op-level.

Works on any model whose blocks live in `model.layers` (a ModuleDict), wrapping each
chosen block in place so parameter names are unchanged apart from the wrapper prefix.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.errors import UserInputError
from torchtitan.recompute_ops import KEPT_BY_SELECTIVE
from torchtitan.tools.logging import logger
from torchtitan.torch_private import checkpoint_wrapper

_aten = torch.ops.aten

# Outputs worth keeping in op-level AC: the selective ops, and (as torchtitan does) the
# reduce-scatters of sequence parallelism, which would otherwise run again.
_SAVE_LIST = KEPT_BY_SELECTIVE | {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _op_level_policy() -> tuple[AbstractContextManager, AbstractContextManager]:
    """Save the listed ops' outputs, except every second matmul (recomputing half of them
    trades a little compute for a lot of memory: the FFN's up-projection outputs)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == _aten.mm.default:
            counts[phase] += 1
        keep = func in _SAVE_LIST and not (func == _aten.mm.default and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrap(block: nn.Module, op_level: bool) -> nn.Module:
    if op_level:
        return checkpoint_wrapper(block, context_fn=_op_level_policy, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_ac(model: nn.Module, ac_config: ActivationCheckpoint) -> None:
    mode, option = ac_config.mode, ac_config.selective_ac_option
    if mode == "full":
        every, op_level = 1, False
    elif option == "op":
        every, op_level = 1, True
    elif option.isdigit() and int(option) >= 1:
        every, op_level = int(option), False
    else:
        raise UserInputError(
            f"--activation_checkpoint.selective_ac_option {option!r}: use 'op' or a positive "
            "integer N (checkpoint every Nth block)"
        )
    layers = cast(nn.ModuleDict, model.layers)  # the blocks, by the contract above
    for i, (name, block) in enumerate(list(layers.items())):
        if i % every == 0:
            layers.register_module(name, _wrap(block, op_level))
    logger.info(
        f"applied {mode} activation checkpointing"
        + (
            f" ({'op-level' if op_level else f'every {every} block(s)'})"
            if mode == "selective"
            else ""
        )
    )
