"""Activation recomputation: which forward values a block keeps for its backward.

A *policy* is chosen per repeated block (repeat.py labels every node with its block):

* `"none"`: the backward reads whatever forward values it needs; they stay alive from the
  forward until their last backward use.
* `"full"`: the block keeps nothing of its own.  Its backward recomputes the block's forward
  from the values it reads from outside the block (the previous block's output, parameters),
  communication included.
* `"selective"`: the block keeps the outputs of its matrix products and attention (the
  expensive ops) and recomputes everything else (norms, activations, casts, views,
  redistributions) from them.

A block is what its module's forward computes (the label `trace.py` attaches inside the
block module, `block_label`): the residual adds inside it, not the glue between blocks, the
mixed-precision casts of its parameters or the head and loss after the last block.

The rule, applied alike to the planner's joint graph (memory.py, the solver) and to the lowered
local graph (lower.py, what runs): walk back from the forward values the backward reads; a
value read by a backward node of block b is recomputed when it was made in block b and b's
policy may recompute its op, and then its own inputs are read in its place, again on behalf of
block b.  Anything else is saved: values of other blocks (a block boundary is a checkpoint),
values outside every block, graph inputs and parameters.  A value saved for one reader is
never also recomputed for another.  Values computed from parameters and buffers alone (a
gathered weight, its cast and transpose) follow no policy: they are kept or gathered again
as the unit's re-gather decision says (regather.py), for any reader (`recompute_rule`).

Compiled graphs go one step further (`recompute_fusible`, lower.py only): a saved value that
fusible ops make from values the backward has anyway is recomputed.  The planner's memory
model does not count this, so its prediction for a compiled run is an upper bound.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from torchtitan.recompute_ops import KEPT_BY_SELECTIVE

from ..errors import PlannerError
from ..ops import attention  # noqa: F401  (registers titan::sdpa)
from ..trace.repeat import LABEL_KEY, MIN_BLOCKS, RepeatedBlocks

POLICIES = ("none", "selective", "full")

# the selective ops, and our attention op (ops/attention.py), which stands for them
_KEPT_BY_SELECTIVE = KEPT_BY_SELECTIVE | {torch.ops.titan.sdpa.default}


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise PlannerError(
            f"unknown activation recompute policy {policy!r}; use one of {', '.join(POLICIES)}"
        )
    return policy


def block_label(node: fx.Node) -> str | None:
    """The repeated block whose module computed `node` (forward, or the backward derived
    from it); None outside every block."""
    return (node.meta.get("custom") or {}).get(LABEL_KEY)


def labelled_blocks(nodes: Iterable[fx.Node]) -> list[str]:
    """The block labels among `nodes`, sorted."""
    return sorted({lab for n in nodes if (lab := block_label(n)) is not None})


def block_of(node: fx.Node) -> str:
    """The block of a node known to be in one (a recomputed value)."""
    lab = block_label(node)
    assert lab is not None, f"{node.name} is in no repeated block"
    return lab


def kept_by_selective(node: fx.Node) -> bool:
    """The selective policy keeps this node's value: a matrix product or attention, or one
    output of one (a tuple's element is kept with the op that made it)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.target in _KEPT_BY_SELECTIVE


def may_recompute(node: fx.Node, policy: str | None) -> bool:
    """Whether `policy` recomputes `node` in its block's backward (op-wise, module doc)."""
    if node.op != "call_function" or policy in (None, "none"):
        return False
    return policy == "full" or not kept_by_selective(node)


Needed = Iterable[tuple[fx.Node, str | None]]


def split_saved(
    needed: Needed,
    recompute_for: Callable[[fx.Node, str | None], bool],
) -> tuple[list[fx.Node], dict[fx.Node, str | None]]:
    """(saved values, recomputed node -> block it is recomputed for).

    `needed`: (forward value, label of the backward node that reads it, None for a reader in
    no block or a graph output).  `recompute_for(value, reader)`: may the backward of block
    `reader` recompute `value` (see the module docstring)?  Saved values come in no particular
    order."""
    needed = list(needed)
    forced: set[fx.Node] = set()
    while True:
        saved: dict[fx.Node, bool] = {}
        recomputed: dict[fx.Node, str | None] = {}
        seen: set = set()
        stack = list(needed)
        while stack:
            node, reader = stack.pop()
            if (node, reader) in seen:
                continue
            seen.add((node, reader))
            if node not in forced and recompute_for(node, reader):
                recomputed[node] = reader
                stack.extend((a, reader) for a in node.all_input_nodes)
            else:
                saved[node] = True
        clash = saved.keys() & recomputed.keys()
        if not clash:
            return list(saved), recomputed
        forced |= clash


# not tagged pointwise, and as cheap to make again in a fused kernel: a reshape, a cast
_CHEAP_COPIES = {torch.ops.aten._unsafe_view.default, torch.ops.aten._to_copy.default}


def fusible(node: fx.Node) -> bool:
    """A pointwise op, a view or a cast: made again inside the kernel that reads it once
    compiled, for no extra memory traffic.  Random ops are not (the draw would differ)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if op.namespace not in ("aten", "prims") or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    is_view = any(r.alias_info is not None for r in op._schema.returns)
    return torch.Tag.pointwise in op.tags or is_view or op in _CHEAP_COPIES


def recompute_fusible(
    nodes: Sequence[fx.Node],
    saved: list[fx.Node],
    recomputed: dict[fx.Node, str | None],
    exempt: set[fx.Node],
) -> tuple[list[fx.Node], dict[fx.Node, str | None]]:
    """`split_saved`'s answer with every saved value that fusible ops make from values the
    backward has anyway (saved or recomputed) recomputed instead, as AOTAutograd's min-cut
    partitioner does for compiled graphs: a norm's normalised input, an activation, the gated
    product of a SwiGLU.  Only saved values leave; none is added, so the saved bytes only
    shrink.  `exempt` (a forward output, a value of parameters alone that the re-gather
    decision owns) stays saved.  `nodes`: the graph's nodes in topological order."""
    have = set(saved) | set(recomputed)
    makeable: set[fx.Node] = set()
    for n in nodes:
        if n not in exempt and fusible(n):
            if all(a in have or a in makeable for a in n.all_input_nodes):
                makeable.add(n)
    moved = [s for s in saved if s in makeable]
    if not moved:
        return saved, recomputed
    recomputed = dict(recomputed)
    stack = list(moved)
    while stack:  # the moved values and what they are made from that the backward lacks
        n = stack.pop()
        if n not in recomputed:
            recomputed[n] = block_label(n)
            stack.extend(a for a in n.all_input_nodes if a not in have)
    return [s for s in saved if s not in makeable], recomputed


def backward_schedule(
    nodes: list[fx.Node],
    backward: set,
    tangents: Sequence[fx.Node],
    lazy: set,
    done: set,
    outputs: Sequence[fx.Node],
) -> list[fx.Node]:
    """The order the executor runs the backward in (lower.py; liveness.py replays it): the ops
    reading a tangent, in graph order (`nodes`), each preceded by the `lazy` nodes (recomputed
    values, backward ops that need no tangent) it is the first to need; then what `outputs`
    (the gradients) still need.  Lazy nodes nothing needs are left out: run last, a dead
    `getitem` of a split would keep the split's base alive all backward long.  Nodes in
    `done` are not emitted (already placed)."""
    on_tangent = set(tangents)
    for n in nodes:
        if n in backward and any(a in on_tangent for a in n.all_input_nodes):
            on_tangent.add(n)
    order = {n: i for i, n in enumerate(nodes)}
    done = set(done)
    out: list[fx.Node] = []

    def emit(n: fx.Node) -> None:
        pending, stack = [], [n]
        while stack:
            a = stack.pop()
            if a in done or a.op == "placeholder":
                continue
            done.add(a)
            pending.append(a)
            stack.extend(b for b in a.all_input_nodes if b in lazy and b not in on_tangent)
        out.extend(sorted(pending, key=order.__getitem__))

    for n in nodes:
        if n in on_tangent and n.op != "placeholder":
            emit(n)
    for n in outputs:
        if isinstance(n, fx.Node) and n in lazy:
            emit(n)
    return out


def block_recompute(policies: dict[str, str] | str) -> Callable[[fx.Node, str | None], bool]:
    """`recompute_for` of `split_saved` for per-block `policies` (block label -> policy, or
    one policy for every block)."""

    def recompute_for(node: fx.Node, reader: str | None) -> bool:
        lab = block_label(node)
        if reader is None or lab != reader:
            return False
        return may_recompute(node, policies if isinstance(policies, str) else policies.get(lab))

    return recompute_for


def recompute_rule(
    policies: dict[str, str] | str, param_side: set[fx.Node], regathered: Callable[[fx.Node], bool]
) -> Callable[[fx.Node, str | None], bool]:
    """`recompute_for` of `split_saved` (module docstring): a value of `param_side` (computed
    from parameters and buffers alone) is made again when `regathered` says so, for any
    reader; any other value as its block's policy says."""
    in_block = block_recompute(policies)

    def recompute_for(node: fx.Node, reader: str | None) -> bool:
        if node in param_side:
            return regathered(node)
        return in_block(node, reader)

    return recompute_for


def describe_policies(policies: dict[str, str]) -> str:
    """`layers#0-2 full, layers#3 none`: runs of consecutive blocks with one policy."""

    def key(label: str) -> tuple[str, int]:
        cname, _, i = label.rpartition("#")
        return (cname, int(i)) if i.isdigit() else (label, -1)

    runs: list[list] = []  # [container, first, last, policy]
    for label in sorted(policies, key=key):
        cname, i = key(label)
        p = policies[label]
        if runs and runs[-1][0] == cname and runs[-1][2] == i - 1 and runs[-1][3] == p:
            runs[-1][2] = i
        else:
            runs.append([cname, i, i, p])
    return ", ".join(
        f"{c}#{a}{'' if a == b else f'-{b}'} {p}" if a >= 0 else f"{c} {p}" for c, a, b, p in runs
    )


def check_setting(recompute: str | Mapping[str, str]) -> str | dict[str, str]:
    """A `recompute` setting checked: a policy name, "auto", or block label -> policy."""
    if isinstance(recompute, Mapping):
        return {str(b): check_policy(p) for b, p in recompute.items()}
    return recompute if recompute == "auto" else check_policy(recompute)


def block_classes(blocks: Sequence[RepeatedBlocks], shallow: bool) -> list[tuple[str, str]]:
    """(label of each block of the whole model, label of the traced block standing for it)."""
    out = []
    for b in blocks:
        for i in range(len(b.keys)):
            j = b.representative(i) if shallow else i
            out.append((f"{b.container}#{i}", f"{b.container}#{j}"))
    return out


def solver_setting(
    recompute: str | Mapping[str, str], blocks: Sequence[RepeatedBlocks], shallow: bool
) -> str | dict[str, dict[str, int]]:
    """The program's recompute setting (solve/recompute_choices.py) for one trace: a policy
    for every block, "auto", or per traced block how many of the blocks it stands for follow
    each policy."""
    if recompute in ("none", "auto") and not blocks:
        return "none"
    if not blocks:
        raise PlannerError(
            f"recompute={recompute!r} recomputes repeated blocks, and the model has "
            f"no stack of {MIN_BLOCKS} or more identical blocks (or "
            "share_repeated=False); use recompute='none'"
        )
    if isinstance(recompute, str):
        return recompute
    classes = block_classes(blocks, shallow)
    known = {lab for lab, _cls in classes}
    unknown = sorted(set(recompute) - known)
    if unknown:
        raise PlannerError(
            f"recompute names block {unknown[0]!r}, which the model does not have; its "
            f"blocks are {sorted(known)[0]} ... {sorted(known)[-1]}"
        )
    counts: dict[str, dict[str, int]] = {}
    for lab, cls in classes:
        p = recompute.get(lab, "none")
        counts.setdefault(cls, {}).setdefault(p, 0)
        counts[cls][p] += 1
    return counts


def whole_model_policies(
    recompute: str | Mapping[str, str],
    counts: dict[str, dict[str, int]],
    blocks: Sequence[RepeatedBlocks],
    shallow: bool,
) -> dict[str, str]:
    """Each block's policy in the whole model, for the solver's per traced block `counts`
    (a pinned dict is returned as given)."""
    if not counts:
        return {}
    classes = block_classes(blocks, shallow)
    if isinstance(recompute, Mapping):
        return {lab: recompute.get(lab, "none") for lab, _cls in classes}
    return {lab: next(iter(counts[cls])) for lab, cls in classes}
