"""Stage 5b: FSDP-shaped communication in the lowered graphs, derived from the graph itself.

Two kinds of collectives are *parameter-side* and get FSDP2's treatment:

* **gathers of parameters** — an `all_gather_into_tensor` computed from parameters and buffers
  alone (possibly after a cast);
* **gradient reductions** — a `reduce_scatter_tensor` / `all_reduce` on the chain of
  single-input ops that ends in a parameter gradient.

A parameter split on two mesh dims is gathered (its gradient reduced) once per dim, one after
the other: each collective has a *level*, its place on that chain.

Each is assigned to a *unit*, the FSDP2 wrapping torchtitan applies by hand, found from the
module structure rather than from names: every child of a container (`ModuleList`,
`ModuleDict`, `Sequential` — a transformer's blocks) is a unit, everything else belongs to the
root unit.  Collectives of one unit and level with the same process group, op and dtype are
merged into one collective over a flat buffer (copy in, one collective, split out).

Schedule (the graph's node order is the eager execution order; the waits of functional
collectives are where a rank blocks):
* a unit's parameter gathers are issued right after the first op that consumes the previous
  unit's gathered parameters (one unit ahead, so they overlap that unit's compute), and waited
  for just before their own first consumer; when the units between keep their gathered
  parameters (regather.py) there is no gather to overlap, and holding this one's across them
  would cost their memory: it is issued just before its first consumer;
* gradient all-reduces that end their chains (a gradient left replicated on that dim,
  DDP-like) of consecutive units share one bucket of up to 25 MiB, as DDP's do (nothing is
  freed by reducing such a gradient early, so only the calls are saved); other reductions
  stay per unit;
* a unit's gradient reductions are issued as soon as its last gradient is computed (a later
  level as soon as the earlier one is done; also a reduction no other one merges with, which
  the lowering emits after the whole backward) and the last level is waited for right after
  the next unit's is issued (one in flight; the last unit's at the end of the backward);
* everything else stays in place; what a moved node needs moves with it (just in time).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import defaultdict
from typing import cast

import torch
import torch.fx as fx

from torchtitan.torch_private import make_graph_module

from ..graph.nodes import arg_node, param_side
from ..policies.units import unit_of
from .lower import Partition

_C = torch.ops._c10d_functional
AG = _C.all_gather_into_tensor.default
RS = _C.reduce_scatter_tensor.default
AR = _C.all_reduce.default
WAIT = _C.wait_tensor.default
COLLECTIVES = (AG, RS, AR)
_aten = torch.ops.aten


def count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional"
            and n.target is not WAIT
        ):
            out[n.target._opname] += 1
    return dict(out)


def bucket_collectives(part: Partition, units: list[str], enabled: bool = True) -> dict:
    """Merge and schedule the parameter-side collectives of both graphs in place; returns the
    collective counts of each graph before and after."""
    stats = {"fwd_before": count_collectives(part.fwd), "bwd_before": count_collectives(part.bwd)}
    fwd_params = {n: f for n, f in zip(_placeholders(part.fwd), part.fwd_names) if f is not None}
    bwd_params = {n: f for n, f in zip(_placeholders(part.bwd), part.saved_names) if f is not None}
    part.fwd = _GraphBuckets(part.fwd, fwd_params, {}, units, enabled).run()
    out = next(n for n in part.bwd.graph.nodes if n.op == "output")
    grads = {o: f for o, f in zip(out.args[0], part.grad_names) if isinstance(o, fx.Node)}
    part.bwd = _GraphBuckets(part.bwd, bwd_params, grads, units, enabled).run()
    stats["fwd"] = count_collectives(part.fwd)
    stats["bwd"] = count_collectives(part.bwd)
    return stats


# DDP's default bucket (`bucket_cap_mb=25`)
ALL_REDUCE_BUCKET_BYTES = 25 * 2**20


def _bytes(n: fx.Node) -> int:
    v = n.meta["val"]
    return v.numel() * v.element_size()


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def one_source(n: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The one value `n` is computed from, and the nodes passed on the way: its input when it
    has one, the value split when it joins pieces of one split (as a redistribution of a
    dimension other than 0 does); None for anything else."""
    if n.op != "call_function":
        return None
    ins = n.all_input_nodes
    if len(ins) == 1:
        return ins[0], [n]
    if all(a.target is operator.getitem for a in ins) and len({a.args[0] for a in ins}) == 1:
        return arg_node(ins[0]), [n, *ins]
    return None


def consecutive_units(a: str, b: str, units: list[str]) -> bool:
    """Whether units `a` and `b` (`units`: the stack's, in model order; "" the root) run one
    after the other: adjacent in the stack, or the root (embedding, head) and either end."""
    pos = {u: i for i, u in enumerate(units)}
    if "" in (a, b):
        other = b if a == "" else a
        return other == "" or pos.get(other) in (0, len(units) - 1)
    return a in pos and b in pos and abs(pos[a] - pos[b]) == 1


def _single_wait(c: fx.Node) -> fx.Node | None:
    users = list(c.users)
    return users[0] if len(users) == 1 and users[0].target is WAIT else None


class _GraphBuckets:
    def __init__(
        self, gm: fx.GraphModule, params: dict, grads: dict, units: list[str], enabled: bool
    ):
        self.gm, self.graph = gm, gm.graph
        self.params, self.grads, self.units, self.enabled = params, grads, units, enabled
        self.side = param_side(self.graph.nodes, set(params))
        self.index = {n: i for i, n in enumerate(self.graph.nodes)}

    # ------------------------------------------------------------------ analysis
    def _origin(self, node: fx.Node) -> str | None:
        """FQN of the first parameter/buffer `node` is computed from."""
        seen, stack, found = set(), [node], []
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.params:
                found.append(n)
            stack.extend(n.all_input_nodes)
        return self.params[min(found, key=self.index.__getitem__)] if found else None

    def _gathers(self) -> dict[fx.Node, int]:
        """Parameter gathers -> their level: how many collectives come before them on their
        chain (a parameter split on two mesh dims is gathered on one, then the other)."""
        level: dict[fx.Node, int] = {}
        out = {}
        for n in self.graph.nodes:
            if n not in self.side:
                continue
            up = max((level.get(a, 0) for a in n.all_input_nodes), default=0)
            if n.target is AG and _single_wait(n) is not None:
                out[n] = up
            level[n] = up + (n.target in COLLECTIVES)
        return out

    def _reductions(self) -> tuple[dict[fx.Node, tuple[str, int, bool]], set[fx.Node]]:
        """Reductions on the chain that ends in each gradient -> (parameter FQN, level from
        the top of the chain, whether it is the chain's last), and the nodes of the chains
        that hold one (the lowering emits them after the whole backward).  The chain is the
        gradient's redistribution: ops of one input, and the split / re-join of one value
        around a collective (`one_source`)."""
        out = {}
        chains: set[fx.Node] = set()
        for o, fqn in self.grads.items():
            chain, links, cur = [], [], o
            while (step := one_source(cur)) is not None:
                src, passed = step
                links.extend(passed)
                if (
                    cur.target in (RS, AR)
                    and cur not in self.side
                    and _single_wait(cur) is not None
                ):
                    chain.append(cur)
                cur = src
            if chain:
                chains.update(links)
            chain.reverse()
            for i, c in enumerate(chain):
                out[c] = (fqn, i, i == len(chain) - 1)
        return out, chains

    def _first_use(self) -> dict[fx.Node, float]:
        """Parameter-side node -> index of the first non-parameter-side node that needs it."""
        first: dict[fx.Node, float] = {}
        for n in reversed(list(self.graph.nodes)):
            if n in self.side:
                first[n] = min(
                    (first[u] if u in self.side else self.index[u] for u in n.users),
                    default=math.inf,
                )
        return first

    # ------------------------------------------------------------------ rewrite
    def run(self) -> fx.GraphModule:
        gathers, (reductions, reduction_chains) = self._gathers(), self._reductions()
        first = self._first_use()
        groups: dict[tuple, list[fx.Node]] = defaultdict(list)
        unit_first: dict[str, float] = {}
        for c, level in gathers.items():
            unit = unit_of(self._origin(c), self.units)
            groups[
                (unit, level, True, c.target, tuple(c.args[1:]), arg_node(c).meta["val"].dtype)
            ].append(c)
            unit_first[unit] = min(unit_first.get(unit, math.inf), first[c])
        for c, (fqn, level, last) in reductions.items():
            groups[
                (
                    unit_of(fqn, self.units),
                    level,
                    last,
                    c.target,
                    tuple(c.args[1:]),
                    arg_node(c).meta["val"].dtype,
                )
            ].append(c)

        groups = self._coalesce_all_reduces(groups)
        anchor: dict[fx.Node, float] = {}  # issue position of each collective we schedule
        reduction_waits: list[fx.Node] = []  # waits of a chain's last reduction
        order = sorted(unit_first, key=unit_first.__getitem__)
        issue_at = {}
        for i, u in enumerate(order):
            if i == 0:
                issue_at[u] = -1.0
            elif consecutive_units(order[i - 1], u, self.units):  # one unit ahead
                issue_at[u] = unit_first[order[i - 1]] + 0.5
            else:  # the units between keep their parameters: no gather to overlap
                issue_at[u] = unit_first[u] - 0.5
        # merge in chain order: a later level's inputs are an earlier level's outputs
        for (unit, level, last, target, _args, _dt), members in sorted(
            groups.items(), key=lambda kv: kv[0][1]
        ):
            if self.enabled and len(members) > 1:
                members = [self._merge(target, members)]
            for c in members:
                if target is AG:
                    anchor[c] = issue_at[unit] + 1e-3 * level
                elif last:
                    reduction_waits.append(next(iter(c.users)))
        return self._schedule(anchor, reduction_waits, reduction_chains)

    def _coalesce_all_reduces(self, groups: dict[tuple, list[fx.Node]]) -> dict[tuple, list]:
        """Gradient all-reduces that end their chains (gradients left replicated on that
        mesh dim, DDP-like) of consecutive units, in the order the backward makes them, share
        one bucket of up to `ALL_REDUCE_BUCKET_BYTES`, as DDP's do: such a gradient takes the
        same memory whether it is reduced early or late, so only the calls are saved.  Other
        groups (an all-reduce a reduce-scatter follows frees memory when done) keep their
        unit."""
        if not self.enabled:
            return groups
        out: dict[tuple, list[fx.Node]] = {}
        runs: dict[tuple, list[tuple[float, list[fx.Node]]]] = defaultdict(list)
        for key, members in groups.items():
            if key[3] is AR and key[2]:  # the last reduction of its chains
                ready = max(self.index[arg_node(c)] for c in members)
                runs[key[1:]].append((ready, members))
            else:
                out[key] = members
        for rest, unit_groups in runs.items():
            bucket: list[fx.Node] = []
            size = count = 0
            for _ready, members in sorted(unit_groups, key=lambda g: g[0]):
                nbytes = sum(_bytes(arg_node(c)) for c in members)
                if bucket and size + nbytes > ALL_REDUCE_BUCKET_BYTES:
                    out[(f"all-reduce bucket {count}",) + rest] = bucket
                    bucket, size, count = [], 0, count + 1
                bucket = bucket + members
                size += nbytes
            out[(f"all-reduce bucket {count}",) + rest] = bucket
        return out

    def _merge(self, target, members: list[fx.Node]) -> fx.Node:
        """Replace `members` (same op, group and dtype) by one collective on a flat buffer."""
        g = self.graph
        extra = members[0].args[1:]
        ins = [arg_node(c) for c in members]
        shapes = [list(x.meta["val"].shape) for x in ins]
        numels = [math.prod(s) for s in shapes]
        with g.inserting_before(members[0]):
            if target is AG:
                n = cast(int, extra[0])  # the group's size
                flat = [g.call_function(_aten.reshape.default, (x, [-1])) for x in ins]
                buf = g.call_function(_aten.cat.default, (flat,))
                coll = g.call_function(target, (buf, *extra))
                w = g.call_function(WAIT, (coll,))
                rows = g.call_function(_aten.view.default, (w, [n, sum(numels)]))
                parts = g.call_function(_aten.split_with_sizes.default, (rows, numels, 1))
                outs = []
                for i, s in enumerate(shapes):
                    out = g.call_function(
                        _aten.reshape.default,
                        (g.call_function(operator.getitem, (parts, i)), [n * s[0], *s[1:]]),
                    )
                    if s[0] == 1 and n > 1 and len(shapes) > 1:
                        # merging ranks with a size-1 leading dim is no copy: the result would
                        # be a strided column of the buffer, where the plain gather was
                        # contiguous (and a later `view` relies on that)
                        out = g.call_function(
                            _aten.clone.default, (out,), {"memory_format": torch.contiguous_format}
                        )
                    outs.append(out)
            else:
                n = cast(int, extra[1]) if target is RS else 1
                if n == 1:  # one flat run (a copy per piece; along dim 1 it costs ~4x)
                    flat = [g.call_function(_aten.reshape.default, (x, [-1])) for x in ins]
                    buf = g.call_function(_aten.cat.default, (flat,))
                else:  # rank r's chunk of every piece, side by side in row r
                    pieces = [g.call_function(_aten.reshape.default, (x, [n, -1])) for x in ins]
                    buf = g.call_function(_aten.cat.default, (pieces, 1))
                like = ins[0].meta["val"]  # what the eager graphs' in-place pass reads
                buf.meta["val"] = like.new_empty([n, sum(numels) // n] if n > 1 else [sum(numels)])
                coll = g.call_function(target, (buf, *extra))
                w = g.call_function(WAIT, (coll,))
                flat_out = g.call_function(_aten.view.default, (w, [-1]))
                parts = g.call_function(
                    _aten.split_with_sizes.default, (flat_out, [k // n for k in numels], 0)
                )
                outs = [
                    g.call_function(
                        _aten.view.default,
                        (
                            g.call_function(operator.getitem, (parts, i)),
                            [s[0] // n, *s[1:]] if target is RS else s,
                        ),
                    )
                    for i, s in enumerate(shapes)
                ]
        for c, o in zip(members, outs):
            old_wait = next(iter(c.users))
            o.meta = dict(old_wait.meta)  # what a later level's merge reads
            old_wait.replace_all_uses_with(o)
            g.erase_node(old_wait)
            g.erase_node(c)
        return coll

    def _schedule(
        self, anchor: dict, reduction_waits: list[fx.Node], reduction_chains: set[fx.Node]
    ) -> fx.GraphModule:
        """Re-emit the graph in dependency order, each node as close as possible to its key:
        its original position; anchored collectives at their issue point; parameter-side
        nodes just before their first user; a gradient reduction's wait just before the
        next reduction is issued (one in flight, as FSDP2), the last one at the end."""
        nodes = _topological(list(self.graph.nodes))
        side = param_side(nodes, set(self.params))
        late = set(reduction_waits)
        key: dict[fx.Node, float] = {}
        for n in nodes:
            if n.op == "placeholder":
                key[n] = -math.inf
            elif n.op == "output" or n in late:
                key[n] = math.inf
            elif n in anchor:
                key[n] = anchor[n]
            elif n in side:
                continue  # below: just in time
            elif n in self.index and n not in reduction_chains:
                key[n] = self.index[n]
            else:  # a gradient's way to its reduction, or made by merging: as soon as ready
                key[n] = max((key.get(a, -1.0) for a in n.all_input_nodes), default=-1.0) + 1e-3
        issued = sorted(reduction_waits, key=lambda w: key[w.all_input_nodes[0]])
        for w, nxt in zip(issued, issued[1:]):
            key[w] = key[nxt.all_input_nodes[0]] + 1e-4
        for n in reversed(nodes):
            if n not in key:
                key[n] = min((key[u] for u in n.users), default=math.inf) - 1e-6
        emitted = _topological(nodes, key)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in emitted:
            env[n] = g.node_copy(n, env.__getitem__)
        g.lint()
        return make_graph_module(self.gm, g)


def _topological(nodes: list[fx.Node], key: dict | None = None) -> list[fx.Node]:
    """`nodes` in a dependency order; among ready nodes the smallest `key` first (default:
    the given order)."""
    tie = {n: i for i, n in enumerate(nodes)}
    key = key if key is not None else tie
    indeg = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(key[n], tie[n], n) for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _k, _t, n = heapq.heappop(ready)
        out.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (key[u], tie[u], u))
    return out
