"""The trace a plan is made on: shallow when the model repeats blocks (repeat.py), with the
whole model's trace made on first use (apply runs the plan on it).

Both are made on first use: a process that receives its plan from another one (a training
rank other than the planning one) never needs the planning trace, only the whole model's,
and in a job of several ranks one of them makes that one for all (shared_trace.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import PlannerError
from . import repeat
from .joint import TracedGraph, trace_joint
from .shared_trace import traced_once

log = logging.getLogger(__name__)


class PlanningTrace:
    """`tg`: the planning trace; `blocks`: the stacks planned from it (empty: `tg` is the
    whole model); `full`: the whole model's trace.  `seconds`: how long `tg` took."""

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any],
        param_dtype: torch.dtype | None,
        share_repeated: bool,
        block_containers: Sequence[str] = (),
    ):
        """`share_repeated` off: no shallow trace; `block_containers`:
        `repeat.find_repeated_blocks`'s `named`."""
        self._model, self._input_fn, self._param_dtype = model, input_fn, param_dtype
        self.blocks = repeat.find_repeated_blocks(model, block_containers) if share_repeated else []
        self._tg: TracedGraph | None = None
        self._full: TracedGraph | None = None
        self.seconds = 0.0
        self.full_seconds = 0.0  # the whole model's trace, when apart from the planning one

    @property
    def made(self) -> bool:
        """Whether the planning trace exists yet."""
        return self._tg is not None

    @property
    def tg(self) -> TracedGraph:
        """The planning trace, made on first use: shallow where the model repeats blocks; a
        forward that indexes its stack (`self.norms[3]`) cannot run on a shallow copy, so
        then the whole model is traced instead (and `blocks` becomes empty)."""
        return self.make()

    def make(self) -> TracedGraph:
        """The planning trace (`tg`), made now if it was not yet."""
        if self._tg is None:
            t = time.perf_counter()
            self._tg = self._shallow() if self.blocks else self.full
            self.seconds = time.perf_counter() - t
        return self._tg

    @property
    def full(self) -> TracedGraph:
        """The whole model's trace, made on first use (the planning trace itself when that
        is not shallow)."""
        if self._full is None:
            t = time.perf_counter()
            self._full = traced_once(
                self._model,
                self._input_fn,
                self._param_dtype,
                self.blocks,
                lambda: trace_joint(self._model, self._input_fn, self._param_dtype, self.blocks),
            )
            if self.blocks:
                self.full_seconds = time.perf_counter() - t
        return self._full

    def _shallow(self) -> TracedGraph:
        try:
            tg = trace_joint(
                self._model, self._input_fn, self._param_dtype, self.blocks, shallow=True
            )
        except PlannerError:
            raise
        except Exception as e:  # noqa: BLE001
            log.info("shallow trace failed (%s: %s); tracing the whole model", type(e).__name__, e)
            self.blocks = []
            self._full = trace_joint(self._model, self._input_fn, self._param_dtype)
            return self._full
        log.info(
            "repeated blocks: %s; traced the first, second and last of each",
            ", ".join(f"{b.container} x{len(b.keys)}" for b in self.blocks),
        )
        return tg

    def traced_name(self, fqn: str) -> str:
        """Name in the traced graph of the model's parameter or buffer `fqn`."""
        return repeat.reduced_fqn(fqn, self.blocks) if self.tg.shallow else fqn
