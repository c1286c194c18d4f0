"""Keep or gather again (regather.py) as decisions of the placement program (solve/program.py).

Variables: for each unit u the solver decides, `g[u, "keep"]` and `g[u, "again"]` (binary,
one-hot).  A term that depends on both a placement and the decision sits on a product column
(`Milp.product`) of the node's x or the edge's y with g[u].

Objective: gathering again repeats, in the backward, the redistributions on the parameter's
chain into the values the backward makes again (the edges into those chain nodes), each
overlappable like the forward's: on product[y, "again"], or on y itself for a parameter
gathered again whatever the plan.  The redistributions from a chain value into the backward
are the backward's own edges, priced whatever the unit does (kept, the runner reuses the
forward's where the placements match: an upper bound then).

Memory rows (memory.py): an entry conditional on its parameter's unit sits on the product
column of its x (an activation term) or of its edge's y (a copy) with g[u, "again"] or
g[u, "keep"].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cost.liveness import backward_reads, parameter_valued
from ..cost.memory import RowEntry, param_chains
from ..graph.edge_keys import ConsumerEdge
from ..policies.recompute import recompute_rule, split_saved
from ..policies.regather import Regather

MODES = ("keep", "again")


class RegatherChoices:
    """The re-gather family of one program (`PlacementProgram`), see the module docstring."""

    def __init__(self, program: Any, setting: Regather):  # program.PlacementProgram, its owner
        self.p = program
        self.setting = setting
        tg, table = program.tg, program.table
        self.units = setting.free_units
        self.g: dict[str, dict[str, int]] = {}
        self._products: dict[tuple, dict] = {}
        chain = param_chains(tg, table)
        every = setting.fixed | setting.free
        rule = recompute_rule("none", parameter_valued(tg), lambda n: chain.get(n) in every)
        _saved, recomputed = split_saved(backward_reads(tg), rule)
        # chain nodes the backward makes again when their parameter is gathered again
        self.made_again = {n: chain[n] for n in recomputed if n in table.nodes}

    # ------------------------------------------------------------------ variables
    def add_choices(self) -> None:
        m = self.p.m
        for u in self.units:
            self.g[u] = {mode: m.var(0.0) for mode in MODES}
            m.onehot(list(self.g[u].values()))
            m.free_groups.add(len(m.groups) - 1)

    def _product(self, cols: list[int], fqn: str) -> dict:
        unit = self.setting.unit[fqn]
        key = (tuple(cols), unit)
        grid = self._products.get(key)
        if grid is None:
            grid = self._products[key] = self.p.m.product(cols, self.g[unit])
        return grid

    # ------------------------------------------------------------------ objective
    def add_costs(self) -> None:
        """The backward's redistributions into the chain values it makes again."""
        prog, m = self.p, self.p.m
        fixed, free = self.setting.fixed, self.setting.free
        for node, fqn in self.made_again.items():
            if fqn not in fixed and fqn not in free:
                continue
            for k in range(len(prog.table.nodes[node].sources)):
                pairs = prog.edge_pair_vars.get(ConsumerEdge(node, k), [])
                for i, (y, o, r) in enumerate(pairs):
                    if o == r:
                        continue
                    c = prog.scaled_comm(y) * prog.weight(node)
                    if fqn in fixed:
                        m.cost[y] += c
                    else:
                        grid = self._product([col for col, _o, _r in pairs], fqn)
                        m.cost[grid[i, "again"]] += c

    def regather_us(self, values: Sequence[float], regathered: frozenset[str]) -> float:
        """Communication of the backward's gathering again (before overlap) in a solved plan
        gathering `regathered` again."""
        prog = self.p
        total = 0.0
        for node, fqn in self.made_again.items():
            if fqn not in regathered:
                continue
            for k in range(len(prog.table.nodes[node].sources)):
                for y, o, r in prog.edge_pair_vars.get(ConsumerEdge(node, k), []):
                    if o != r and values[y] > 0.5:
                        total += prog.pair_cost[y] * prog.weight(node)
        return total

    # ------------------------------------------------------------------ memory
    def decides(self, entry: RowEntry) -> bool:
        return entry.param is not None and entry.param in self.setting.free

    def add_entry(self, entry: RowEntry, coef: float, terms: list) -> None:
        """Row terms of memory entry `entry` (`decides(entry)`), each byte times `coef`."""
        t, mode = entry.term, "again" if entry.regathered else "keep"
        param = entry.param
        assert param is not None  # decides(entry)
        prog = self.p
        if t.kind != "copy":
            xs = prog.xvars[prog.rep[t.node]]
            grid = self._product(xs, param)
            for s, frac in enumerate(prog.term_fractions(t)):
                if frac:
                    terms.append((grid[s, mode], t.full_bytes * frac * coef))
            return
        for key in prog.copy_edges(t):
            pairs = prog.edge_pair_vars.get(key, [])
            if not pairs:
                continue
            grid = self._product([y for y, _o, _r in pairs], param)
            for i, f in enumerate(prog.copy_fractions(t, key)):
                if f:
                    terms.append((grid[i, mode], t.full_bytes * f * coef))

    # ------------------------------------------------------------------ reading the answer
    def regathered(self, values: Sequence[float]) -> frozenset[str]:
        """Traced parameters a solved plan gathers again."""
        chosen = [u for u, g in self.g.items() if values[g["again"]] > 0.5]
        return self.setting.regathered(chosen)
