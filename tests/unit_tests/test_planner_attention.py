"""The planner's attention op (attention.py) and shared redistributions ("hubs", solver.py).

One process; planning on a fake process group.  Execution of both on real ranks is covered by
the 4-rank numerics tests (tests/integration_tests/test_autoparallel_numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import AutoParallel, CostModel
from torchtitan.autoparallel.cost.model import Estimator
from torchtitan.autoparallel.ops.attention import sdpa, softmax_attention_backward
from torchtitan.autoparallel.trace.joint import trace_joint

pytestmark = pytest.mark.usefixtures("module_fake_world")  # world size 4


@pytest.mark.parametrize(
    "causal, q_len, masked",
    [(True, 16, False), (False, 16, False), (False, 12, False), (False, 16, True)],
)
def test_attention_op_matches_sdpa_exactly_on_cpu(causal, q_len, masked):
    torch.manual_seed(0)
    q = torch.randn(2, 4, q_len, 8, requires_grad=True)
    k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(2))
    # a per-sample mask (two packed documents in sample 1), as transformers builds it
    keep = torch.ones(2, 1, q_len, 16, dtype=torch.bool).tril()
    keep[1, :, 8:, :8] = False
    bool_mask = keep if masked else None
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if masked else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, is_causal=causal)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    out, _lse = sdpa(q2, k2, v2, mask, causal, None)
    grads = torch.autograd.grad(out, (q2, k2, v2), g)
    # the same fused CPU kernels as the unplanned model: bitwise equal
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    # the device-independent backward (used off CPU) agrees to float32 rounding
    for a, b in zip(
        softmax_attention_backward(g, q.detach(), k.detach(), v.detach(), mask, causal, None),
        ref_grads,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("v_dim", [8, 4], ids=["fused", "textbook"])
def test_attention_gradients_come_in_their_inputs_layout_as_the_fake_says(v_dim):
    """q, k, v as a model makes them (transposes of [batch, seq, heads, head_dim]): each
    gradient comes back in its input's layout, with the strides the fake kernel gives the
    trace, so the transposes back that merge the heads copy nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)

    def heads(d):
        return torch.randn(2, 16, 4, d).transpose(1, 2)

    q, k, v = heads(8), heads(8), heads(v_dim)
    out, lse = sdpa(q, k, v, None, True, None)
    grads = torch.ops.titan.sdpa_backward(
        torch.randn_like(out), q, k, v, out, lse, None, True, None
    )
    assert [g.stride() for g in grads] == [x.stride() for x in (q, k, v)]
    assert not any(g.is_contiguous() for g in grads)
    with FakeTensorMode() as mode:
        fq, fk, fv, fout, flse = (mode.from_tensor(t) for t in (q, k, v, out, lse))
        fake = torch.ops.titan.sdpa_backward(
            torch.empty_like(fout), fq, fk, fv, fout, flse, None, True, None
        )
    assert [g.stride() for g in fake] == [g.stride() for g in grads]


class Attn(nn.Module):
    def __init__(self, masked: bool = False, gqa: bool = False):
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.masked, self.gqa = masked, gqa

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        if self.gqa:  # two key/value heads for four query heads
            k, v = k[:, :2], v[:, :2]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.masked else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not self.masked, enable_gqa=self.gqa
        )
        return out.transpose(1, 2).reshape(b, s, d).sum()


def _targets(**kw) -> set:
    with torch.device("meta"):
        model = Attn(**kw)
    tg = trace_joint(model, lambda: torch.randn(2, 8, 32))
    return {n.target for n in tg.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_is_traced_as_one_op_each_way(masked):
    targets = _targets(masked=masked)
    assert torch.ops.titan.sdpa.default in targets
    assert torch.ops.titan.sdpa_backward.default in targets
    assert torch.ops.aten.bmm.default not in targets  # no [batch*heads] flattening


def test_sdpa_with_grouped_heads_keeps_the_math_decomposition():
    targets = _targets(gqa=True)
    assert torch.ops.titan.sdpa.default not in targets
    assert torch.ops.aten.bmm.default in targets


class Fanout(nn.Module):
    """One value read by three consumers."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(256))

    def forward(self, x):
        h = x * self.scale
        return h.relu(), h.sigmoid(), h.tanh()


def test_value_read_by_three_consumers_is_gathered_once():
    """Input split on batch, outputs pinned replicated: gathering h once (its hub) and
    computing the three ops replicated beats three gathers; the forward pays one."""
    mesh = init_device_mesh("cpu", (4,))
    with torch.device("meta"):
        model = Fanout()
    with AutoParallel(model, lambda: torch.randn(64, 256), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Replicate(),)] * 3)
        plan = autop.optimize_placement()
    one_gather = Estimator(CostModel.for_device("h100"), (4,)).comm_us(
        (Shard(0),), (Replicate(),), (64, 256), 4
    )
    assert plan.nodes["mul"]["out"] == ["S(0)"] and plan.nodes["mul"]["hubs"] == ["R"]
    assert plan.predicted["fwd_comm_us"] == pytest.approx(one_gather)


def _heads(*shape: int, seq_major: bool) -> torch.Tensor:
    """A [batch, heads, seq, dim] tensor, laid out [batch, seq, heads, dim] in memory when
    `seq_major` (a model's q after splitting the heads and transposing)."""
    b, h, s, d = shape
    return torch.randn(b, s, h, d).transpose(1, 2) if seq_major else torch.randn(b, h, s, d)


@pytest.mark.parametrize("seq_major", [False, True])
@pytest.mark.parametrize("head_dim_v", [8, 4])  # the fused CPU kernels, and the fallback
def test_attention_ops_real_kernels_agree_with_their_fake_ones(head_dim_v, seq_major):
    """`torch.library.opcheck`: the shapes, strides and dtypes the fake kernels promise (what
    `torch.compile` plans with) are what the CPU kernels return, autograd included.  The
    output is laid out like q, so a model merging the heads of a seq-major q copies nothing
    (the hand-written model's attention saves one tensor for the output and the projection
    after it, and so does the planned one)."""
    from torchtitan.autoparallel.ops.attention import sdpa_backward

    q, k = _heads(2, 4, 16, 8, seq_major=seq_major), _heads(2, 4, 16, 8, seq_major=seq_major)
    v = _heads(2, 4, 16, head_dim_v, seq_major=seq_major)
    fwd_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, True, None)
    torch.library.opcheck(sdpa, fwd_args)
    out, lse = sdpa(*(t.detach() for t in (q, k, v)), None, True, None)
    if head_dim_v == q.shape[-1]:
        assert out.stride() == q.stride()
        assert out.transpose(1, 2).is_contiguous() == seq_major
    grad = torch.randn_like(out)
    torch.library.opcheck(
        sdpa_backward, (grad, q.detach(), k.detach(), v.detach(), out, lse, None, True, None)
    )
