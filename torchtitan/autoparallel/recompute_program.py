"""Per-block recompute policies as decisions of the placement program (solver.py).

Variables, for each repeated block b (repeat.py's labels; a shallow trace has three per stack:
first, interior — standing for all interior blocks — and last):

* `z[b, p]` (binary, one-hot): block b follows policy p (recompute.py).  Only when more than
  one policy is allowed; a pinned policy needs no variable and every term below lands on x.
* `u[b, n, s, p]` (continuous, 0..1) for a node n of block b whose bytes or recompute cost
  depend on the policy: "n takes strategy s and b takes p".  Tight product rows like an
  edge's: sum_p u = x[n, s] for every s, sum_s u = z[b, p] for every p, so at 0/1 values u is
  exactly their product.
* `v[b, p]` (continuous): block b's recomputed communication when it follows p.  Big-M rows
  v >= comm - M (1 - z[b, p]) where comm is the chosen edges' redistribution time into the
  nodes p recomputes (their consumers run again, so do their collectives).
* `T` (continuous): the recompute peak, T >= recomputed bytes of block b under its policy,
  for every b (memory.py: the peak is the saved values plus the largest block's recompute).

Objective += recompute FLOP time (each recomputed node's compute time, weighted like the
node) + v.  Memory row: saved terms of block b on u[., ., ., p] for each p where p keeps
them; terms of no block (the head, the embedding) and "copy" terms as when every block
follows any allowed policy (an upper bound: these are a few small tensors); + T.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from .memory import memory_terms, recomputed_values, term_fraction
from .recompute import block_label, check_policy


class RecomputeChoices:
    """The recompute family of one program (`_Program`), see module docstring."""

    def __init__(self, program, options: tuple[str, ...]):
        self.p = program
        self.options = tuple(check_policy(o) for o in options)
        tg, table = program.tg, program.table
        self.blocks = sorted({block_label(n) for n in table.nodes} - {None})
        self.active = bool(self.blocks) and self.options != ("none",)
        self.z: dict[str, dict[str, int]] = {}
        self._u: dict[tuple[str, fx.Node], dict[tuple[int, str], int]] = {}
        self.recomputed = {
            p: recomputed_values(tg, table, p) if p != "none" else [] for p in self.options
        }
        self.comm_vars: list[tuple[str, str, int]] = []  # (block, policy, v)

    @property
    def pinned(self) -> str | None:
        return self.options[0] if len(self.options) == 1 else None

    # ------------------------------------------------------------------ variables
    def add_choices(self) -> None:
        m = self.p.m
        if len(self.options) > 1:
            for b in self.blocks:
                self.z[b] = {p: m.var(0.0) for p in self.options}
                m.onehot(list(self.z[b].values()))
                m.free_groups.add(len(m.groups) - 1)

    def column(self, block: str, node: fx.Node, s: int, policy: str) -> int:
        """The column that is 1 when `node` (of `block`) takes strategy s and `block` follows
        `policy`: x itself under a pinned policy, else a product column (made on first use)."""
        rep = self.p.rep[node]
        if self.pinned is not None:
            return self.p.xvars[rep][s]
        key = (block, rep)
        grid = self._u.get(key)
        if grid is None:
            m, xs = self.p.m, self.p.xvars[rep]
            grid = self._u[key] = {(k, p): m.var(0.0) for k in range(len(xs)) for p in self.options}
            for k, x in enumerate(xs):
                m.row([(grid[k, p], 1.0) for p in self.options] + [(x, -1.0)], 0.0, 0.0)
            for p in self.options:
                terms = [(grid[k, p], 1.0) for k in range(len(xs))]
                m.row(terms + [(self.z[block][p], -1.0)], 0.0, 0.0)
        return grid[s, policy]

    # ------------------------------------------------------------------ objective
    def add_costs(self) -> None:
        """Recompute FLOP time on the recomputed nodes' columns; recompute communication."""
        if not self.active:
            return
        prog, m = self.p, self.p.m
        cost_of = {}
        for members, y, c in prog.edge_vars:
            cost_of[y] = (c * ((1.0 - prog.eta) if y in prog.overlapped else 1.0), members)
        for p in self.options:
            seen = set()
            for node, _idx in self.recomputed[p]:
                if node in seen:
                    continue
                seen.add(node)
                b = block_label(node)
                rep = prog.rep[node]
                for s in range(len(prog.xvars[rep])):
                    c = prog.solver.compute_cost(rep, s) * prog.weight(node)
                    if c:
                        m.cost[self.column(b, node, s, p)] += c
            self._add_comm(p, {n for n, _ in self.recomputed[p]}, cost_of)

    def _add_comm(self, policy: str, recomputed: set, cost_of: dict) -> None:
        prog, m = self.p, self.p.m
        from .solver import ConsumerEdge

        per_block: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for key, pairs in prog.edge_pair_vars.items():
            if not isinstance(key, ConsumerEdge) or key.node not in recomputed:
                continue
            b = block_label(key.node)
            for y, o, r in pairs:
                if o != r:
                    per_block[b][y] += cost_of[y][0] * prog.weight(key.node)
        for b, coef in per_block.items():
            if self.pinned is not None:
                for y, c in coef.items():
                    m.cost[y] += c
                continue
            big = sum(coef.values())  # every edge at its dearest pair: an upper bound
            v = m.var(1.0, 0.0, big)
            m.unfixable.add(v)
            # v >= sum c y - big (1 - z[b, p])
            m.row(
                [(y, c) for y, c in coef.items()] + [(v, -1.0), (self.z[b][policy], big)],
                -float("inf"),
                big,
            )
            self.comm_vars.append((b, policy, v))

    # ------------------------------------------------------------------ memory
    def memory_terms(self, scale: float) -> tuple[list, list]:
        """(terms of no block or of edges, as `memory.memory_terms` gives them,
        [(column, coefficient)] of the block terms and the recompute peak) for a memory row
        divided by `scale` bytes."""
        prog, m = self.p, self.p.m
        tg, table = prog.tg, prog.table
        regathered = prog.solver.regathered
        shared: dict[tuple, object] = {}
        cols: list[tuple[int, float]] = []
        peak: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for p in self.options:
            for t in memory_terms(tg, table, regathered=regathered, policy=p):
                b = t.block
                if t.kind in ("param", "copy") or b is None:
                    if t.kind != "recompute":
                        shared.setdefault(t.key, t)
                    continue
                rep = prog.rep[t.node]
                for s in range(len(prog.xvars[rep])):
                    f = term_fraction(t, table, s)
                    if not f:
                        continue
                    col = self.column(b, t.node, s, p)
                    if t.kind == "recompute":
                        peak[b].append((col, t.full_bytes * f / scale))
                    else:
                        cols.append((col, t.full_bytes * f * prog.weight(t.node) / scale))
        if peak:
            top = sum(max((c for _col, c in terms), default=0.0) for terms in peak.values())
            T = m.var(0.0, 0.0, max(top, 1.0))
            m.unfixable.add(T)
            for terms in peak.values():
                m.row(terms + [(T, -1.0)], -float("inf"), 0.0)
            cols.append((T, 1.0))
        return list(shared.values()), cols

    # ------------------------------------------------------------------ reading the answer
    def chosen(self, values) -> dict[str, str]:
        if not self.active:
            return {}
        if self.pinned is not None:
            return {b: self.pinned for b in self.blocks}
        return {b: max(zs, key=lambda p: values[zs[p]]) for b, zs in self.z.items()}

    def recompute_us(self, values, choice: dict, policies: dict[str, str]) -> float:
        """Predicted recompute time of a solved plan, as the objective prices it: FLOP time
        of every recomputed node plus the redistributions into them."""
        if not policies:
            return 0.0
        from .solver import ConsumerEdge

        prog = self.p
        scaled = {
            y: c * ((1.0 - prog.eta) if y in prog.overlapped else 1.0)
            for _members, y, c in prog.edge_vars
        }
        total = 0.0
        for p in set(policies.values()) - {"none"}:
            nodes = {n for n, _ in self.recomputed[p] if policies.get(block_label(n)) == p}
            for n in nodes:
                total += prog.solver.compute_cost(prog.rep[n], choice[n]) * prog.weight(n)
            for key, pairs in prog.edge_pair_vars.items():
                if isinstance(key, ConsumerEdge) and key.node in nodes:
                    for y, o, r in pairs:
                        if o != r and values[y] > 0.5:
                            total += scaled[y] * prog.weight(key.node)
        return total
