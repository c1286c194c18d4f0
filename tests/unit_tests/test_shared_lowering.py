"""Ranks that run the same local program share one lowering (execute/shared_lowering.py).

The protocol runs here on threads that share a `HashStore` (the 4-rank numerics tests run it
on gloo ranks, where it counts how many ranks loaded another's graphs); the rule that keeps
ranks with shards of other shapes apart runs on a fake 4-rank group.
"""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from autoparallel_models import Elementwise, MLPStack
from test_executor import lowered
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from torchtitan.autoparallel import AutoParallel
from torchtitan.autoparallel.errors import PlannerError
from torchtitan.autoparallel.execute import shared_lowering as sl
from torchtitan.autoparallel.execute.lower import Partition
from torchtitan.autoparallel.graph import graph_bytes


def _partition(scale: float) -> tuple[Partition, dict]:
    def fwd(x):
        return torch.ops.aten.mul.Tensor(x, scale)

    def bwd(g):
        return torch.ops.aten.mul.Tensor(g, scale)

    graphs = [fx.symbolic_trace(f) for f in (fwd, bwd)]
    part = Partition(graphs[0], graphs[1], 1, ["w"], [], [None], [None])
    return part, {"fwd": {}, "bwd": {}}


def _run_ranks(roles, lower_for):
    """Run `lowered_once` for each role on a thread; results (or exceptions) by index."""
    store = dist.HashStore()
    results: list = [None] * len(roles)
    lowered = []

    def rank(i, role):
        def lower():
            lowered.append(i)
            return lower_for(i)

        try:
            results[i] = sl.lowered_once(sl.LoweringKey("k", role, store), lower)
        except Exception as e:  # the test looks at what each rank raised
            results[i] = e

    threads = [threading.Thread(target=rank, args=(i, r)) for i, r in enumerate(roles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results, sorted(lowered)


ROLES = [sl.REFERENCE, sl.READER, sl.READER, sl.WITNESS]


def test_readers_load_the_reference_graphs_when_the_witness_agrees():
    results, lowered = _run_ranks(ROLES, lambda i: _partition(2.0))
    assert lowered == [0, 3]  # the reference and the witness, nobody else
    assert [stats["loaded"] for _part, stats in results] == [False, True, True, False]
    x = torch.arange(4.0)
    for part, _stats in results:
        assert torch.equal(part.fwd(x), 2 * x) and torch.equal(part.bwd(x), 2 * x)
        assert part.grad_names == ["w"]
    # the ranks that loaded run the reference's code (the same inductor cache keys)
    assert {r[0].fwd.code for r in results} == {results[0][0].fwd.code}


def test_every_rank_lowers_its_own_when_the_witness_differs():
    # a rank-dependent constant (as a chunk index fixed at trace time would be)
    results, lowered = _run_ranks(ROLES, lambda i: _partition(float(i)))
    assert lowered == [0, 1, 2, 3]
    assert not any(stats["loaded"] for _part, stats in results)
    x = torch.ones(2)
    assert [float(r[0].fwd(x)[0]) for r in results] == [0.0, 1.0, 2.0, 3.0]


def test_a_failed_lowering_stops_the_waiting_ranks():
    def lower(i):
        if i == 0:
            raise ValueError("no rule for op foo")
        return _partition(1.0)

    results, _ = _run_ranks(ROLES, lower)
    assert isinstance(results[0], ValueError)
    for r in results[1:3]:
        assert isinstance(r, PlannerError) and "no rule for op foo" in str(r), r


def _interp(mesh, hidden):
    with torch.device("meta"):
        model = MLPStack(hidden=hidden, n_layers=1)
    with AutoParallel(model, lambda: torch.zeros(16, 8, 32), mesh, cost_model="h100") as autop:
        autop.add_parameter_constraint("layers.0.0.weight", (Shard(0),))
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        pm = autop.apply_placement(autop.optimize_placement())
    return pm._ap_executor.interp


@pytest.mark.parametrize("hidden, uneven", [(64, set()), (30, {0})])
def test_a_mesh_dim_that_shards_a_value_unevenly_is_found(fake_world, hidden, uneven):
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        assert sl.uneven_mesh_dims(_interp(mesh, hidden)) == uneven


def test_a_lowered_graph_loads_as_the_same_program(fake_world):
    """graph_bytes: nodes, their names (so the code), ops and a constant the graph reads
    survive."""
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        lp = lowered(mesh, Elementwise, torch.randn(16, 8, 32))
    graphs = (lp.partition.fwd, lp.partition.bwd)
    assert any(n.op == "get_attr" for gm in graphs for n in gm.graph.nodes)
    for gm in graphs:
        loaded, _ = graph_bytes.loads(graph_bytes.dumps(gm))
        assert str(loaded.graph) == str(gm.graph)  # every node, name, target and argument
        for n in loaded.graph.nodes:
            if n.op == "get_attr":
                assert torch.equal(getattr(loaded, n.target), getattr(gm, n.target))
