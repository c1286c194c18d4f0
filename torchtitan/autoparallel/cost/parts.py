"""Predicted compute time of a model's parts: what a pipeline split balances.

The model is traced once (forward and backward, its repeated blocks shallow: each traced
block stands for those like it) and every op is priced by the cost model on one device,
nothing sharded.  An op counts for the part whose module ran it (the innermost module FQN
the trace recorded, backward ops included); sharding the stages alike later divides every
part's time alike, so the ratios are what matters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..trace import repeat
from ..trace.joint import MODULE_KEY, trace_joint
from .model import CostModel, Estimator, resolve_cost_model


def op_time_us(est: Estimator, node: fx.Node) -> float:
    """One device's predicted time of `node` (µs), its tensors whole."""
    args: list[fx.Node] = []
    fx.node.map_arg(node.args, args.append)
    in_vals = [a.meta["val"] for a in args if isinstance(a.meta.get("val"), torch.Tensor)]
    v = node.meta.get("val")
    out_vals = [x for x in (v if isinstance(v, (list, tuple)) else [v])]
    whole = [None] * max(len(in_vals), len(out_vals))
    return est.compute_us(node.target, in_vals, whole, out_vals, whole, node.args)


def part_times_us(
    model: nn.Module,
    input_fn: Callable[[], Any],
    parts: Mapping[str, tuple[str, ...]],
    default: str,
    cost_model: CostModel | str = "h100",
) -> dict[str, float]:
    """Predicted forward + backward time (µs, one device) of each part of the meta-device
    `model`: `parts` names the modules (FQNs) of each; an op run in none of them (the
    model's own glue, the backward's sums of gradients that AOTAutograd makes outside any
    module) counts for the part `default`."""
    blocks = repeat.find_repeated_blocks(model)
    tg = trace_joint(model, input_fn, blocks=blocks, shallow=bool(blocks))
    est = Estimator(resolve_cost_model(cost_model), (1,))
    root = type(model).__name__
    owner = {m: name for name, modules in parts.items() for m in modules}
    times = dict.fromkeys([*parts, default], 0.0)
    for node in tg.gm.graph.nodes:
        if node.op != "call_function":
            continue
        module = node.meta.get("custom", {}).get(MODULE_KEY, root)
        part = next((owner[m] for m in owner if module == m or module.startswith(m + ".")), default)
        times[part] += op_time_us(est, node) * tg.weight(node)
    return times
