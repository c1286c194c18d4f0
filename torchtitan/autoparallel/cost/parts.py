"""Predicted cost of a model's parts: what a pipeline split balances.

The model is traced once (forward and backward, its repeated blocks shallow: each traced
block stands for those like it) and every op is priced by the cost model on one device,
nothing sharded.  An op counts for the part whose module ran it (the innermost module FQN
the trace recorded, backward ops included); sharding the stages alike later divides every
part's time alike, so the ratios are what matters.

Each part's memory is given too: its training state (parameters, their gradients and
AdamW's two states) and the bytes its forward saves for backward per input (a forward value
a backward op reads, counted once per storage, with no recompute) — what a stage holding
the part keeps once, and once per microbatch in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph.nodes import is_view
from ..trace import repeat
from ..trace.joint import MODULE_KEY, TracedGraph, trace_joint
from .memory import ADAMW_BYTES_PER_ELEM
from .model import CostModel, Estimator, resolve_cost_model


@dataclass(frozen=True)
class PartCost:
    """One part of a model on one device, nothing sharded."""

    time_us: float  # forward + backward
    state_bytes: float = 0.0  # parameters, gradients, optimizer state
    saved_bytes: float = 0.0  # saved for backward, per input traced


def op_time_us(est: Estimator, node: fx.Node) -> float:
    """One device's predicted time of `node` (µs), its tensors whole."""
    args: list[fx.Node] = []
    fx.node.map_arg(node.args, args.append)
    in_vals = [a.meta["val"] for a in args if isinstance(a.meta.get("val"), torch.Tensor)]
    v = node.meta.get("val")
    out_vals = [x for x in (v if isinstance(v, (list, tuple)) else [v])]
    whole = [None] * max(len(in_vals), len(out_vals))
    return est.compute_us(node.target, in_vals, whole, out_vals, whole, node.args)


def part_costs(
    model: nn.Module,
    input_fn: Callable[[], Any],
    parts: Mapping[str, tuple[str, ...]],
    default: str,
    cost_model: CostModel | str = "h100",
    param_dtype: torch.dtype | None = None,
) -> dict[str, PartCost]:
    """Predicted cost (one device) of each part of the meta-device `model`, its parameters
    cast to `param_dtype` for compute: `parts` names the modules (FQNs) of each; an op run
    in none of them (the model's own glue, the backward's sums of gradients that
    AOTAutograd makes outside any module) counts for the part `default`."""
    blocks = repeat.find_repeated_blocks(model)
    tg = trace_joint(model, input_fn, param_dtype=param_dtype, blocks=blocks, shallow=bool(blocks))
    est = Estimator(resolve_cost_model(cost_model), (1,))
    owner = {m: name for name, modules in parts.items() for m in modules}
    root = type(model).__name__

    def part_of(fqn: str) -> str:
        return next((owner[m] for m in owner if fqn == m or fqn.startswith(m + ".")), default)

    def part_of_node(node: fx.Node) -> str:
        return part_of(node.meta.get("custom", {}).get(MODULE_KEY, root))

    times = dict.fromkeys([*parts, default], 0.0)
    for node in tg.gm.graph.nodes:
        if node.op == "call_function":
            times[part_of_node(node)] += op_time_us(est, node) * tg.weight(node)
    state = dict.fromkeys(times, 0.0)
    for fqn, p in model.named_parameters():
        state[part_of(fqn)] += p.numel() * (2 * p.element_size() + ADAMW_BYTES_PER_ELEM)
    saved = dict.fromkeys(times, 0.0)
    for node, nbytes in _saved_bases(tg).items():
        saved[part_of_node(node)] += nbytes * tg.weight(node)
    return {name: PartCost(times[name], state[name], saved[name]) for name in times}


def _saved_bases(tg: TracedGraph) -> dict[fx.Node, float]:
    """The forward ops whose value (or a view of it) a backward op reads: their bytes."""
    bases: dict[fx.Node, float] = {}
    for node in tg.forward_nodes:
        backward = [u for u in node.users if u not in tg.forward_nodes and u.op != "output"]
        if node.op != "call_function" or not backward:
            continue
        while is_view(node):
            parent = node.args[0]
            if not isinstance(parent, fx.Node) or parent not in tg.forward_nodes:
                break
            node = parent
        val = tg.tensor_val(node)
        if node.op == "call_function" and val is not None:
            bases[node] = float(val.numel() * val.element_size())
    return bases
