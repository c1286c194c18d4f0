"""Per-block recompute policies as decisions of the placement program (solve/program.py).

Variables, for each repeated block b (repeat.py's labels; a shallow trace has three per stack:
first, interior — standing for all interior blocks — and last):

* `z[b, p]` (binary, one-hot): block b follows policy p (recompute.py).  Only when more than
  one policy is allowed; a pinned policy needs no variable and every term below lands on x.
* `u[b, n, s, p]` (continuous, 0..1) for a node n of block b whose bytes or recompute cost
  depend on the policy: "n takes strategy s and b takes p".  Tight product rows like an
  edge's: sum_p u = x[n, s] for every s, sum_s u = z[b, p] for every p, so at 0/1 values u is
  exactly their product.

Recomputed communication (the redistributions into the nodes a policy recomputes: their
consumers run again, so do their collectives) is priced on the edges when the policy is
pinned.  With choices it would be the product of an edge's redistribution and the block's
policy; as big-M rows (v >= comm - M (1 - z)) it left the relaxation so loose that the debug
Llama's dp2xtp2 program (130k columns) ran into the 300 s limit at a 3% gap, so the choice is
made on FLOP time and memory, and the plan reports the communication too (`recompute_us`).
Parameter gathers are not among them: values computed from parameters alone follow the
unit's keep-or-gather-again decision (regather_program.py), not the policy.

Objective += recompute FLOP time (each recomputed node's compute time, weighted like the
node).  Memory rows (memory.py, one per candidate peak): a term of block b under policy p
on u[b, ., ., p] (or on x with its count when pinned); terms of no block on x; "copy" terms
on their edges, whatever the policy (an upper bound: they are few).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch.fx as fx

from ..cost.memory import RowEntry, block_multiplicity, recomputed_values
from ..graph.edge_keys import ConsumerEdge
from ..policies.recompute import POLICIES, block_of, check_policy, labelled_blocks


class RecomputeChoices:
    """The recompute family of one program (`PlacementProgram`), see module docstring.

    `setting`: "auto" (the solver chooses per traced block), one policy for every block, or
    the pinned policies as
    `{block: {policy: how many of the blocks it stands for follow it}}` (a shallow trace's
    interior block may stand for a mix, e.g. every second block recomputed)."""

    def __init__(
        self,
        program: Any,  # program.PlacementProgram, its owner
        setting: str | dict[str, dict[str, int]],
    ):
        self.p = program
        tg, table = program.tg, program.table
        self.blocks = labelled_blocks(table.nodes)
        self.multiplicity = {b: block_multiplicity(tg, table, b) for b in self.blocks}
        self.auto = setting == "auto"
        if self.auto:
            self.options: tuple[str, ...] = POLICIES
            self.pins: dict[str, dict[str, int]] = {}
        else:
            if isinstance(setting, str):  # one policy for every block
                setting = {b: {setting: k} for b, k in self.multiplicity.items()}
            self.pins = {
                b: {
                    check_policy(p): k
                    for p, k in setting.get(b, {"none": self.multiplicity[b]}).items()
                    if k
                }
                for b in self.blocks
            }
            self.options = tuple(p for p in POLICIES if any(p in c for c in self.pins.values()))
        self.active = bool(self.blocks) and self.options not in ((), ("none",))
        self.z: dict[str, dict[str, int]] = {}
        self._u: dict[tuple[str, fx.Node], dict[tuple[int, str], int]] = {}
        self.recomputed = {
            p: recomputed_values(tg, table, p) if p != "none" else [] for p in self.options
        }

    def count(self, block: str, policy: str) -> int:
        """How many full blocks `block` stands for follow `policy` (auto: all of them, the
        product column says whether they do)."""
        if self.auto:
            return self.multiplicity[block]
        return self.pins[block].get(policy, 0)

    # ------------------------------------------------------------------ variables
    def add_choices(self) -> None:
        if not (self.active and self.auto):
            return
        m = self.p.m
        for b in self.blocks:
            self.z[b] = {p: m.var(0.0) for p in self.options}
            m.onehot(list(self.z[b].values()))
            m.free_groups.add(len(m.groups) - 1)

    def column(self, block: str, node: fx.Node, s: int, policy: str) -> int:
        """The column that is 1 when `node` (of `block`) takes strategy s and `block` follows
        `policy`: x itself when pinned, else a product column (made on first use)."""
        rep = self.p.rep[node]
        if not self.auto:
            return self.p.xvars[rep][s]
        key = (block, rep)
        grid = self._u.get(key)
        if grid is None:
            grid = self._u[key] = self.p.m.product(self.p.xvars[rep], self.z[block])
        return grid[s, policy]

    # ------------------------------------------------------------------ objective
    def add_costs(self) -> None:
        """Recompute FLOP time on the recomputed nodes' columns; recompute communication."""
        if not self.active:
            return
        prog, m = self.p, self.p.m
        for p in self.options:
            nodes = dict.fromkeys(n for n, _idx in self.recomputed[p])
            for node in nodes:
                b = block_of(node)
                k = self.count(b, p)
                if not k:
                    continue
                rep = prog.rep[node]
                for s in range(len(prog.xvars[rep])):
                    c = prog.prices.compute_cost(rep, s) * k
                    if c:
                        m.cost[self.column(b, node, s, p)] += c
            self._add_comm(p, nodes)

    def _add_comm(self, policy: str, recomputed: Iterable[fx.Node]) -> None:
        """Recomputed communication on the edges, for a pinned policy (with choices it is
        reported, not priced: see the module docstring)."""
        if self.auto:
            return
        m = self.p.m
        per_block: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for b, y in self._recomputed_edges(recomputed):
            per_block[b][y] += self.p.scaled_comm(y) * self.count(b, policy)
        for coef in per_block.values():
            for y, c in coef.items():
                m.cost[y] += c

    def _recomputed_edges(
        self, recomputed: Iterable[fx.Node], values: Sequence[float] | None = None
    ) -> Iterator[tuple[str, int]]:
        """(block, y) of every redistributing pair into a recomputed node (each node once);
        with a solved plan's `values`, only the pairs it uses: a few dozen, where the
        recomputed nodes have tens of thousands (a caller that sums the solved plan's cost
        per policy then resumes this generator that many times, not once per pair)."""
        edge_pairs = self.p.edge_pair_vars
        for node in recomputed:
            b = block_of(node)
            for k in range(len(self.p.table.nodes[node].sources)):
                for y, o, r in edge_pairs.get(ConsumerEdge(node, k), ()):
                    if (values is None or values[y] > 0.5) and o != r:
                        yield b, y

    # ------------------------------------------------------------------ memory
    def entry_column(self, e: RowEntry, s: int) -> tuple[int, int]:
        """(column, multiplier) carrying memory row entry `e` (memory.RowEntry, not a copy)
        when its node takes strategy s."""
        node = e.term.node
        if e.block is None:
            return self.p.xvars[self.p.rep[node]][s], e.weight
        if self.auto:
            mult = self.multiplicity[e.block] if e.saved else 1
            assert e.policy is not None  # set with `block`
            return self.column(e.block, node, s, e.policy), mult
        return self.p.xvars[self.p.rep[node]][s], e.multiplier(self.pins)

    # ------------------------------------------------------------------ reading the answer
    def counts(self, values: Sequence[float]) -> dict[str, dict[str, int]]:
        """{block: {policy: how many blocks it stands for follow it}} of a solved plan."""
        if not self.active:
            return {}
        if not self.auto:
            return {b: dict(c) for b, c in self.pins.items()}
        return {
            b: {max(zs, key=lambda p: values[zs[p]]): self.multiplicity[b]}
            for b, zs in self.z.items()
        }

    def recompute_us(
        self, values: Sequence[float], choice: dict, counts: dict[str, dict[str, int]]
    ) -> float:
        """Predicted recompute time of a solved plan, as the objective prices it: FLOP time
        of every recomputed node plus the redistributions into them."""
        prog = self.p
        total = 0.0
        for p in self.options:
            if p == "none":
                continue
            nodes = dict.fromkeys(n for n, _idx in self.recomputed[p])
            for n in nodes:
                k = counts.get(block_of(n), {}).get(p, 0)
                total += prog.prices.compute_cost(prog.rep[n], choice[n]) * k
            for b, y in self._recomputed_edges(nodes, values):
                total += prog.scaled_comm(y) * counts.get(b, {}).get(p, 0)
        return total
