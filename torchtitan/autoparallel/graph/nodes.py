"""What a node of a traced graph is: the small questions every planner stage asks.

A leaf module (torch only), so that tracing, strategies, block labelling, plan expansion
and the runner can share these without importing each other.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import cast

import torch
import torch.fx as fx

from torchtitan.torch_private import TensorMeta


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def arg_node(node: fx.Node, i: int = 0) -> fx.Node:
    """Argument `i` of `node` where the op takes a tensor there (a getitem's source, a
    view's base, a collective's input): a graph node."""
    return cast(fx.Node, node.args[i])


def getitem_source(node: fx.Node) -> tuple[fx.Node, int]:
    """(the tuple-valued node, the index) a getitem reads."""
    return cast(fx.Node, node.args[0]), cast(int, node.args[1])


def is_view(node: fx.Node) -> bool:
    """An ATen view of its first argument (shares its storage)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
    )


def param_side(nodes: Iterable[fx.Node], param_inputs: set[fx.Node]) -> set[fx.Node]:
    """Nodes (of `nodes`, in a topological order) computed from `param_inputs` (parameter and
    buffer placeholders) alone."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op == "call_function" and all(
            a in out or a in param_inputs for a in n.all_input_nodes
        ):
            out.add(n)
    return out


def tensor_meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def out_metas(node: fx.Node) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    """The node's output shape/stride/dtype: one, a tuple (None for non-tensor items), or
    None when it outputs no tensor."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return tensor_meta(v)
    if isinstance(v, (list, tuple)):
        return tuple(tensor_meta(x) if isinstance(x, torch.Tensor) else None for x in v)
    return None


def is_placed(node: fx.Node) -> bool:
    """Nodes the solver places (plan entries): tensor-valued call_functions, no getitem."""
    return node.op == "call_function" and not is_getitem(node) and out_metas(node) is not None
