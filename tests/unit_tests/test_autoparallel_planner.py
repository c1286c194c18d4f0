"""Planner unit tests: one process, fake process group, small models.

Outcomes (FSDP-like, DDP-like, Megatron-like) come from the cost model and constraints; nothing
here tells the planner which layout to pick.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from autoparallel_models import GPT2Block, MLPStack
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.autoparallel import (
    DEVICES,
    AutoParallel,
    ConstraintError,
    CostModel,
    InfeasiblePlanError,
    LinkSpec,
    Plan,
    PlannerError,
    UnsupportedOpError,
)
from torchtitan.autoparallel.plan.display import plan_table

WORLD = 8


FAKE_WORLD_SIZE = WORLD
pytestmark = pytest.mark.usefixtures("module_fake_world")


class Block(nn.Module):
    """Pre-norm transformer block: attention + SwiGLU FFN."""

    def __init__(self, dim=64, heads=4, hidden=128):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.ffn = SwiGLU(dim, hidden)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = x + self.wo(a)
        return h + self.ffn(self.norm2(h))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def meta(cls, *a, **kw):
    with torch.device("meta"):
        return cls(*a, **kw)


def plan_for(model, input_shape, mesh, high, cost_model="h100", pins=None, dtype=torch.float32):
    with AutoParallel(
        model, lambda: torch.randn(*input_shape, dtype=dtype), mesh, cost_model=cost_model
    ) as autop:
        autop.add_parameter_memory_constraint(high=high)
        pin = pins or tuple(Shard(0) if i == 0 else Replicate() for i in range(mesh.ndim))
        autop.add_input_constraints([pin])
        autop.add_output_constraints([pin])
        return autop.optimize_placement(), autop


def test_block_fsdp_with_small_budget():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    plan, _ = plan_for(meta(Block), (16, 32, 64), mesh, high=1 / WORLD)
    for fqn, pl in plan.params.items():
        assert pl.startswith("S("), f"{fqn} should be sharded, got {pl}"
    assert plan.predicted["param_fraction"] == pytest.approx(1 / WORLD)
    assert plan.grads == plan.params  # gradients leave in the parameters' placement


def test_block_ddp_without_budget():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    plan, _ = plan_for(meta(Block), (16, 32, 64), mesh, high=1.0)
    assert set(plan.params.values()) == {"R"}, plan.params
    assert plan.inputs == ["S(0)"] and plan.outputs == ["S(0)"]


def test_swiglu_megatron_when_tp_is_cheap():
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    fast_tp = CostModel(device=DEVICES["h100"], links=[LinkSpec(20.0, 25.0), LinkSpec(1.0, 5000.0)])
    plan, _ = plan_for(
        meta(SwiGLU, 1024, 4096), (8, 512, 1024), mesh, high=1 / 8, cost_model=fast_tp
    )
    tp = {f: pl.split(",")[1] for f, pl in plan.params.items()}
    assert tp == {"w1.weight": "S(0)", "w3.weight": "S(0)", "w2.weight": "S(1)"}, plan.params


def test_plan_table_json_roundtrip_and_apply(tmp_path):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    plan, autop = plan_for(meta(MLPStack), (8, 4, 32), mesh, high=None)
    text = plan_table(plan)
    assert "layers.0.0.weight" in text and "dp(2)" in text and "communication" in text
    for stage in ("trace", "strategies", "build", "solve"):
        assert stage in plan.timings
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    pm = autop.apply_placement(loaded)
    assert "apply" in loaded.timings
    names = [n for n, _ in pm.named_parameters()]
    assert names == [n for n, _ in MLPStack().named_parameters()]
    for n, p in pm.named_parameters():
        assert (
            isinstance(p, DTensor)
            and ",".join("R" if isinstance(x, Replicate) else f"S({x.dim})" for x in p.placements)
            == plan.params[n]
        )
    assert isinstance(pm, MLPStack)


def test_gpt2_block_plans_on_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with AutoParallel(meta(GPT2Block), lambda: torch.randint(0, 64, (8, 16)), mesh) as autop:
        autop.add_parameter_memory_constraint()
        autop.add_input_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
    assert plan.solver["optimal"]
    assert plan.inputs == ["S(0),R"]
    assert all(pl != "R,R" for pl in plan.params.values())


# ---------------------------------------------------------------- bad input
def test_model_not_on_meta():
    mesh = init_device_mesh("cpu", (WORLD,))
    with pytest.raises(PlannerError, match="meta device: parameter 'w1.weight'"):
        AutoParallel(SwiGLU(8, 16), lambda: torch.randn(4, 8), mesh)


def test_pin_with_wrong_number_of_mesh_dims():
    mesh = init_device_mesh("cpu", (2, 4))
    with AutoParallel(meta(SwiGLU, 8, 16), lambda: torch.randn(4, 8), mesh) as autop:
        with pytest.raises(
            ConstraintError, match=r"input 0: 1 placement\(s\) S\(0\) for a 2-D mesh"
        ):
            autop.add_input_constraints([(Shard(0),)])


def test_contradictory_pins():
    mesh = init_device_mesh("cpu", (WORLD,))
    with AutoParallel(meta(SwiGLU, 64, 128), lambda: torch.randn(16, 64), mesh) as autop:
        autop.add_parameter_memory_constraint(high=1 / WORLD)
        autop.add_parameter_constraint("w2.weight", (Replicate(),))
        autop.add_input_constraints([(Shard(0),)])
        with pytest.raises(InfeasiblePlanError) as e:
            autop.optimize_placement()
    msg = str(e.value)
    assert "parameter 'w2.weight' pinned to R" in msg and "parameter memory budget" in msg
    assert "input 0" not in msg and "\n" not in msg


class Renormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.renorm(self.lin(x), 2, 0, 1.0)


def test_unsupported_op_is_named():
    mesh = init_device_mesh("cpu", (WORLD,))
    with AutoParallel(meta(Renormed), lambda: torch.randn(16, 8), mesh) as autop:
        with pytest.raises(UnsupportedOpError, match=r"aten\.renorm\.default at node 'renorm'"):
            autop.optimize_placement()


def test_apply_rejects_wrong_local_input_shape():
    mesh = init_device_mesh("cpu", (WORLD,))
    plan, autop = plan_for(meta(SwiGLU, 16, 32), (16, 16), mesh, high=None)
    pm = autop.apply_placement(plan)
    pm.to_empty(device="cpu")
    with pytest.raises(
        PlannerError, match=r"input 0 has local shape \(16, 16\), expected \(2, 16\)"
    ):
        pm(torch.randn(16, 16))


def test_mixed_precision_gathers_low_and_reduces_high():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with AutoParallel(
        meta(MLPStack, 512, 2048), lambda: torch.randn(32, 512, 512), mesh, mp_policy=mp
    ) as autop:
        autop.add_parameter_memory_constraint()
        autop.add_input_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        tg = autop.tg
    for fqn, pnode in tg.params.items():
        casts = [u for u in pnode.users if u.target == torch.ops.aten._to_copy.default]
        assert casts and casts[0].meta["val"].dtype == torch.bfloat16
        # the cast reads the parameter where it lives: any gather happens after it, in bf16
        assert plan.nodes[casts[0].name]["ins"] == [plan.params[fqn]]
        g = tg.grads[fqn]
        assert g.target == torch.ops.aten._to_copy.default and g.meta["val"].dtype == torch.float32
        if pnode.meta["val"].ndim == 2:
            # the gradient is still a partial sum after the fp32 cast: reduced in fp32
            assert plan.nodes[g.name]["out"] == ["P(sum)"], (fqn, plan.nodes[g.name])
            assert plan.grads[fqn] == plan.params[fqn]


def test_plan_from_another_graph_is_rejected():
    mesh = init_device_mesh("cpu", (WORLD,))
    plan, _ = plan_for(meta(SwiGLU, 16, 32), (16, 16), mesh, high=None)
    with AutoParallel(meta(MLPStack), lambda: torch.randn(8, 4, 32), mesh) as other:
        with pytest.raises(PlannerError, match="different traced graph"):
            other.apply_placement(plan)


def test_requires_context_manager():
    mesh = init_device_mesh("cpu", (WORLD,))
    autop = AutoParallel(meta(SwiGLU, 8, 16), lambda: torch.randn(8, 8), mesh)
    with pytest.raises(PlannerError, match="context manager"):
        autop.optimize_placement()


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_buffer_mutation_is_named():
    mesh = init_device_mesh("cpu", (WORLD,))
    with pytest.raises(PlannerError, match=r"InputMutationAOTOutput \(bn\.running_mean\)"):
        with AutoParallel(meta(WithBatchNorm), lambda: torch.randn(8, 3, 8, 8), mesh):
            pass


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if (h > 0).all():  # a Python branch on tensor values
            return h * 2
        return h


class AsksIfCompiling(nn.Module):
    """Like transformers' mask helpers: skip a data-dependent check when being traced."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if not torch.compiler.is_compiling() and (h > 0).all():
            return h * 2
        return h


def test_data_dependent_branch_names_op_and_model_line():
    mesh = init_device_mesh("cpu", (WORLD,))
    with pytest.raises(PlannerError) as err:
        with AutoParallel(meta(BranchesOnData), lambda: torch.randn(16, 8), mesh):
            pass
    msg = str(err.value)
    assert "data-dependent op aten._local_scalar_dense.default" in msg
    assert f"{__file__}:" in msg and "if (h > 0).all():" in msg


def test_model_code_sees_a_trace_as_compiling():
    mesh = init_device_mesh("cpu", (WORLD,))
    with AutoParallel(meta(AsksIfCompiling), lambda: torch.randn(16, 8), mesh) as autop:
        autop.optimize_placement()
    assert not torch.compiler.is_compiling()  # and the flag is restored afterwards


# ------------------------------------------------------------------ repeated blocks (repeat.py)
def test_deep_stack_is_planned_from_a_shallow_trace_and_applied_to_every_block(tmp_path):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = meta(MLPStack, n_layers=6)
    plan, autop = plan_for(model, (8, 4, 32), mesh, high=None)
    assert plan.blocks and plan.blocks[0]["container"] == "layers"
    # the traced graph holds 3 of the 6 blocks; the plan names every parameter of all 6
    traced = {f.split(".")[1] for f in autop.tg.params if f.startswith("layers.")}
    assert traced == {"0", "1", "2"}
    assert list(plan.params) == [f for f, _ in MLPStack(n_layers=6).named_parameters()]
    interior = {plan.params[f"layers.{i}.0.weight"] for i in range(1, 5)}
    assert len(interior) == 1  # blocks 1..4 share the plan of traced block 1
    plan.save(tmp_path / "plan.json")
    pm = autop.apply_placement(Plan.load(tmp_path / "plan.json"))  # traces all 6, maps nodes
    assert "trace_full" in autop.timings
    for n, p in pm.named_parameters():
        assert (
            ",".join("R" if isinstance(x, Replicate) else f"S({x.dim})" for x in p.placements)
            == plan.params[n]
        ), n


def _record_traces(monkeypatch) -> list[bool]:
    """Every trace the planner makes from now on (True: a shallow one)."""
    from torchtitan.autoparallel.trace import planning

    made: list[bool] = []
    real = planning.trace_joint

    def recorded(*args, shallow=False, **kwargs):
        made.append(shallow)
        return real(*args, shallow=shallow, **kwargs)

    monkeypatch.setattr(planning, "trace_joint", recorded)
    return made


def _stack_planner(mesh, batch: int = 8) -> AutoParallel:
    return AutoParallel(
        meta(MLPStack, n_layers=6),
        lambda: torch.randn(batch, 4, 32),
        mesh,
        cost_model="h100",
        trace_on_enter=False,
    )


def test_a_planner_that_traces_on_first_need_makes_the_same_plan(monkeypatch):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    eager, _ = plan_for(meta(MLPStack, n_layers=6), (8, 4, 32), mesh, high=None)
    traces = _record_traces(monkeypatch)
    with _stack_planner(mesh) as autop:
        autop.add_parameter_memory_constraint(high=None)
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_output_constraints([(Shard(0), Replicate())])
        assert traces == []  # neither entering nor the constraints traced the model
        plan = autop.optimize_placement()
    assert traces == [True]  # the shallow planning trace, once
    assert (plan.params, plan.inputs, plan.outputs) == (eager.params, eager.inputs, eager.outputs)
    assert plan.predicted == eager.predicted
    assert plan.timings["trace"] > 0


def test_a_constraint_added_before_the_trace_is_checked_when_planning():
    mesh = init_device_mesh("cpu", (WORLD,))
    with _stack_planner(mesh, batch=6) as autop:
        autop.add_input_constraints([(Shard(0),)])  # 6 rows on 8 ranks: checked once traced
        with pytest.raises(ConstraintError, match="input 0 dim 0 has size 6, which the 8 ranks"):
            autop.optimize_placement()


def test_a_process_that_receives_its_plan_traces_only_the_whole_model(monkeypatch):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    plan, _ = plan_for(meta(MLPStack, n_layers=6), (8, 4, 32), mesh, high=None)
    traces = _record_traces(monkeypatch)
    with _stack_planner(mesh) as receiver:
        receiver.add_input_constraints([(Shard(0), Replicate())])
        receiver.trace_for_apply()  # what it does while another process plans
        pm = receiver.apply_placement(Plan.from_json(plan.to_json()))
    assert traces == [False]  # one trace, of the whole model
    for n, p in pm.named_parameters():
        assert _placement_text(p.placements) == plan.params[n], n


def _placement_text(placements) -> str:
    return ",".join("R" if isinstance(x, Replicate) else f"S({x.dim})" for x in placements)


class BranchesOnDepth(nn.Module):
    """Identical blocks whose forward differs by position: a shallow trace cannot stand for it."""

    def __init__(self, dim=32, n=5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                x = torch.tanh(x)
        return x


def test_blocks_that_differ_at_run_time_are_reported():
    mesh = init_device_mesh("cpu", (WORLD,))
    plan, autop = plan_for(meta(BranchesOnDepth), (16, 32), mesh, high=None)
    with pytest.raises(PlannerError, match="do not trace identically.*share_repeated=False"):
        autop.apply_placement(plan)
    with AutoParallel(
        meta(BranchesOnDepth), lambda: torch.randn(16, 32), mesh, share_repeated=False
    ) as exact:
        exact.add_input_constraints([(Shard(0),)])
        assert exact.apply_placement(exact.optimize_placement()) is not None


# ------------------------------------------------------------------ cost model
def test_redistribution_steps_follow_dtensor():
    """The cost model prices the steps DTensor takes, in its order (which link moves the
    large tensor depends on it), for every pair of placements on a 2-D mesh."""
    import itertools

    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from torchtitan.autoparallel.cost.model import redistribution_steps

    mesh = init_device_mesh("cpu", (2, 4))
    meta = TensorMeta(torch.Size([16, 16]), (16, 1), torch.float32)
    sources = list(itertools.product([Replicate(), Shard(0), Shard(1), Partial()], repeat=2))
    targets = list(itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2))
    for src, tgt in itertools.product(sources, targets):
        theirs = [
            (i.mesh_dim, *i.src_dst_placements)
            for i in _gen_transform_infos(
                DTensorSpec(mesh, src, tensor_meta=meta), DTensorSpec(mesh, tgt, tensor_meta=meta)
            )
        ]
        assert redistribution_steps(src, tgt) == theirs, (src, tgt)


def test_nested_gather_moves_the_large_tensor_over_the_outer_link():
    from torchtitan.autoparallel.cost.model import Estimator

    slow, fast = LinkSpec(0.0, 1.0), LinkSpec(0.0, 100.0)
    est = Estimator(CostModel(device=DEVICES["h100"], links=[slow, fast]), (2, 4))
    nbytes = 1024 * 1024 * 4  # the full tensor
    us = est.comm_us((Shard(0), Shard(0)), (Replicate(), Replicate()), (1024, 1024), 4)
    # inner (fast) gather of an eighth to a half, then the outer (slow) gather to the whole
    inner = 3 / 4 * (nbytes / 2) / (100.0 * 1e3)
    outer = 1 / 2 * nbytes / (1.0 * 1e3)
    assert us == pytest.approx(inner + outer)


def test_a_plan_read_from_a_file_is_checked_against_the_model_and_mesh():
    from torchtitan.autoparallel import Plan, PlannerError

    def plan(params, mesh=(2,), names=("tp",), node_out="R"):
        return Plan(
            mesh_shape=list(mesh),
            mesh_dim_names=list(names),
            params=params,
            grads={},
            buffers={},
            inputs=[],
            outputs=[],
            nodes={"mm": {"op": "aten.mm", "ins": ["S(0)", "-"], "out": [node_out]}},
        )

    shapes = {"w": (4, 3), "b": (3,)}
    plan({"w": "S(0)", "b": "R"}).check_applicable(shapes, [2], ["tp"])
    for bad, message in [
        (plan({"w": "S(2)", "b": "R"}), "impossible placement 'S(2)' for w [4, 3]"),
        (plan({"w": "S(0)", "b": "S(0),R"}), "impossible placement 'S(0),R' for b [3]"),
        (plan({"w": "S(0)"}), "places no b"),
        (plan({"w": "S(0)", "b": "R", "c": "R"}), "places unknown parameter c"),
        (plan({"w": "Q(1)", "b": "R"}), "unreadable placement: cannot parse placement 'Q(1)'"),
        (plan({"w": "S(0)", "b": "R"}, node_out="S(x)"), "unreadable placement"),
        (plan({"w": "S(0)", "b": "R"}, mesh=(4,)), "made for mesh [4] ['tp'], not [2] ['tp']"),
    ]:
        with pytest.raises(PlannerError, match=re.escape(message)):
            bad.check_applicable(shapes, [2], ["tp"])


def test_a_private_torch_api_that_moved_is_named_not_skipped():
    from torchtitan import torch_private

    with pytest.raises(ImportError) as err:
        torch_private._require("torch.distributed.tensor._ops.utils", "no_such_helper")
    message = str(err.value)
    assert message.startswith(
        "torchtitan needs torch.distributed.tensor._ops.utils.{no_such_helper}"
    )
    assert f"torch {torch.__version__} does not provide it" in message
    assert f"tested with torch=={torch_private.TESTED_WITH}" in message
    with pytest.raises(ImportError, match=r"needs torch\.no_such_module\.\{x\}"):
        torch_private._require("torch.no_such_module", "x")


def test_a_plan_of_an_older_format_is_refused_with_one_line():
    """Plans record which units gather again since format 2; an older one is not guessed at."""
    import json

    from torchtitan.autoparallel import Plan, PlannerError

    fields = dict(mesh_shape=[2], mesh_dim_names=["dp"], params={}, grads={}, buffers={})
    old = json.dumps({**fields, "inputs": [], "outputs": [], "nodes": {}, "regathered": None})
    with pytest.raises(PlannerError, match=r"^plan format version 1, and this planner reads "):
        Plan.from_json(old)
    with pytest.raises(PlannerError, match="plan format version 7"):
        Plan.from_json(json.dumps({**json.loads(old), "version": 7}))
    new = Plan(**fields, inputs=[], outputs=[], nodes={})
    assert Plan.from_json(new.to_json()) == new
