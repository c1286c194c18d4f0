"""Stage 2: candidate sharding strategies for every node of the joint graph.

A `Strategy` says, for one node, the placement of each output and the placement each tensor
input must arrive in.  Candidates come from DTensor's own rules:

* `op_strategy_funcs` (classic strategy functions).  Many "follow the input" rules (views,
  reductions, nll_loss) reject being asked about every input placement at once, so on failure
  we ask once per placement of the first tensor input and take the union.
* `op_single_dim_strategy_funcs` (one mesh dim at a time), expanded to the N-D mesh with
  torch's private helpers; placeholders are filled with `Shard`.

Our own rules cover the gaps: nodes with no tensor input (factories, arange) are replicated,
placeholders may take any Shard/Replicate combination (never Partial), `getitem` is not a node
of its own (it reads output `i` of its producer).  An op with no rule raises
`UnsupportedOpError` naming op and node.  Results are memoised per (op, input metadata,
candidate sets), so repeated layers cost nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Shard

from torchtitan.torch_private import (
    REDISTRIBUTE_COST_MODULES,
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    SingleDimStrategyInfo,
    TensorMeta,
    TupleStrategy,
    expand_to_full_mesh_op_strategy,
    fill_single_dim_strategy_placeholders,
    get_num_tensor_inputs,
    insert_single_dim_replication_strategy,
)

from ..errors import UnsupportedOpError
from ..graph import placements as P
from ..graph.nodes import getitem_source, is_getitem, out_metas, tensor_meta
from ..ops import (
    elementwise_rules,  # noqa: F401  (registers rules DTensor lacks)
    experts,  # noqa: F401  (registers the routed experts' layouts)
)
from ..ops.collective_ops import COLLECTIVE_OPS, CollectiveOp
from ..trace.joint import TracedGraph

log = logging.getLogger(__name__)

Source = tuple[fx.Node, int]  # (producer node, output index)


@dataclass(frozen=True)
class Strategy:
    out: tuple[P.Placements | None, ...]  # one entry per output of the op
    ins: tuple[P.Placements | None, ...]  # one entry per tensor input (flattened arg order)


def placed(pl: P.Placements | None) -> P.Placements:
    """A strategy entry known to be a tensor's (a parameter's output, say): its placement."""
    assert pl is not None, "a tensor without a placement"
    return pl


@dataclass
class NodeStrategies:
    node: fx.Node
    sources: list[Source]  # producer of each tensor input, in `Strategy.ins` order
    strategies: list[Strategy]
    role: str = "op"  # "param", "buffer", "input", "tangent", "op"

    def out_placements(self, idx: int = 0) -> list[P.Placements | None]:
        return [s.out[idx] if idx < len(s.out) else None for s in self.strategies]


@dataclass
class StrategyTable:
    mesh_shape: tuple[int, ...]
    nodes: dict[fx.Node, NodeStrategies] = field(default_factory=dict)
    memo_hits: int = 0
    memo_misses: int = 0

    def source_of(self, node: fx.Node) -> Source:
        return resolve_source(node)


def resolve_source(node: fx.Node) -> Source:
    """Map a getitem to (tuple producer, index); any other node to (node, 0)."""
    if is_getitem(node):
        return getitem_source(node)
    return (node, 0)


def _tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued fx.Node inputs in flattened (args, then kwargs) order."""
    out: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            if isinstance(a.meta.get("val"), torch.Tensor):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in node.args:
        visit(a)
    for a in node.kwargs.values():
        visit(a)
    return out


class StrategyBuilder:
    """Enumerates strategies for all nodes of a traced graph on one mesh."""

    def __init__(self, tg: TracedGraph, mesh: DeviceMesh, memo: dict | None = None):
        self.tg = tg
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.memo: dict[Any, list[Strategy]] = {} if memo is None else memo
        self.table = StrategyTable(self.mesh_shape)

    # ---- candidates a producer can hand to a consumer ----
    def candidates(self, src: Source) -> list[P.Placements]:
        ns = self.table.nodes[src[0]]
        seen: dict[P.Placements, None] = {}
        for pl in ns.out_placements(src[1]):
            if pl is not None:
                seen.setdefault(pl, None)
        return list(seen)

    def _spec(self, pl: P.Placements, meta: TensorMeta) -> DTensorSpec:
        return DTensorSpec(self.mesh, pl, tensor_meta=meta)

    def _op_strategy(self, node: fx.Node, cands: list[P.Placements]) -> OpStrategy:
        meta = tensor_meta(node.meta["val"])
        return OpStrategy([OpSpec(self._spec(pl, meta)) for pl in cands])

    # ---- main loop ----
    def build(self) -> StrategyTable:
        tg = self.tg
        roles: dict[fx.Node, str] = {}
        for n in tg.params.values():
            roles[n] = "param"
        for n in tg.buffers.values():
            roles[n] = "buffer"
        for n in tg.inputs:
            roles[n] = "input"
        for t in tg.tangents:
            if t is not None:
                roles[t] = "tangent"
        for node in tg.gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    continue
                opts = P.all_placements(val.shape, self.mesh_shape)
                self.table.nodes[node] = NodeStrategies(
                    node, [], [Strategy((pl,), ()) for pl in opts], roles.get(node, "input")
                )
            elif node.op == "get_attr" and isinstance(
                getattr(tg.gm, node.target, None), torch.Tensor
            ):
                # a constant the forward made from Python values: the same on every rank
                rep = tuple(Replicate() for _ in self.mesh_shape)
                self.table.nodes[node] = NodeStrategies(node, [], [Strategy((rep,), ())])
            elif node.op == "call_function":
                if is_getitem(node):
                    continue
                if out_metas(node) is None:
                    continue  # non-tensor result (e.g. a symint); nothing to place
                self.table.nodes[node] = self._node_strategies(node)
        return self.table

    def _node_strategies(self, node: fx.Node) -> NodeStrategies:
        inputs = _tensor_input_nodes(node)
        sources = [resolve_source(n) for n in inputs]
        op = node.target
        out_meta = out_metas(node)
        n_out = len(out_meta) if isinstance(out_meta, tuple) else 1
        if not inputs:
            # factories / arange / scalar_tensor: computed identically on every rank
            rep = tuple(Replicate() for _ in self.mesh_shape)
            return NodeStrategies(node, [], [Strategy(tuple(rep for _ in range(n_out)), ())])
        cand_lists = [self.candidates(s) for s in sources]
        key = self._memo_key(node, inputs, cand_lists)
        strategies = self.memo.get(key) if key is not None else None
        if strategies is None:
            self.table.memo_misses += 1
            strategies = self._query(node, inputs, cand_lists, n_out)
            if key is not None:
                self.memo[key] = strategies
        else:
            self.table.memo_hits += 1
        if not strategies:
            raise UnsupportedOpError(
                f"no valid sharding strategy for op {op} at node '{node.name}'"
            )
        return NodeStrategies(node, sources, strategies)

    def _memo_key(self, node, inputs, cand_lists):
        def norm(a):
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
                return ("N", a.name)
            if isinstance(a, (list, tuple)):
                return tuple(norm(x) for x in a)
            if isinstance(a, dict):
                return tuple(sorted((k, norm(v)) for k, v in a.items()))
            return a

        try:
            key = (
                node.target,
                norm(node.args),
                norm(node.kwargs),
                tuple(tuple(c) for c in cand_lists),
            )
            hash(key)
            return key
        except TypeError:
            return None

    def _schema(self, node: fx.Node, strat_of: dict[fx.Node, OpStrategy]) -> OpSchema:
        def conv(a):
            if isinstance(a, fx.Node):
                if a in strat_of:
                    return strat_of[a]
                v = a.meta.get("val")
                return v
            if isinstance(a, (list, tuple)):
                items = [conv(x) for x in a]
                if items and all(isinstance(x, OpStrategy) for x in items):
                    return TupleStrategy(items)
                return type(a)(items)
            return a

        args = tuple(conv(a) for a in node.args)
        kwargs = {k: conv(v) for k, v in node.kwargs.items()}
        # single-dim rules keep their schema info (e.g. needs_pytree: `index.Tensor`'s list of
        # optional index tensors) in a table of their own
        op = cast(OpOverload, node.target)  # a call_function node of the ATen graph
        info = self.prop.op_to_schema_info.get(
            op
        ) or self.prop.op_to_schema_info_for_single_dim_strategy.get(op)
        return OpSchema(op, args, kwargs, schema_info=info)

    def _query(self, node, inputs, cand_lists, n_out) -> list[Strategy]:
        op = node.target
        out_meta = out_metas(node)
        collective = COLLECTIVE_OPS.get(op)
        if collective is not None:
            return self._collective_op(node, collective, inputs)
        single = self.prop.op_single_dim_strategy_funcs.get(op)
        classic = self.prop.op_strategy_funcs.get(op)
        if single is not None:
            rep = tuple(Replicate() for _ in self.mesh_shape)
            strat_of = {n: self._op_strategy(n, [rep]) for n in inputs}
            specs = self._single_dim(op, single, self._schema(node, strat_of), out_meta)
        elif classic is not None:
            specs = self._classic(node, classic, inputs, cand_lists)
        else:
            raise UnsupportedOpError(
                f"no sharding rule for op {op} at node '{node.name}' "
                f"(DTensor has none; add a rule in torchtitan/autoparallel/strategies/table.py)"
            )
        return self._to_strategies(node, specs, inputs, n_out)

    def _collective_op(self, node, rule: CollectiveOp, inputs) -> list[Strategy]:
        """Every combination of the op's per-mesh-dim options (ops/collective_ops.py) with
        at most one collective dim and no empty shard."""
        in_vals = [n.meta["val"] for n in inputs]
        val = node.meta["val"]
        out_vals = list(val) if isinstance(val, (list, tuple)) else [val]
        per_dim = [rule.options(in_vals, out_vals, n) for n in self.mesh_shape]
        out = []
        for combo in itertools.product(*per_dim):
            if sum(o.collective for o in combo) > 1:
                continue
            outs = tuple(tuple(o.out[i] for o in combo) for i in range(len(out_vals)))
            ins = tuple(tuple(o.ins[i] for o in combo) for i in range(len(in_vals)))
            if all(
                P.is_valid(v.shape, pl, self.mesh_shape)
                for v, pl in zip(out_vals + in_vals, outs + ins)
            ):
                out.append(Strategy(outs, ins))
        return out

    def _single_dim(self, op, info, schema: OpSchema, out_meta) -> list[OpSpec]:
        func = info.func if isinstance(info, SingleDimStrategyInfo) else info
        uneven = info.allow_uneven_sharding if isinstance(info, SingleDimStrategyInfo) else False
        rules = func(op, schema.args_meta, schema.kwargs_meta)
        n_in = get_num_tensor_inputs(schema)
        n_out = (
            len(rules[0]) - n_in if rules else (len(out_meta) if isinstance(out_meta, tuple) else 1)
        )
        rules = insert_single_dim_replication_strategy(rules, n_out, n_in, out_meta)
        rules = fill_single_dim_strategy_placeholders({Shard(0)}, rules)
        strat = expand_to_full_mesh_op_strategy(
            self.mesh,
            schema,
            rules,
            output_tensor_meta=out_meta,
            input_index=n_out,
            allow_uneven_sharding=uneven,
        )
        return list(strat.strategies)

    def _classic(self, node, func, inputs, cand_lists) -> list[OpSpec]:
        """Union of the rule's answer for all candidates at once and per candidate of input 0.

        Many classic rules "follow" their input (stack, view, reductions): given a set of
        candidates they answer for one of them, or raise.  Asking once per placement of the
        first input (other inputs offered the same placement when they can take it, else
        Replicate) recovers every option.
        """
        strat_of = {n: self._op_strategy(n, c) for n, c in zip(inputs, cand_lists)}
        specs: list[OpSpec] = []
        first_err = None
        try:
            specs.extend(func(self._schema(node, strat_of)).strategies)
        except Exception as e:
            first_err = e
        rep = tuple(Replicate() for _ in self.mesh_shape)
        for pl in cand_lists[0]:
            one = {}
            for n, c in zip(inputs, cand_lists):
                one[n] = self._op_strategy(n, [pl] if pl in c else [rep])
            one[inputs[0]] = self._op_strategy(inputs[0], [pl])
            try:
                specs.extend(func(self._schema(node, one)).strategies)
            except Exception as e:
                first_err = first_err or e
                continue
        if not specs:
            msg = str(first_err).splitlines()[0] if first_err and str(first_err) else ""
            raise UnsupportedOpError(
                f"DTensor rule for op {node.target} failed at node '{node.name}': "
                f"{type(first_err).__name__}: {msg}"
            )
        return specs

    @staticmethod
    def _plain(pl) -> bool:
        # only Shard/Replicate/Partial(sum|avg); _StridedShard (a flattened view of a sharded dim)
        # and max/min partials (from amax-style reductions) are dropped to keep the program small
        return all(
            type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op in ("sum", "avg"))
            for p in pl
        )

    def _to_strategies(self, node, specs: list[OpSpec], inputs, n_out) -> list[Strategy]:
        in_vals = [n.meta["val"] for n in inputs]
        out_val = node.meta["val"]
        out_vals = list(out_val) if isinstance(out_val, (list, tuple)) else [out_val]
        seen: dict[Strategy, None] = {}
        for spec in specs:
            outs = spec.output_specs
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if len(outs) != len(out_vals):
                continue
            out_pls: list[P.Placements | None] = []
            ok = True
            for o, v in zip(outs, out_vals):
                if o is None or not isinstance(v, torch.Tensor):
                    out_pls.append(None)
                    continue
                pl = P.normalize(o.placements, v.ndim)
                if not self._plain(pl) or not P.is_valid(v.shape, pl, self.mesh_shape):
                    ok = False
                    break
                out_pls.append(pl)
            if not ok:
                continue
            if spec.input_specs is None:
                in_pls = [out_pls[0]] * len(inputs)
            else:
                if len(spec.input_specs) != len(inputs):
                    continue
                in_pls = [
                    P.normalize(s.placements, v.ndim) if s is not None else None
                    for s, v in zip(spec.input_specs, in_vals)
                ]
            if any(
                pl is not None
                and (not self._plain(pl) or not P.is_valid(v.shape, pl, self.mesh_shape))
                for pl, v in zip(in_pls, in_vals)
            ):
                continue
            seen.setdefault(Strategy(tuple(out_pls), tuple(in_pls)), None)
        # computing on full tensors everywhere is always correct; make sure it is an option
        rep = tuple(Replicate() for _ in self.mesh_shape)
        all_rep = Strategy(
            tuple(rep if isinstance(v, torch.Tensor) else None for v in out_vals),
            tuple(rep for _ in inputs),
        )
        if not any(
            all(p is None or p == rep for p in st.out) and all(p == rep for p in st.ins)
            for st in seen
        ):
            seen.setdefault(all_rep, None)
        return list(seen)


def _zero_costs(src_strategy, dst_spec) -> list[float]:
    return [0.0] * len(src_strategy.strategies)


@contextlib.contextmanager
def _no_dtensor_costs():
    """DTensor's rules price every (input strategy, requirement) pair with its own
    redistribution model while enumerating; we price edges ourselves (cost.py), so that work
    (most of enumeration time on large meshes) is skipped by answering zeros."""
    import importlib

    mods = []
    for name in REDISTRIBUTE_COST_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a strategy module a torch release dropped: nothing to patch
            continue
        if getattr(mod, "generate_redistribute_costs", None) is not None:
            mods.append((mod, mod.generate_redistribute_costs))
            mod.generate_redistribute_costs = _zero_costs
    try:
        yield
    finally:
        for mod, fn in mods:
            mod.generate_redistribute_costs = fn


def build_strategies(tg: TracedGraph, mesh: DeviceMesh, memo: dict | None = None) -> StrategyTable:
    """The strategy table of `tg` on `mesh`.  `memo` (filled as it goes) may be shared by the
    builds of one graph on meshes of the same shape: an op's strategies depend on the mesh's
    shape only (the mesh search plans several meshes of one shape, e.g. dp_shard 2 x tp 2
    and dp_replicate 2 x tp 2)."""
    with _no_dtensor_costs():
        return StrategyBuilder(tg, mesh, memo).build()
