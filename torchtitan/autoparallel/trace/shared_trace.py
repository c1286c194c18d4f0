"""The whole model's trace made by one rank of a job and loaded by the others.

Every rank applies the plan to the same joint graph — the trace of the model on
global-shaped fake inputs names no rank — and tracing a transformer costs each rank seconds of
CPU while rank 0 plans.  `traced_once` lets the first rank to ask trace, and publish the trace
in the job's store (graph_bytes.py: nodes, their traced values and annotations, the roles of
placeholders and outputs); the others wait for it and load it.  A rank that fails to trace
publishes that it failed, and the others trace for themselves, to raise the same error; so
does a trace that cannot be written (an object pickle cannot name).

The key is what the trace depends on: the model's modules (their classes and the plain
settings they hold: sizes, head counts, flags), its parameters and buffers (names, shapes,
dtypes), the inputs' shapes and dtypes, the parameter dtype, the repeated blocks, and how many
traces this process asked for before (ranks that make the same traces in the same order meet
under the same key; a rank whose model differs, a pipeline stage, traces its own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from torchtitan.torch_private import FakeTensorMode, pytree

from ..graph import graph_bytes
from ..graph.job_store import WAIT, job_store
from .joint import TracedGraph

log = logging.getLogger(__name__)

_PREFIX = "autoparallel/traced/"
_FAILED, _OWN = b"failed", b"own"
_METAS = ("val", "custom", "stack_trace")
_asked = 0  # whole-model traces this process asked for


def traced_once(
    model: nn.Module,
    input_fn: Callable[[], Any],
    param_dtype: torch.dtype | None,
    blocks: list,
    trace: Callable[[], TracedGraph],
) -> TracedGraph:
    """`trace()`, made by the first rank of the job that asks for it and loaded by the
    others; this rank's own without a store (graph/job_store.py)."""
    global _asked
    _asked += 1
    store = job_store()
    if store is None:
        return trace()
    key = _PREFIX + _key(model, input_fn, param_dtype, blocks, _asked)
    if store.add(f"{key}/claimed", 1) == 1:
        try:
            tg = trace()
        except BaseException:
            store.set(key, _FAILED)
            raise
        try:
            data = _dumps(tg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            store.set(key, _OWN)
            log.info("whole-model trace: not shared (%s); each rank traces its own", e)
            return tg
        store.set(key, data)
        log.info("whole-model trace: published for the other ranks (%d KiB)", len(data) >> 10)
        return tg
    store.wait([key], WAIT)
    data = store.get(key)
    if data in (_FAILED, _OWN):
        return trace()
    log.info("whole-model trace: loaded what another rank traced (%d KiB)", len(data) >> 10)
    return _loads(data)


def _key(model: nn.Module, input_fn: Callable[[], Any], param_dtype, blocks, asked: int) -> str:
    with FakeTensorMode():
        inputs = pytree.tree_leaves(input_fn())
    blob = {
        "torch": torch.__version__,
        "modules": [
            [name, f"{type(m).__module__}.{type(m).__qualname__}", _settings(m)]
            for name, m in model.named_modules()
        ],
        "tensors": [
            [name, list(t.shape), str(t.dtype), t.requires_grad]
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        ],
        "inputs": [[list(x.shape), str(x.dtype)] for x in inputs if isinstance(x, torch.Tensor)],
        "param_dtype": str(param_dtype),
        "blocks": [repr(b) for b in blocks],
        "asked": asked,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=repr).encode()).hexdigest()


def _settings(module: nn.Module) -> dict[str, str]:
    """The plain values a module holds (sizes, flags, a config's fields), as text; an object
    whose text would name its address is named by its class (two ranks' texts would differ
    anyway, so they would not share)."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
            continue
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a value that cannot show itself: its class
            text = " at 0x"
        out[name] = text if " at 0x" not in text else type(value).__qualname__
    return out


def _dumps(tg: TracedGraph) -> bytes:
    rest = {f.name: getattr(tg, f.name) for f in dataclasses.fields(tg) if f.name != "gm"}
    return graph_bytes.dumps(tg.gm, _METAS, rest)


def _loads(data: bytes) -> TracedGraph:
    gm, rest = graph_bytes.loads(data)
    return TracedGraph(gm=gm, **rest)
