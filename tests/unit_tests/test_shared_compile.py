"""Compiled graphs that name no rank (execute/shared_compile.py): the mesh's process groups
in a lowered graph are renamed by role, each name resolving to this process's own group.
(Replicate -> Shard without the rank: test_local_shards.py.)"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.autoparallel.execute.shared_compile import name_groups_by_role
from torchtitan.torch_private import resolve_process_group


def _graph(dp_group: str, tp_group: str) -> fx.GraphModule:
    """all_reduce over `dp_group`, then all_gather over `tp_group` (kwarg), as lowering
    writes them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(
        torch.ops._c10d_functional.all_reduce.default, (x, "sum", dp_group)
    )
    gathered = graph.call_function(
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        (reduced, 2),
        {"group_name": tp_group},
    )
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _group_names(gm: fx.GraphModule) -> list[str]:
    return [
        n.args[2] if len(n.args) > 2 else n.kwargs["group_name"]
        for n in gm.graph.nodes
        if n.op == "call_function" and "wait" not in str(n.target)
    ]


def test_the_mesh_groups_are_named_by_role_and_resolve_to_this_process_groups(fake_world):
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        gm = _graph(dp.group_name, tp.group_name)
        assert name_groups_by_role(gm, mesh) == 2
        assert _group_names(gm) == ["rank-free:dp/2#0", "rank-free:tp/2#0"]
        assert "rank-free:tp/2#0" in gm.code  # recompiled
        assert resolve_process_group("rank-free:dp/2#0").group_name == dp.group_name
        assert resolve_process_group("rank-free:tp/2#0").group_name == tp.group_name

        # the same groups keep their names; a second mesh's groups get the next ones
        again = _graph(dp.group_name, tp.group_name)
        name_groups_by_role(again, mesh)
        assert again.code == gm.code
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        third = _graph(other.get_group("dp").group_name, other.get_group("tp").group_name)
        name_groups_by_role(third, other)
        assert _group_names(third) == ["rank-free:dp/2#1", "rank-free:tp/2#1"]
        assert resolve_process_group("rank-free:tp/2#1").group_name == (
            other.get_group("tp").group_name
        )

        # a group over the same ranks as a mesh dim's (an equal mesh made earlier, which
        # DTensor may hand out) takes that dim's role name
        earlier = _graph(dp.group_name, tp.group_name)
        assert name_groups_by_role(earlier, other) == 2
        assert _group_names(earlier) == ["rank-free:dp/2#1", "rank-free:tp/2#1"]

        # a group that is not the mesh's, or over other ranks (the world), keeps its name
        world = torch.distributed.distributed_c10d._get_default_group().group_name
        outside = _graph("no-such-group", tp.group_name)
        assert name_groups_by_role(outside, mesh) == 1
        assert _group_names(outside) == ["no-such-group", "rank-free:tp/2#0"]
        assert name_groups_by_role(_graph(world, world), mesh) == 0


def test_the_role_names_are_registered_again_in_a_new_world(fake_world):
    """A process group's world ended and a new one began (c10d forgets every name): the
    role name is registered again for the group that now has its c10d name."""
    for _ in range(2):
        with fake_world(2):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            gm = _graph(mesh.get_group("dp").group_name, mesh.get_group("dp").group_name)
            name_groups_by_role(gm, mesh)
            name = _group_names(gm)[0]
            assert resolve_process_group(name).group_name == mesh.get_group("dp").group_name
