"""Every sharding strategy the planner may pick for an indexing op, run on real shards: run with

    torchrun --standalone --nproc_per_node=4 tests/integration_tests/strategy_check.py

The joint graph of `Indexing` (autoparallel_models.py: `index.Tensor` with two index tensors,
`index_put` with accumulation, `gather`, `scatter_add`, and their backward ops) is traced and
run once in one process for the value of every node.  Then, on a (4,) and a (2, 2) mesh, for
each indexing node and each of its strategies, every rank runs the op on its local shards of
the inputs (placed as the strategy asks; a `Partial` input is held by one rank of that mesh
dim, zeros elsewhere) — exactly what the lowered executor does — and the output, read as a
DTensor with the strategy's output placement, must equal the one-process value.
Prints one line per (mesh, op) and `ALL OK`; exits non-zero on the first failure.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from autoparallel_models import Indexing
from rank_checks import check, run_checks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torchtitan.autoparallel.strategies.table import _tensor_input_nodes, build_strategies
from torchtitan.autoparallel.trace.joint import trace_joint

aten = torch.ops.aten
INDEXING_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.gather.default,
    aten.scatter_add.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.index_select.default,
    aten._unsafe_index_put.default,
}


def node_values(tg, model: torch.nn.Module, x: torch.Tensor) -> dict[fx.Node, torch.Tensor]:
    """Run the joint graph in one process on real tensors; the value of every node."""
    by_node = {n: p for f, n in tg.params.items() for fq, p in model.named_parameters() if fq == f}
    by_node.update(
        {n: b for f, n in tg.buffers.items() for fq, b in model.named_buffers() if fq == f}
    )
    by_node[tg.inputs[0]] = x
    g = torch.Generator().manual_seed(3)
    for t in tg.tangents:
        if t is not None:
            by_node[t] = torch.randn(t.meta["val"].shape, generator=g)
    env: dict[fx.Node, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            env[n] = out
            return out

    args = [by_node[n].detach() for n in tg.gm.graph.nodes if n.op == "placeholder"]
    Recorder(tg.gm).run(*args)
    return env


def local_input(value: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's piece of `value` under `placements` (Partial: rank 0 of that dim holds it)."""
    plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    local = distribute_tensor(value, mesh, plain, src_data_rank=None).to_local()
    coord = mesh.get_coordinate()
    for d, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[d] != 0:
            local = torch.zeros_like(local)
    return local


def check_node(node: fx.Node, ns, env, mesh) -> tuple[int, int, list[str]]:
    """(strategies checked, of which with a sharded input, failures)."""
    inputs = _tensor_input_nodes(node)
    checked = sharded = 0
    bad = []
    for st in ns.strategies:
        if st.out[0] is None:
            continue
        local = {n: local_input(env[n], mesh, pl) for n, pl in zip(inputs, st.ins)}

        def arg(a, local=local):
            if isinstance(a, fx.Node):
                return local.get(a, env.get(a))
            if isinstance(a, (list, tuple)):
                return type(a)(arg(x, local) for x in a)
            return a

        out = node.target(
            *[arg(a) for a in node.args], **{k: arg(v) for k, v in node.kwargs.items()}
        )
        expect = env[node]
        got = DTensor.from_local(
            out, mesh, st.out[0], run_check=False, shape=expect.shape, stride=expect.stride()
        ).full_tensor()
        checked += 1
        sharded += any(isinstance(p, Shard) for pl in st.ins for p in pl)
        if not torch.allclose(got, expect, atol=1e-6, rtol=1e-6):
            bad.append(
                f"ins {st.ins} out {st.out[0]}: max err {(got - expect).abs().max().item():.2e}"
            )
    return checked, sharded, bad


def main() -> None:
    with torch.device("meta"):
        meta = Indexing()
    model = Indexing()
    torch.manual_seed(0)
    model.init_weights()
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    tg = trace_joint(meta, lambda: torch.zeros(4, 8, 32))
    env = node_values(tg, model, x)
    for shape in ((4,), (2, 2)):
        mesh = init_device_mesh("cpu", shape)
        table = build_strategies(tg, mesh)
        per_op: dict[str, list[int]] = {}
        for node in tg.gm.graph.nodes:
            if node.op != "call_function" or node.target not in INDEXING_OPS:
                continue
            checked, sharded, bad = check_node(node, table.nodes[node], env, mesh)
            tag = f"strategies/{'x'.join(map(str, shape))} {node.target} at {node.name}"
            check(tag, not bad, "; ".join(bad[:2]))
            counts = per_op.setdefault(str(node.target), [0, 0])
            counts[0] += checked
            counts[1] += sharded
        for op, (checked, sharded) in sorted(per_op.items()):
            check(
                f"strategies/{'x'.join(map(str, shape))} {op}",
                sharded > 0,
                f"{checked} strategies equal one process, {sharded} with a sharded input",
            )
        ops = set(per_op)
        check(
            f"strategies/{'x'.join(map(str, shape))} covers index, index_put, gather, scatter_add",
            {
                "aten.index.Tensor",
                "aten.index_put.default",
                "aten.gather.default",
                "aten.scatter_add.default",
            }
            <= ops,
            str(sorted(ops)),
        )


if __name__ == "__main__":
    run_checks(main)
