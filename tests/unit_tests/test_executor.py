"""The executor's lowered graphs, inspected in one process on a fake 4-rank group.

What runs is checked numerically by the 4-rank tests (integration_tests/autoparallel_numerics*);
here: the graphs hold no captured tensors, each FSDP unit's gathers and gradient reductions
are one collective, the next unit's gather is issued before the current unit computes, and
reshard-after-forward decides which units are gathered again in the backward.
"""

import copy
import operator
import weakref

import pytest
import torch
from autoparallel_models import GPT2Block, MLPStack, TiedLM
from lowered_graphs import (
    backward_gathered_units,
    eager_then_for_inductor,
    gathered_units,
    param_gathers,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan.autoparallel import AutoParallel
from torchtitan.autoparallel.execute.buckets import RS, WAIT, consecutive_units
from torchtitan.autoparallel.execute.executor import InductorOnFirstCall
from torchtitan.autoparallel.policies.recompute import fusible

# an eager graph's all-reduce of a bucket it packed, done in place (execute/in_place.py)
AR_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default


@pytest.fixture
def dp4(fake_world):
    with fake_world(4):
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))


def lowered(mesh, model_fn, example, fsdp=False, ddp=False, **kw):
    """The LoweredPlan of one step; `fsdp` pins every parameter to Shard(0) (FSDP's plan),
    `ddp` to Replicate() (DDP's)."""
    with torch.device("meta"):
        model = model_fn()
    with AutoParallel(
        model,
        lambda: torch.zeros(example.shape, dtype=example.dtype),
        mesh,
        cost_model="h100",
        **kw,
    ) as autop:
        if not ddp:
            autop.add_parameter_memory_constraint()
        for fqn, p in model.named_parameters():
            if fsdp and p.shape[0] % 4 == 0:
                autop.add_parameter_constraint(fqn, (Shard(0),))
            if ddp:
                autop.add_parameter_constraint(fqn, (Replicate(),))
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        pm = autop.apply_placement(autop.optimize_placement())
    pm.to_empty(device="cpu")
    pm.init_weights()
    local = example[: example.shape[0] // 4]  # many tokens per weight: an FSDP-like plan
    pm(local).float().pow(2).mean().backward()  # lowers (fake collectives move no data)
    (lp,) = pm._ap_executor.lowered.values()
    lp.module = pm
    return lp


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_one_gather_and_one_reduction_per_unit(dp4):
    lp = lowered(dp4, lambda: MLPStack(n_layers=5), torch.randn(64, 16, 32))
    part = lp.partition
    for gm in (part.fwd, part.bwd):
        assert not [n for n in gm.graph.nodes if n.op == "get_attr"], gm.code
    units = 6  # layers.0..4 and the root (head)
    assert lp.stats["fwd_before"]["all_gather_into_tensor"] > units
    assert len(param_gathers(part, "fwd")) == units
    # the plan computes some weight gradients from gathered activations (no reduction); the
    # reductions it has are merged per unit
    assert len(nodes(part.bwd, RS)) < lp.stats["bwd_before"]["reduce_scatter_tensor"]
    assert len(nodes(part.bwd, RS)) <= units
    # reshard_after_forward=True: the backward gathers again, one collective per unit
    again = [
        gathered_units(part, ag, lp.module._ap_executor.units) for ag in param_gathers(part, "bwd")
    ]
    assert again and all(len(u) == 1 for u in again), again
    assert len({u for (u,) in again}) == len(again), again


def test_replicated_gradients_share_ddp_sized_all_reduce_buckets(dp4, monkeypatch):
    """DDP's plan: the units' gradient all-reduces are coalesced in the backward's order into
    buckets of up to 25 MiB (the whole model here: one), and a smaller cap splits them at
    unit boundaries, never above the cap unless one unit alone is larger."""
    from torchtitan.autoparallel.execute import buckets

    def all_reduces(lp):  # (an eager graph reduces a bucket in place: in_place.py)
        return nodes(lp.partition.bwd, buckets.AR) + nodes(lp.partition.bwd, AR_IN_PLACE)

    example = torch.randn(64, 16, 32)
    lp = lowered(dp4, lambda: MLPStack(n_layers=5), example, ddp=True)
    assert lp.stats["bwd_before"]["all_reduce"] > 6  # every weight and bias
    assert len(all_reduces(lp)) == 1
    assert not nodes(lp.partition.bwd, RS)
    unit_bytes = (32 * 64 + 64 + 64 * 32 + 32) * 4  # one block's weights and biases
    monkeypatch.setattr(buckets, "ALL_REDUCE_BUCKET_BYTES", 2 * unit_bytes)
    lp = lowered(dp4, lambda: MLPStack(n_layers=5), example, ddp=True)
    sizes = [
        sum(buckets._bytes(piece.args[0]) for piece in c.args[0].args[0]) for c in all_reduces(lp)
    ]
    assert len(sizes) == 3 and all(s <= 2 * unit_bytes for s in sizes), sizes


def test_next_units_gather_overlaps_compute(dp4):
    lp = lowered(dp4, lambda: MLPStack(n_layers=5), torch.randn(64, 16, 32))
    order = list(lp.partition.fwd.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    gathers = param_gathers(lp.partition, "fwd")
    compute = [
        pos[n]
        for n in order
        if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
    ]
    for ag in gathers[1:]:
        wait = next(iter(ag.users))
        assert wait.target is WAIT
        between = [c for c in compute if pos[ag] < c < pos[wait]]
        assert between, f"{ag.name} is waited for before any compute runs behind it"


def test_default_policy_keeps_root_and_last_unit_gathered(dp4):
    lp = lowered(
        dp4, lambda: MLPStack(n_layers=5), torch.randn(64, 16, 32), reshard_after_forward="default"
    )
    expected = {"": False, **{f"layers.{i}": i < 4 for i in range(5)}}  # root, last: kept
    assert lp.module.plan.regathered == expected
    again = backward_gathered_units(lp.partition, lp.module._ap_executor.units)
    assert again and again <= {u for u, yes in expected.items() if yes}, again
    never = lowered(
        dp4, lambda: MLPStack(n_layers=5), torch.randn(64, 16, 32), reshard_after_forward=False
    )
    assert not any(never.module.plan.regathered.values())
    assert not param_gathers(never.partition, "bwd")


def test_tied_weight_is_one_parameter_with_one_gradient(dp4):
    lp = lowered(dp4, TiedLM, torch.randint(0, 64, (8, 16)))
    assert lp.partition.grad_names.count("tok.weight") == 1
    assert "head.weight" not in lp.partition.grad_names
    pm = lp.module  # saved and loaded under both original FQNs, still one tensor
    assert pm.head.weight is pm.tok.weight
    sd = pm.state_dict()
    assert sd["head.weight"].to_local().data_ptr() == sd["tok.weight"].to_local().data_ptr()
    pm.load_state_dict(sd)
    assert pm.head.weight is pm.tok.weight


def test_gradient_reductions_one_in_flight(dp4):
    """A unit's reduction is waited for once the next unit's is issued (FSDP2's order)."""
    lp = lowered(dp4, lambda: MLPStack(n_layers=5), torch.randn(512, 16, 32), fsdp=True)
    order = list(lp.partition.bwd.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    reductions = sorted(nodes(lp.partition.bwd, RS), key=pos.__getitem__)
    assert len(reductions) == 6  # one per unit
    for r, nxt in zip(reductions, reductions[1:]):
        wait = next(iter(r.users))
        assert (
            pos[nxt]
            < pos[wait]
            < min((pos[x] for x in reductions if pos[x] > pos[nxt]), default=len(order))
        )


def test_lowering_refuses_a_captured_tensor():
    """A value closed over instead of passed in would be reused on every later call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchtitan.autoparallel import PlannerError
    from torchtitan.autoparallel.execute.lower import _check_constants

    stale = torch.randn(4, 4)
    gm = make_fx(lambda x: x @ stale)(torch.randn(4, 4))
    with pytest.raises(PlannerError, match="captured tensor constant"):
        _check_constants(gm, allowed=set())
    _check_constants(
        gm, allowed={id(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    )  # a true constant of the model


def _gradient_chains(part, units):
    """Unit -> (position of the op each of its gradients' redistribution starts from, the
    reductions on those redistributions), read off the backward graph."""
    from torchtitan.autoparallel.execute.buckets import AR, one_source
    from torchtitan.autoparallel.policies.units import unit_of

    order = list(part.bwd.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    out = next(n for n in order if n.op == "output")
    chains: dict[str, tuple[list[int], set]] = {}
    final_all_reduces = set()  # the last reduction of a chain, an all-reduce: DDP-bucketed
    for g, fqn in zip(out.args[0], part.grad_names):
        made, reductions = chains.setdefault(unit_of(fqn, units), ([], set()))
        first = True
        while (step := one_source(g)) is not None and step[0].op == "call_function":
            if g.target in (RS, AR, AR_IN_PLACE):
                reductions.add(g)
                if first and g.target is not RS:
                    final_all_reduces.add(g)
                first = False
            g = step[0]
        made.append(pos[g])
    return chains, pos, final_all_reduces


def test_gradients_reduced_block_by_block_on_a_2d_mesh(fake_world):
    """On dp x tp a weight gradient can be reduced on both dims (tp first, as a split and
    re-join around the collective): each unit's reductions are issued before the next unit's
    gradients are all made, not after the whole backward (which kept every block's unreduced
    gradients alive) — except the all-reduces that leave a gradient replicated, which save
    no memory by going early and share DDP-sized buckets."""
    import dataclasses

    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.model import Transformer

    args = dataclasses.replace(
        llama3_configs["debugmodel"], n_layers=3, vocab_size=256, max_seq_len=256
    )
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Transformer(args)
        with AutoParallel(
            model, lambda: torch.zeros(4, 256, dtype=torch.long), mesh, cost_model="cpu"
        ) as autop:
            autop.add_parameter_memory_constraint(high=0.5)
            autop.add_input_constraints([(Shard(0), Shard(1))])  # the sequence split on tp
            for name in autop.param_shapes():  # norms whole on tp: partial gradients there
                if name.endswith("norm.weight"):
                    autop.add_parameter_constraint(name, (Shard(0), Replicate()))
            autop.add_output_constraints([(Shard(0), Shard(2))])
            pm = autop.apply_placement(autop.optimize_placement())
        pm.to_empty(device="cpu")
        pm.init_weights()
        pm(torch.zeros(2, 128, dtype=torch.long)).float().pow(2).mean().backward()
    (lp,) = pm._ap_executor.lowered.values()
    chains, pos, final_all_reduces = _gradient_chains(lp.partition, pm._ap_executor.units)
    done = sorted(chains, key=lambda u: max(chains[u][0]))  # units in the backward's order
    assert sum(len(r) for _m, r in chains.values()) >= len(done), "expected reductions"
    # a collective's last argument is its group: one per mesh dim
    assert any(len({r.args[-1] for r in reductions}) == 2 for _m, reductions in chains.values()), (
        "expected gradients reduced on both mesh dims"
    )
    for unit, nxt in zip(done, done[1:]):
        last_made_next = max(chains[nxt][0])
        # (a chain's final all-reduce shares a bucket across units, as DDP's do)
        late = [r.name for r in chains[unit][1] - final_all_reduces if pos[r] > last_made_next]
        assert not late, f"{unit}'s reductions {late} wait for {nxt}'s gradients"


def test_a_gather_is_issued_ahead_only_from_the_unit_before_it():
    units = [f"layers.{i}" for i in range(6)]
    assert consecutive_units("layers.5", "layers.4", units)
    assert consecutive_units("", "layers.5", units)  # the head, then the last block
    assert consecutive_units("layers.0", "", units)  # the first block, then the embedding
    # the blocks between keep their parameters: gathering layers.0 while layers.5 runs
    # would hold it through their whole backward
    assert not consecutive_units("layers.5", "layers.0", units)
    assert not consecutive_units("", "layers.3", units)
    assert not consecutive_units("layers.1", "other.0", units)


def test_forward_saves_tensors_for_the_backward_never_tuples(dp4):
    """A LayerNorm's forward op returns (output, mean, rstd) and its backward reads two of
    them: the forward graph returns those items, so both graphs take and return flat tensors
    (what inductor's compile_fx requires, executor.py)."""
    lp = lowered(dp4, GPT2Block, torch.zeros(8, 16, dtype=torch.long))
    out = next(n for n in lp.partition.fwd.graph.nodes if n.op == "output")
    saved = out.args[0][lp.n_out :]
    assert any(n.target is operator.getitem for n in saved)  # items of a tuple-valued op
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in saved)


def test_a_compiled_graph_is_called_boxed_and_lets_go_of_its_inputs():
    """The compiled backward takes one list of inputs and empties it, as AOTAutograd calls
    its compiled backward: once it returns (and, inside, at each input's last use) nothing
    of the executor holds a saved value."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    gm = make_fx(lambda x, y: (torch.mm(x, y).relu().sum(0), y * 2))(a, b)
    compiled = InductorOnFirstCall(gm, {})
    args = [a.clone(), b.clone()]
    first = weakref.ref(args[0])
    out = compiled(args)
    assert args == [] and first() is None
    torch.testing.assert_close(out[0], torch.mm(a, b).relu().sum(0))
    torch.testing.assert_close(out[1], b * 2)


def test_a_compiled_graph_is_read_from_inductors_cache_when_compiled_again(tmp_path, monkeypatch):
    """A second compile of the same graph (a warm restart) loads the first one's code from
    inductor's FX graph cache instead of generating it again.  The first compile generates
    it in a forked child process (its heap goes with the child), and this process reads it
    from the cache both times."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    a = torch.randn(8, 8)
    gm = make_fx(lambda x: (torch.tanh(x).cumsum(0),))(a)
    before = dict(counters["inductor"])
    generated = InductorOnFirstCall.generated
    for _ in range(2):
        out = InductorOnFirstCall(gm, {})([a.clone()])
        torch.testing.assert_close(out[0], torch.tanh(a).cumsum(0))
    delta = {k: v - before.get(k, 0) for k, v in counters["inductor"].items()}
    assert InductorOnFirstCall.generated - generated == 1
    assert delta.get("fxgraph_cache_miss") is None and delta.get("fxgraph_cache_hit") == 2, delta


def _saved(lp) -> list:
    out = next(n for n in lp.partition.fwd.graph.nodes if n.op == "output")
    return [n for n in out.args[0][lp.n_out :] if n.op != "placeholder"]


def _storage_bytes(nodes) -> int:
    """Bytes of the distinct tensors among `nodes`, a view counted with its base."""
    bases = set()
    for n in nodes:
        while fusible(n) and n.target._schema.returns[0].alias_info is not None:
            n = n.args[0]
        bases.add(n)
    return sum(b.meta["val"].numel() * b.meta["val"].element_size() for b in bases)


def test_graphs_to_compile_recompute_pointwise_values_instead_of_saving_them(
    fake_world, monkeypatch
):
    """For inductor the partition recomputes what pointwise ops, views and casts make from
    values the backward has anyway (a norm's normalised input, SiLU, the gated product):
    fewer saved bytes, only values the eager partition saved too, the same gradients."""
    eager, fused, runs = eager_then_for_inductor(fake_world, monkeypatch, n_layers=3)
    saved_eager, saved_fused = _saved(eager), _saved(fused)
    assert {n.name for n in saved_fused} < {n.name for n in saved_eager}
    recomputed = {n.target for n in saved_eager if n.name not in {m.name for m in saved_fused}}
    assert {torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor} <= recomputed
    assert _storage_bytes(saved_fused) < 0.7 * _storage_bytes(saved_eager)
    for name, grad in runs[0].items():
        assert torch.equal(runs[1][name], grad), name


def test_an_input_that_requires_grad_gets_its_gradient(fake_world):
    """A pipeline stage's hidden states: the planned module returns their gradient (in the
    input's placement) with every parameter's, as the model in one process does; on meta
    inputs (a schedule's shape inference) it runs nothing and gives meta outputs and input
    gradients of the planned local shapes."""
    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            model = MLPStack(n_layers=3)
        with AutoParallel(model, lambda: torch.randn(8, 16, 32, requires_grad=True), mesh) as autop:
            autop.add_input_constraints([(Shard(0),)])
            autop.add_output_constraints([(Shard(0),)])
            pm = autop.apply_placement(autop.optimize_placement())
        pm.to_empty(device="cpu")
        torch.manual_seed(0)
        pm.init_weights()
        reference = copy.deepcopy(model)
        reference.to_empty(device="cpu")
        torch.manual_seed(0)
        reference.init_weights()
        x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(1))
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        pm(ours).pow(2).mean().backward()
        reference(theirs).pow(2).mean().backward()
        assert ours.grad is not None
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
        for (name, p), (_, q) in zip(pm.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)

        # a retained graph's second backward: the same output gradients hand the parameters'
        # gradients back again (a zero-bubble schedule's weight step); others are refused
        out = pm(ours)
        (g,) = torch.autograd.grad(out.sum(), [ours], retain_graph=True)
        torch.testing.assert_close(g, torch.autograd.grad(reference(theirs).sum(), [theirs])[0])
        again = torch.autograd.grad(out.sum(), list(pm.parameters()), retain_graph=True)
        expected = torch.autograd.grad(reference(theirs).sum(), list(reference.parameters()))
        for ours_g, theirs_g, (name, _) in zip(again, expected, pm.named_parameters()):
            torch.testing.assert_close(ours_g.full_tensor(), theirs_g, msg=name)
        with pytest.raises(RuntimeError, match="a planned module's backward ran twice"):
            torch.autograd.grad((2 * out).sum(), list(pm.parameters()))

        on_meta = torch.empty(8, 16, 32, device="meta", requires_grad=True)
        out = pm(on_meta)
        assert out.is_meta and out.shape == reference(x).shape
        out.sum().backward()
        assert on_meta.grad is not None and on_meta.grad.is_meta
        assert on_meta.grad.shape == on_meta.shape
