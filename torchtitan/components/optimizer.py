"""Optimizers for one or more model parts, behind one object the loop and checkpointer use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config.job_config import JobConfig

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


class OptimizersContainer(Stateful):
    """One optimizer per model part, stepped together.

    Its state dict is keyed by parameter name (via DCP's state-dict helpers), so a
    checkpoint saved under one parallelism loads under another.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type,
        kwargs: dict[str, Any],
        skip: Callable[[nn.Parameter], bool] | None = None,
    ):
        """`skip`: parameters this optimizer leaves to another update (`after_step`)."""
        self.model_parts = model_parts
        self.optimizers = [
            optimizer_cls(
                [p for p in part.parameters() if p.requires_grad and not (skip and skip(p))],
                **kwargs,
            )
            for part in model_parts
        ]
        self._after_step: list[Callable[[], None]] = []

    def after_step(self, fn: Callable[[], None]) -> None:
        """Run `fn` after every `step` (a model's own update of the parameters it skips)."""
        self._after_step.append(fn)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
        for fn in self._after_step:
            fn()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict[str, Any] = {}
        for part, optimizer in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, optimizer, options=options))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, optimizer, state_dict, options=options)


def build_optimizers(
    model_parts: list[nn.Module],
    job_config: JobConfig,
    skip: Callable[[nn.Parameter], bool] | None = None,
) -> OptimizersContainer:
    cfg = job_config.optimizer
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "foreach": cfg.implementation == "foreach",
        "fused": cfg.implementation == "fused",
    }
    return OptimizersContainer(model_parts, _OPTIMIZERS[cfg.name], kwargs, skip)
