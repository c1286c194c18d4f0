"""The trace a plan is made on: shallow when the model repeats blocks (repeat.py), with the
whole model's trace made on first use (apply runs the plan on it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import PlannerError
from . import repeat
from .joint import TracedGraph, trace_joint

log = logging.getLogger(__name__)


@dataclass
class PlanningTrace:
    """`tg`: the planning trace; `blocks`: the stacks planned from it (empty: `tg` is the
    whole model); `full`: the whole model's trace once made."""

    tg: TracedGraph
    blocks: list[repeat.RepeatedBlocks]
    full: TracedGraph | None = None

    @classmethod
    def of(
        cls,
        model: nn.Module,
        input_fn: Callable[[], Any],
        param_dtype: torch.dtype | None,
        share_repeated: bool,
        block_containers: Sequence[str] = (),
    ) -> PlanningTrace:
        """Trace `model` shallow where it repeats blocks (unless `share_repeated` is off;
        `block_containers`: `repeat.find_repeated_blocks`'s `named`); a forward that indexes
        its stack (`self.norms[3]`) cannot run on a shallow copy, so then the whole model is
        traced instead."""
        blocks = repeat.find_repeated_blocks(model, block_containers) if share_repeated else []
        if not blocks:
            tg = trace_joint(model, input_fn, param_dtype)
            return cls(tg, [], full=tg)
        try:
            tg = trace_joint(model, input_fn, param_dtype, blocks, shallow=True)
        except PlannerError:
            raise
        except Exception as e:  # noqa: BLE001
            log.info("shallow trace failed (%s: %s); tracing the whole model", type(e).__name__, e)
            tg = trace_joint(model, input_fn, param_dtype)
            return cls(tg, [], full=tg)
        log.info(
            "repeated blocks: %s; traced the first, second and last of each",
            ", ".join(f"{b.container} x{len(b.keys)}" for b in blocks),
        )
        return cls(tg, blocks)

    def traced_name(self, fqn: str) -> str:
        """Name in the traced graph of the model's parameter or buffer `fqn`."""
        return repeat.reduced_fqn(fqn, self.blocks) if self.tg.shallow else fqn
