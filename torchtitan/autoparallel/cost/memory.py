"""Per-rank memory model: parameters, gradients, optimizer state and activations, at the
moments of the step where memory peaks.

Static bytes per rank = sum over parameters of local bytes + local numel x
`optim_bytes_per_elem` (AdamW: two fp32 states = 8 bytes), alive all step long.  A reduced
gradient (local bytes of its parameter) exists from its unit's reduction on: none at the
forward/backward boundary (the trainer frees them after each step), those of the blocks the
backward has finished in a block's row, all of them in the rest of the backward (an upper
bound, `_reduced_by`).  Activations come and go; liveness.py replays the executor's order
(forward, then the backward with each block's recomputation just before its first use, every
value freed after its last use, an unreduced gradient kept until its unit's reduction, the
outputs' gradients held by the caller's autograd all backward long) and names the candidate
peaks: the forward/backward boundary, where every saved value, the outputs and their
gradients are alive, and the busiest moment of each block's backward (and of the rest of the
backward: head, loss), where the values saved by the blocks not yet reached are alive
together with that block's gradients and recomputed values.  A block's backward also holds
the copies it gathers of its parameters (`gather_terms`): redistributions of kept chain
values into the backward, and, for a unit that gathers again, the gathered parameters, twice
(the executor gathers the next unit's one unit ahead; a stack's blocks are taken to be alike).

Each candidate is one *row*: static + reduced gradients + saved values alive then +
transient values (unreduced gradients, recomputed values, gathered copies) alive then, each
at its local size under the chosen strategy, so linear in the plan.  The predicted peak is
the largest row; a memory budget bounds every row.  A saved value counts as its base (views
share storage).  When the plan redistributes a tensor on its way into a saved view (the
transpose of an all-gathered weight), the view keeps that copy alive: a "copy" term on the
edge, in the placement the view receives.

*Keep or gather again* (regather.py).  A unit that keeps its gathered parameters holds their
chain's values (cast, transpose, gathered copies: the copy on an edge into a saved view, and
the redistribution on every edge from a saved chain value into the backward, which the
runner makes once per value and placement and so shares with the forward's) from the
forward until that unit's backward: in the rows at the boundary, of the backward outside
the blocks, and of the unit's own block and those after it in model order (the backward
reaches them first).  A unit that gathers again makes them in the backward, transient around
their use.  For parameters the solver decides, the row holds both sides, each conditional
on the decision (`RowEntry.param`): the kept values from the replay in which they are kept,
the made-again ones from the replay in which they are made again, at the same moment.
The redistribution into the backward counted as kept is an upper bound when the forward
read that value in another placement (then the backward makes it, transient).

*Policies.*  Under per-block recompute policies (recompute.py) each block's saved values are
those of its own policy, and a block's backward row carries its transient values for the
policy it follows.  In a shallow trace (repeat.py) a traced block stands for several: its
saved values count once per block it stands for that follows the policy (`counts`), its
transient values once (one block at a time).  Rows are found per policy with every block
following it; values of no block (the embedding, the head) are taken from that replay.

The loss is outside the model's graph: at the boundary it is taken to hold
`LOSS_OUTPUT_COPIES` output-sized tensors (cross-entropy's log-softmax, and the softmax its
backward makes).  Not counted: temporaries inside one op and the buffers of a reduction.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..graph import placements as P
from ..graph.nodes import is_view
from ..policies.recompute import block_label, labelled_blocks, recompute_rule, split_saved
from ..policies.regather import NO_REGATHER, Regather
from ..strategies.table import StrategyTable, resolve_source
from ..trace.joint import TracedGraph
from .liveness import BOUNDARY, backward_reads, parameter_valued, snapshots

ADAMW_BYTES_PER_ELEM = 8  # exp_avg + exp_avg_sq in fp32
# What the caller's loss holds at the backward's start, in copies of the outputs it reads:
# cross-entropy keeps its log-softmax and makes the softmax on its way to the logits'
# gradient (which the boundary already counts, as the tangent).
LOSS_OUTPUT_COPIES = 2


@dataclass
class MemoryTerm:
    node: fx.Node  # strategy node whose choice decides the local size
    idx: int  # output index of that node
    full_bytes: float  # bytes of the global tensor, times the per-element multiplier
    kind: str  # "param" | "activation" | "copy"
    arg: int | None = None  # "copy": the view's input (index into its sources) whose copy is held

    @property
    def key(self) -> tuple:
        return (self.kind, self.node, self.idx, self.arg)

    @property
    def copied_input(self) -> int:
        """A copy term's input: the index into its node's sources."""
        assert self.arg is not None, "not a copy term"
        return self.arg

    @property
    def block(self) -> str | None:
        """The block whose policy decides this term (None: no block's alone)."""
        return block_label(self.node)


@dataclass(frozen=True)
class RowEntry:
    """One term of a memory row and how many times it counts.

    `block` None: `weight` times.  Else the term belongs to `block` under `policy`: a saved
    value counts once per block `block` stands for that follows `policy`, a transient one
    (`saved=False`: a gradient or recomputed value) once if any of them does."""

    term: MemoryTerm
    weight: int = 1
    block: str | None = None
    policy: str | None = None
    saved: bool = True
    # a parameter the solver decides to keep or gather again: the entry counts only when it
    # is gathered again (`regathered`) or only when it is kept
    param: str | None = None
    regathered: bool = False

    def multiplier(
        self, counts: dict[str, dict[str, int]], regathered: frozenset[str] = frozenset()
    ) -> int:
        if self.param is not None and (self.param in regathered) != self.regathered:
            return 0
        if self.block is None:
            return self.weight
        assert self.policy is not None  # set with `block`
        k = counts.get(self.block, {}).get(self.policy, 0)
        return k if self.saved else int(k > 0)


@dataclass
class MemoryRow:
    where: str | None  # liveness.BOUNDARY, a block label, None: the backward outside blocks
    policy: str  # the policy every block followed in the replay this row comes from
    entries: list[RowEntry]


def _base(src):
    node, idx = src
    while is_view(node):
        node, idx = resolve_source(node.args[0])
    return node, idx


def _saved(tg: TracedGraph, policy: str) -> tuple[list, list[fx.Node]]:
    """(node, output index) of every saved forward tensor when every block follows `policy`,
    and the nodes the blocks recompute, in graph order (the program's columns are made in
    this order: an order that followed node hashes, i.e. addresses, would make the same
    program differ from one run to the next)."""
    rule = recompute_rule(policy, parameter_valued(tg), lambda n: False)
    saved, recomputed = split_saved(backward_reads(tg), rule)
    return list(dict.fromkeys(resolve_source(n) for n in saved)), [
        n for n in tg.gm.graph.nodes if n in recomputed
    ]


def saved_view_inputs(
    tg: TracedGraph, table: StrategyTable, policy: str = "none"
) -> list[tuple[fx.Node, int]]:
    """(view node, source index) of every edge into a view on a saved tensor's chain to its
    base: a redistribution there makes the copy the saved view keeps alive."""
    edges: dict = {}
    for node, _idx in _saved(tg, policy)[0]:
        while is_view(node) and node in table.nodes:
            ns = table.nodes[node]
            if not ns.sources:
                break
            edges[(node, 0)] = True
            node = ns.sources[0][0]
    return list(edges)


def kept_gather_inputs(
    tg: TracedGraph, table: StrategyTable, chain: dict[fx.Node, str], policy: str = "none"
) -> list[tuple[fx.Node, int]]:
    """(backward node, source index) of every edge from a saved value of a parameter's
    chain into the backward: kept, the redistribution there is the forward's own."""
    out = []
    for node, idx in _saved(tg, policy)[0]:
        if node not in chain:
            continue
        for user in node.users:
            ns = table.nodes.get(user)
            if ns is None or user in tg.forward_nodes:
                continue
            out += [(user, k) for k, src in enumerate(ns.sources) if src == (node, idx)]
    return out


def param_chains(tg: TracedGraph, table: StrategyTable) -> dict[fx.Node, str]:
    """Nodes on a parameter's single-input chain (the parameter, its cast, transpose, views)
    -> the parameter's FQN."""
    owner: dict[fx.Node, str] = {}
    for fqn, pnode in tg.params.items():
        frontier = [pnode]
        while frontier:
            n = frontier.pop()
            owner[n] = fqn
            for u in n.users:
                ns = table.nodes.get(u)
                if ns is not None and len(ns.sources) == 1 and u not in owner:
                    frontier.append(u)
    return owner


def chain_up(table: StrategyTable, start: fx.Node) -> list[fx.Node]:
    """`start` and the producers above it while each has exactly one input (a gradient's
    cast, transpose, views back to the op that made it)."""
    chain, node = [], start
    while node in table.nodes and len(table.nodes[node].sources) == 1 and node not in chain:
        chain.append(node)
        node = table.nodes[node].sources[0][0]
    return chain


def param_terms(tg: TracedGraph, optim_bytes_per_elem: int) -> list[MemoryTerm]:
    """Parameter + optimizer state of every parameter (static, all step long)."""
    terms = []
    for pnode in tg.params.values():
        v = pnode.meta["val"]
        per_elem = v.element_size() + optim_bytes_per_elem
        terms.append(MemoryTerm(pnode, 0, float(v.numel() * per_elem), "param"))
    return terms


def grad_terms(
    tg: TracedGraph, table: StrategyTable, chain: dict[fx.Node, str]
) -> list[tuple[MemoryTerm, str | None]]:
    """The reduced gradient of every parameter, in the parameter's placement, with the block
    that uses the parameter (None: outside every block; `chain`: `param_chains`)."""
    block: dict[str, str | None] = {}
    for node, fqn in chain.items():
        for user in node.users:
            if block.get(fqn) is None and user in table.nodes:
                block[fqn] = block_label(user)
    terms = []
    for fqn, pnode in tg.params.items():
        v = pnode.meta["val"]
        term = MemoryTerm(pnode, 0, float(v.numel() * v.element_size()), "grad")
        terms.append((term, block.get(fqn)))
    return terms


def copy_terms(
    tg: TracedGraph, table: StrategyTable, policy: str, regathered: frozenset[str]
) -> list[tuple[MemoryTerm, str | None]]:
    """The redistributed copies saved values keep alive (module docstring), each with the
    parameter whose chain it belongs to (None: an activation's), none of the parameters in
    `regathered`."""
    chain = param_chains(tg, table)
    out = []
    edges = saved_view_inputs(tg, table, policy) + kept_gather_inputs(tg, table, chain, policy)
    for node, k in dict.fromkeys(edges):
        src = table.nodes[node].sources[k]
        fqn = chain.get(src[0]) if src[0] in chain else chain.get(node)
        if fqn in regathered:
            continue
        v = _source_value(src)
        term = MemoryTerm(node, 0, float(v.numel() * v.element_size()), "copy", arg=k)
        out.append((term, fqn))
    return out


def gather_terms(
    tg: TracedGraph, table: StrategyTable, chain: dict[fx.Node, str]
) -> list[tuple[MemoryTerm, str, bool]]:
    """The copies a block's backward makes of its parameters: on each edge from a parameter
    into its chain (the gather of an FSDP-sharded weight, made again by a unit that gathers
    again) and on each edge from a chain value into the backward (made whether the unit keeps
    or gathers again), with the parameter's FQN and whether the edge leaves the parameter."""
    out = []
    for node, fqn in chain.items():
        for user in node.users:
            ns = table.nodes.get(user)
            from_param = node.op == "placeholder"
            if ns is None or not (from_param or user not in tg.forward_nodes):
                continue
            for k, src in enumerate(ns.sources):
                if src[0] is node:
                    v = _source_value(src)
                    term = MemoryTerm(user, 0, float(v.numel() * v.element_size()), "copy", arg=k)
                    out.append((term, fqn, from_param))
    return out


def _stack_positions(block: str, where: str) -> tuple[int, int] | None:
    """The positions of `block` and of moment `where`'s block in one stack (labels
    `container#index`); None when they are not two blocks of one stack."""
    (cb, _, ib), (cw, _, iw) = block.rpartition("#"), where.rpartition("#")
    if cb != cw or not (ib.isdigit() and iw.isdigit()):
        return None
    return int(ib), int(iw)


def _reduced_by(block: str | None, where: str | None) -> bool:
    """Whether the gradients of `block`'s parameters are reduced (and so held in their
    parameter's placement) at moment `where`: none at the boundary (the previous step's
    were freed), those of the blocks the backward has finished before `where`'s block, all
    of them in the rest of the backward (an upper bound: it runs both first and last).  A
    unit outside every block reduces last; unknown orders count as reduced."""
    if where is None:
        return True
    if where == BOUNDARY or block is None:
        return False
    pos = _stack_positions(block, where)
    return pos is None or pos[0] > pos[1]


def _alive_for(block: str | None, where: str | None) -> bool:
    """Whether values kept for `block`'s backward are alive at moment `where` (BOUNDARY, a
    block's backward, None: the rest of the backward): the backward runs the blocks of a
    stack last to first.  Unknown orders count as alive."""
    if where in (BOUNDARY, None) or block is None:
        return True
    pos = _stack_positions(block, where)
    return pos is None or pos[1] >= pos[0]


def memory_rows(
    tg: TracedGraph,
    table: StrategyTable,
    options: tuple[str, ...] = ("none",),
    regather: Regather = NO_REGATHER,
    optim_bytes_per_elem: int = ADAMW_BYTES_PER_ELEM,
) -> list[MemoryRow]:
    """The candidate peaks (module docstring) for plans whose blocks follow `options` and
    whose units keep or gather again their parameters as `regather` says."""
    rows = _Rows(tg, table, options, regather, param_chains(tg, table))
    static = [RowEntry(t, tg.weight(t.node)) for t in param_terms(tg, optim_bytes_per_elem)]
    grads = grad_terms(tg, table, rows.chain)
    fixed = regather.fixed
    out = []
    for p, snaps in rows.sims.items():
        copies = copy_terms(tg, table, p, fixed)
        for snap in snaps:
            entries = list(static)
            entries += [
                RowEntry(t, tg.weight(t.node)) for t, b in grads if _reduced_by(b, snap.where)
            ]
            alive = rows.add_saved(entries, snap)
            rows.add_transient(entries, p, snap)
            rows.add_copies(entries, p, snap.where, copies, alive)
            if snap.where != BOUNDARY:
                rows.add_gathers(entries, snap.where)
            else:
                for output in tg.outputs:
                    t = rows.activation(*resolve_source(output))
                    if t is not None:
                        entries.append(RowEntry(t, LOSS_OUTPUT_COPIES, saved=False))
            out.append(MemoryRow(snap.where, p, entries))
    return out


class _Rows:
    """What every row of `memory_rows` is made from: the replays per policy (and, with
    units the solver decides, the replays in which they gather again), each block's saved
    values per policy, the gathers of each block's backward."""

    def __init__(self, tg, table, options, regather: Regather, chain) -> None:
        self.tg, self.table, self.options, self.chain = tg, table, options, chain
        fixed, free = regather.fixed, regather.free
        self.fixed, self.free = fixed, free
        self.sims = {p: snapshots(tg, p, lambda n: chain.get(n) in fixed) for p in options}
        self.again = {}  # policy -> moment -> the replay with every decided unit gathering again
        if free:
            for p in options:
                every = snapshots(tg, p, lambda n: chain.get(n) in fixed or chain.get(n) in free)
                self.again[p] = {snap.where: snap for snap in every}
        self.saved_by_block: dict[str, dict[str, list[MemoryTerm]]] = {}  # policy -> block
        for p, snaps in self.sims.items():
            per: dict[str, list[MemoryTerm]] = defaultdict(list)
            for node, idx in snaps[0].saved:  # the boundary: everything saved
                b, t = block_label(node), self.activation(node, idx)
                if b is not None and t is not None and self.decided(node) is None:
                    per[b].append(t)
            self.saved_by_block[p] = per
        self.gathers = gather_terms(tg, table, chain)

    def decided(self, node) -> str | None:
        """The parameter whose unit the solver decides, for a value of its chain."""
        return self.chain[node] if self.chain.get(node) in self.free else None

    def activation(self, node, idx) -> MemoryTerm | None:
        if node not in self.table.nodes:
            return None
        v = _source_value((node, idx))
        return MemoryTerm(node, idx, float(v.numel() * v.element_size()), "activation")

    def add_saved(self, entries: list[RowEntry], snap) -> set[str]:
        """The values saved then; returns the blocks whose saved values are alive."""
        alive: set[str] = set()
        for node, idx in snap.saved:
            b, t = block_label(node), self.activation(node, idx)
            if t is None:
                continue
            if self.decided(node) is not None:  # kept: counts while its unit keeps
                entries.append(RowEntry(t, self.tg.weight(node), param=self.decided(node)))
            elif b is None:
                entries.append(RowEntry(t, self.tg.weight(node)))
            else:
                alive.add(b)
        for b in sorted(alive):
            for q in self.options:
                entries += [RowEntry(t, block=b, policy=q) for t in self.saved_by_block[q][b]]
        return alive

    def add_transient(self, entries: list[RowEntry], p: str, snap) -> None:
        """The values alive only around then, and those a decided unit makes again."""
        for node, idx in snap.transient:
            b, t = block_label(node), self.activation(node, idx)
            if t is not None:
                entries.append(RowEntry(t, 1, b, p if b else None, saved=False))
        made_again = self.again.get(p, {}).get(snap.where)
        for node, idx in made_again.transient if made_again else ():
            t = self.activation(node, idx)
            if t is not None and node in self.tg.forward_nodes and self.decided(node) is not None:
                entries.append(RowEntry(t, saved=False, param=self.decided(node), regathered=True))

    def add_copies(self, entries: list[RowEntry], p: str, where, copies, alive: set[str]) -> None:
        """The copies kept on edges into saved views (module docstring)."""
        for t, fqn in copies:
            b = t.block
            if fqn is not None:  # a parameter's: alive until its block's backward
                if _alive_for(b, where):
                    param = fqn if fqn in self.free else None
                    entries.append(RowEntry(t, self.tg.weight(t.node), param=param))
            elif b is None:
                entries.append(RowEntry(t, self.tg.weight(t.node)))
            elif b in alive:
                entries.append(RowEntry(t, block=b, policy=p))

    def add_gathers(self, entries: list[RowEntry], where) -> None:
        """The parameters a block's backward gathers (module docstring)."""
        held = {e.term.key for e in entries if e.term.kind == "copy"}
        for t, fqn, from_param in self.gathers:
            if t.block != where or t.key in held:
                continue
            if not from_param:
                entries.append(RowEntry(t, saved=False))
            elif fqn in self.fixed or fqn in self.free:  # this unit's and the next one's
                param = fqn if fqn in self.free else None
                count = 1 if where is None else 2
                entries.append(
                    RowEntry(t, count, saved=False, param=param, regathered=param is not None)
                )


def recomputed_values(
    tg: TracedGraph, table: StrategyTable, policy: str
) -> list[tuple[fx.Node, int]]:
    """(node, output index) of every tensor the blocks make again under `policy` (views,
    which allocate nothing, left out)."""
    out = []
    for node in _saved(tg, policy)[1]:
        if node not in table.nodes or is_view(node):
            continue
        v = node.meta.get("val")
        vals = list(v) if isinstance(v, (list, tuple)) else [v]
        out += [(node, i) for i, x in enumerate(vals) if isinstance(x, torch.Tensor)]
    return out


def block_multiplicity(tg: TracedGraph, table: StrategyTable, block: str) -> int:
    """How many blocks of the whole model traced block `block` stands for."""
    return next(tg.weight(n) for n in table.nodes if block_label(n) == block)


def _source_value(src) -> torch.Tensor:
    v = src[0].meta["val"]
    return v[src[1]] if isinstance(v, (list, tuple)) else v


def copy_fraction(term: MemoryTerm, table: StrategyTable, emitted, required) -> float:
    """Local fraction held by a "copy" term when its edge goes emitted -> required."""
    if required is None or emitted == required:
        return 0.0
    v = _source_value(table.nodes[term.node].sources[term.copied_input])
    return P.shard_fraction(v.shape, required, table.mesh_shape)


def term_fraction(term: MemoryTerm, table: StrategyTable, s: int) -> float:
    """Local fraction of a "param"/"activation" term when its node uses strategy s."""
    st = table.nodes[term.node].strategies[s]
    pl = st.out[term.idx] if term.idx < len(st.out) else None
    if pl is None:
        return 1.0
    v = term.node.meta["val"]
    if isinstance(v, (list, tuple)):
        v = v[term.idx]
    return P.shard_fraction(v.shape, pl, table.mesh_shape)


def entry_fraction(e: RowEntry, table: StrategyTable, choice: dict) -> float:
    """Local fraction of an entry's term under a solved choice (node -> strategy index)."""
    t = e.term
    if t.kind != "copy":
        return term_fraction(t, table, choice[t.node])
    ns = table.nodes[t.node]
    src_node, src_idx = ns.sources[t.copied_input]
    emitted = table.nodes[src_node].strategies[choice[src_node]].out[src_idx]
    return copy_fraction(t, table, emitted, ns.strategies[choice[t.node]].ins[t.copied_input])


def plan_memory(
    tg: TracedGraph,
    table: StrategyTable,
    choice: dict,
    optim_bytes_per_elem: int = ADAMW_BYTES_PER_ELEM,
    regather: Regather = NO_REGATHER,
    counts: dict[str, dict[str, int]] | None = None,
    regathered: frozenset[str] = frozenset(),
) -> dict:
    """Predicted bytes per rank of a solved choice (node -> strategy index) whose blocks
    follow `counts` ({block: {policy: how many blocks}}; missing: none) and which gathers
    `regathered` again (of the parameters `regather` leaves to the solver, the others as it
    says), as the solver's rows count it: the largest row and its parts, and the saved values
    at the boundary."""
    blocks = labelled_blocks(table.nodes)
    counts = {
        b: (counts or {}).get(b) or {"none": block_multiplicity(tg, table, b)} for b in blocks
    }
    options = tuple(sorted({p for c in counts.values() for p in c} or {"none"}))
    best = None
    boundary_saved = 0.0
    for row in memory_rows(tg, table, options, regather, optim_bytes_per_elem):
        parts: defaultdict[str, float] = defaultdict(float)
        for e in row.entries:
            k = e.multiplier(counts, regathered)
            if not k:
                continue
            t = e.term
            b = t.full_bytes * entry_fraction(e, table, choice) * k
            if t.kind == "param":
                v = t.node.meta["val"]
                local = b / (v.element_size() + optim_bytes_per_elem)
                parts["param_bytes_per_rank"] += local * v.element_size()
                parts["optim_bytes_per_rank"] += local * optim_bytes_per_elem
            elif t.kind == "grad":
                parts["grad_bytes_per_rank"] += b
            elif e.saved:
                parts["activation_bytes_per_rank"] += b
            else:
                parts["transient_bytes_per_rank"] += b
        total = sum(parts.values())
        if row.where == BOUNDARY:
            boundary_saved = max(boundary_saved, parts["activation_bytes_per_rank"])
        if best is None or total > best[0]:
            best = (total, row, parts)
    assert best is not None  # the rows include the boundary's
    total, row, parts = best
    out: dict[str, Any] = {
        k: parts.get(k, 0.0)
        for k in (
            "param_bytes_per_rank",
            "grad_bytes_per_rank",
            "optim_bytes_per_rank",
            "activation_bytes_per_rank",
            "transient_bytes_per_rank",
        )
    }
    out["saved_at_boundary_bytes_per_rank"] = boundary_saved
    out["all_grad_bytes_per_rank"] = sum(
        t.full_bytes * term_fraction(t, table, choice[t.node]) * tg.weight(t.node)
        for t, _b in grad_terms(tg, table, param_chains(tg, table))
    )
    out["peak_bytes_per_rank"] = total
    out["peak_where"] = (
        "forward/backward boundary"
        if row.where == BOUNDARY
        else (f"backward of {row.where}" if row.where else "backward outside the blocks")
    )
    return out
