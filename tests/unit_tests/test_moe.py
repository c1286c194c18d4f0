"""The mixture-of-experts pieces in one process: the routed-experts op, its planner layouts
and their prices, the expert-parallel constraint, the repeated-block runs of an MoE decoder,
and the checks on an expert-parallel degree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from autoparallel_models import tiny_moe
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan.autoparallel import AutoParallel, ConstraintError, InfeasiblePlanError
from torchtitan.autoparallel.cost.model import CostModel, Estimator
from torchtitan.autoparallel.graph import placements as P
from torchtitan.autoparallel.ops.experts import LOAD_IMBALANCE
from torchtitan.autoparallel.trace.repeat import find_repeated_blocks
from torchtitan.config.resolve import check_expert_parallel
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismConfigError
from torchtitan.errors import UserInputError
from torchtitan.models.deepseek_v3.args import moe_configs
from torchtitan.models.deepseek_v3.model import MoETransformer
from torchtitan.models.llama3.args import llama3_configs
from torchtitan.ops.routed_experts import routed_experts

FAKE_WORLD_SIZE = 4
pytestmark = pytest.mark.usefixtures("module_fake_world")


def _experts(tokens=12, k=2, n_experts=4, dim=8, hidden=12, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g, dtype=dtype)
    weights = torch.rand(tokens, k, generator=g, dtype=dtype)
    indices = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    w = [
        torch.randn(n_experts, hidden, dim, generator=g, dtype=dtype),
        torch.randn(n_experts, dim, hidden, generator=g, dtype=dtype),
        torch.randn(n_experts, hidden, dim, generator=g, dtype=dtype),
    ]
    return x, weights, indices, w


def _loop(x, weights, indices, w1, w2, w3):
    """One token and one chosen expert at a time."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for k in range(indices.shape[1]):
            e = indices[t, k]
            acc = acc + weights[t, k] * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
        rows.append(acc)
    return torch.stack(rows)


def test_routed_experts_equals_a_loop_over_tokens_forward_and_backward():
    x, weights, indices, w = _experts()
    leaves = [t.requires_grad_() for t in (x, weights, *w)]
    got, want = routed_experts(x, weights, indices, *w), _loop(x, weights, indices, *w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_traces_with_fake_tensors_in_fp32_and_bf16(dtype):
    """torch._grouped_mm's fake kernel demands bf16; the op's own accepts any float dtype."""
    x, weights, indices, w = _experts(dtype=dtype)

    def step(indices, x, weights, w1, w2, w3):
        out = routed_experts(x, weights, indices, w1, w2, w3)
        return torch.autograd.grad(out.sum(), (x, weights, w1, w2, w3))

    leaves = [t.requires_grad_() for t in (x, weights, *w)]
    gm = make_fx(step, tracing_mode="fake")(indices, *leaves)
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"titan.routed_experts.default", "titan.routed_experts_backward.default"} <= targets


def _plan(mesh_shape, names, mp_policy=None, expert_dim=None, **moe):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = tiny_moe(**moe)
    pin = tuple(Shard(0) if n != "tp" else Replicate() for n in names)
    with AutoParallel(
        model, lambda: torch.randint(0, 256, (4, 16)), mesh, mp_policy=mp_policy
    ) as autop:
        autop.add_parameter_memory_constraint()
        autop.add_input_constraints([pin])
        autop.add_output_constraints([pin])
        if expert_dim is not None:
            autop.add_expert_parallel_constraint(expert_dim)
        return autop.optimize_placement(), autop


def _expert_nodes(plan):
    return {n: d for n, d in plan.nodes.items() if d["op"].startswith("titan.routed_experts")}


def test_planner_offers_four_expert_layouts_and_expert_parallelism_only_where_experts_divide():
    _plan_, autop = _plan((4,), ("dp",))
    table = autop._strategies().table
    node = next(n for n in table.nodes if n.name == "routed_experts")
    w1 = [P.fmt(s.ins[3]) for s in table.nodes[node].strategies]
    assert sorted(w1) == ["R", "R", "S(0)", "S(1)"]  # replicated, tokens, experts, hidden
    mesh3 = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))  # 8 experts on 3 ranks
    autop3 = autop.on_mesh(mesh3)
    table3 = autop3._strategies().table
    node3 = next(n for n in table3.nodes if n.name == "routed_experts")
    assert "S(0)" not in [P.fmt(s.ins[3]) for s in table3.nodes[node3].strategies]


def test_expert_parallel_constraint_splits_experts_and_prices_the_all_to_alls():
    plan, autop = _plan((2, 2), ("dp", "ep"), expert_dim="ep")
    nodes = _expert_nodes(plan)
    assert len(nodes) == 4  # two MoE layers, forward and backward
    for d in nodes.values():  # experts split over ep, tokens over both dims
        assert d["ins"][-1].split(",")[1] == "S(0)" and d["ins"][-2].split(",")[1] == "S(0)"
    # the op's price includes its all-to-alls: 3 calls forward, rows there and back
    est = Estimator(CostModel.for_device("h100"), (2, 2))
    link = est.links[1]
    local_rows = (4 * 16 // 4) * 2 * LOAD_IMBALANCE
    want = 3 * link.latency_us + 0.5 * 2 * local_rows * 64 * 4 / (link.bw_gbps * 1e3)
    x = torch.empty(64, 64)
    ins = [x, torch.empty(64, 2), torch.empty(64, 2, dtype=torch.long), *[torch.empty(8, 1, 1)] * 3]
    pls = [P.parse("S(0),S(0)")] * 3 + [P.parse("R,S(0)")] * 3
    assert est._in_op_comm_us(torch.ops.titan.routed_experts.default, ins, pls) == pytest.approx(
        want
    )


def test_expert_parallel_constraint_that_cannot_hold_names_itself():
    with pytest.raises((ConstraintError, InfeasiblePlanError), match="experts split over mesh"):
        _plan((4,), ("dp",), expert_dim="dp", n_routed_experts=6)
    with pytest.raises(ConstraintError, match="mesh dims are"):
        _plan((4,), ("dp",), expert_dim="ep")


def test_moe_plans_with_bf16_parameters():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan, _ = _plan((4,), ("dp",), mp_policy=mp)
    assert len(_expert_nodes(plan)) == 4


def test_moe_decoder_layers_are_two_runs_traced_shallow():
    """3 dense layers then 58 MoE layers (DeepSeek-V3 671B): one container with two runs;
    the shallow copy keeps the dense ones and the MoE run's first, second and last."""
    with torch.device("meta"):
        model = MoETransformer(moe_configs["671B"])
    (blocks,) = find_repeated_blocks(model)
    assert blocks.runs == ((0, 3), (3, 58))
    assert blocks.kept == (0, 1, 2, 3, 4, 60)
    assert [blocks.representative(i) for i in (0, 2, 3, 4, 30, 59, 60)] == [0, 2, 3, 4, 4, 4, 5]
    assert [blocks.multiplicity(j) for j in range(6)] == [1, 1, 1, 1, 56, 1]


def test_expert_parallel_degree_is_carved_from_the_shard_ranks():
    dims = ParallelDims(dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=2)
    assert dims.ep_enabled
    with pytest.raises(ParallelismConfigError, match="must divide data_parallel_shard_degree 4"):
        ParallelDims(dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=3)
    args = dataclasses.replace(moe_configs["debugmodel"], n_routed_experts=6)
    with pytest.raises(UserInputError, match="does not divide the 6 routed experts"):
        check_expert_parallel(args, 4, "deepseek_v3 debugmodel")
    with pytest.raises(UserInputError, match="llama3 debugmodel has no routed experts"):
        check_expert_parallel(llama3_configs["debugmodel"], 2, "llama3 debugmodel")
    with pytest.raises(ValueError, match="top_k 9 must be between 1 and n_routed_experts 8"):
        dataclasses.replace(moe_configs["debugmodel"], top_k=9)


def test_expert_biases_take_sign_steps_against_their_load_outside_adamw():
    from torchtitan.config.job_config import JobConfig
    from torchtitan.models.deepseek_v3.balancing import build_moe_optimizers
    from torchtitan.models.deepseek_v3.model import Router

    torch.manual_seed(0)
    model = tiny_moe(load_balancing="bias", score_func="sigmoid", route_norm=True)
    model.init_weights()
    routers = [m for m in model.modules() if isinstance(m, Router)]
    chosen = {}
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: chosen.__setitem__(mod, out[2]))
    opt = build_moe_optimizers([model], JobConfig())
    adam = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(r.expert_bias) in adam for r in routers)
    tokens = torch.randint(0, 256, (4, 16))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    for r in routers:
        load = torch.bincount(chosen[r].flatten(), minlength=8).float()
        want = -r.bias_update_rate * torch.sign(load - load.mean())
        assert torch.equal(r.expert_bias.detach(), want) and r.expert_bias.grad is None
    assert any(r.expert_bias.abs().sum() > 0 for r in routers)


def test_mesh_search_tries_every_expert_parallel_degree_that_divides():
    from torchtitan.distributed.parallel_dims import expert_parallel_candidates
    from torchtitan.experiments.auto_parallel.mesh_choice import with_expert_parallel

    assert expert_parallel_candidates(8, 8, "auto") == [1, 2, 4, 8]
    assert expert_parallel_candidates(8, 6, "auto") == [1, 2]
    assert expert_parallel_candidates(8, 0, "auto") == [1]  # a dense model
    assert expert_parallel_candidates(6, 8, 4) == []
    keep, skipped = with_expert_parallel(
        [{"dp_replicate": 1, "dp_shard": 4, "tp": 1}, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}],
        "auto",
        8,
    )
    assert [(d["dp_shard"], d["tp"], d["ep"]) for d in keep] == [
        (4, 1, 1),
        (4, 1, 2),
        (4, 1, 4),
        (2, 2, 1),
        (2, 2, 2),
    ]
    assert not skipped
