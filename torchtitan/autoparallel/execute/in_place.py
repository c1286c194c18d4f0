"""Eager graphs only: a sum is written into an operand that dies at it.

The lowered graphs are functional, so every `aten.add` writes a new tensor: where the
backward sums the gradient contributions of a value read several times, each partial sum
is one more tensor to allocate and write.  Autograd's engine, running a hand-written
module's backward, accumulates such gradients into the first one in place.
`accumulate_in_place` does the same to a graph that runs eagerly: `c = add(a, b)` becomes
`c = add_(a, b)` (or `add_(b, a)`) when nothing else can see the operand change:

* the operand's memory is made by this graph: at the root of its chain of views is an ATen
  op that returns new memory (not a graph input, a constant, or a collective's buffer);
* every node on that chain has this add as its only reader (so no other view of the memory
  exists, and the operand is neither saved nor returned);
* the sum has the operand's shape, dtype and strides (no broadcast into it, no promotion).

`reduce_in_place` does the same for a collective: `all_reduce(x)` (which copies `x` and
reduces the copy) becomes `all_reduce_(x)` when `x` is such an operand (and contiguous, as a
collective's buffer must be) — a bucket of gradients is reduced where it was packed, as
DDP reduces its bucket, rather than copied once more.

Inductor plans its own buffers from the functional graph (and reduces in place where it
can), so compiled graphs are left as they are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# returns a view of its input although its schema declares no alias
_UNANNOTATED_VIEWS = {aten._unsafe_view.default}


def accumulate_in_place(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s eligible `aten.add.Tensor` nodes to `aten.add_.Tensor`; how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor:
            continue
        if len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
            continue
        a, b = node.args
        order = [(a, b)] if node.kwargs.get("alpha", 1) != 1 else [(a, b), (b, a)]
        for into, other in order:
            if isinstance(into, fx.Node) and _writable_by(into, node):
                node.target = aten.add_.Tensor
                node.args = (into, other)
                rewritten += 1
                break
    if rewritten:
        gm.recompile()
    return rewritten


def reduce_in_place(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s all-reduces whose operand dies at them to `all_reduce_`; how many."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _c10d.all_reduce.default:
            continue
        operand = node.args[0]
        val = operand.meta.get("val") if isinstance(operand, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_contiguous() and _dies_at(operand, node):
            node.target = _c10d.all_reduce_.default
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _writable_by(operand: fx.Node, add: fx.Node) -> bool:
    """Whether `add` may write its result into `operand` (module docstring)."""
    want, have = add.meta.get("val"), operand.meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
        return False
    if (want.shape, want.dtype, want.stride()) != (have.shape, have.dtype, have.stride()):
        return False
    return _dies_at(operand, add)


def _dies_at(operand: fx.Node, reader: fx.Node) -> bool:
    """Whether `operand` is memory this graph made that nothing but `reader` can see: the
    chain of views from it up to the op that allocated it is read by nothing else."""
    node: fx.Node = operand
    while list(node.users) == [reader] and node.op == "call_function":
        if node.target is operator.getitem:
            parent, idx = node.args
            assert isinstance(parent, fx.Node) and isinstance(idx, int)
            others = [u for u in parent.users if u is not node and u.args[1] == idx]
            return not others and _fresh(parent.target, idx)
        if _fresh(node.target, 0):
            return True
        base = node.args[0] if node.args else None
        if not _is_view(node.target) or not isinstance(base, fx.Node):
            return False
        node, reader = base, node
    return False  # read elsewhere too, or a graph input or constant


def _fresh(target, idx: int) -> bool:
    """Whether return `idx` of ATen op `target` is new memory."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if target in _UNANNOTATED_VIEWS:
        return False
    returns = target._schema.returns
    return idx < len(returns) and returns[idx].alias_info is None


def _is_view(target) -> bool:
    """Whether `target` returns a view of its first argument."""
    if target in _UNANNOTATED_VIEWS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return (
        len(schema.returns) == 1
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
        and bool(schema.arguments)
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.before_set == schema.returns[0].alias_info.before_set
    )
