"""A parameter the forward uses must train under the planner as in one process.

transformers' T5 adds a learned relative-position bias to the attention scores through SDPA's
mask; the planner's attention op gives its mask no gradient, so such a call keeps the MATH
decomposition (attention.py).  Checked on a one-rank mesh, where the planned graph runs as
is: every gradient equals one process's.  A parameter the traced graph gives no gradient is
named in a warning (trace/joint.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan.autoparallel import AutoParallel

transformers = pytest.importorskip("transformers")


class T5LM(nn.Module):
    """T5 as a language model over one sequence (encoder and decoder read the same ids)."""

    def __init__(self):
        super().__init__()
        config = transformers.T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            use_cache=False,
        )
        self.t5 = transformers.T5ForConditionalGeneration(config)

    def forward(self, ids):
        return self.t5(input_ids=ids, decoder_input_ids=ids).logits

    def init_weights(self):
        self.t5.init_weights()


@pytest.fixture
def one_rank(fake_world):
    with fake_world(1):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def test_t5_relative_attention_bias_trains_as_in_one_process(one_rank):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = T5LM()
    with torch.device("meta"):
        model = T5LM()
    with AutoParallel(
        model, lambda: torch.zeros(2, 16, dtype=torch.long), one_rank, cost_model="cpu"
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        pm = autop.apply_placement(autop.optimize_placement())
    pm.to_empty(device="cpu")
    reference = dict(eager.named_parameters())
    with torch.no_grad():
        for name, p in pm.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(reference[name])
    eager(ids).float().pow(2).mean().backward()
    pm(ids).float().pow(2).mean().backward()
    biases = [n for n, _p in pm.named_parameters() if "relative_attention_bias" in n]
    assert len(biases) == 2
    for name, p in pm.named_parameters():
        assert p.grad is not None, f"{name} received no gradient"
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, reference[name].grad, rtol=1e-5, atol=1e-6, msg=name)


class UsesAWeightWithoutGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.randn(8))  # used only through a comparison

    def forward(self, x):
        return self.proj(x) * (self.gate > 0)

    def init_weights(self):
        pass


def test_a_parameter_the_graph_gives_no_gradient_is_named(one_rank, caplog):
    with torch.device("meta"):
        model = UsesAWeightWithoutGradient()
    with caplog.at_level(logging.WARNING, logger="torchtitan.autoparallel.trace.joint"):
        with AutoParallel(model, lambda: torch.zeros(4, 8), one_rank, cost_model="cpu") as autop:
            autop.optimize_placement()
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "1 parameter(s) used in the forward receive no gradient in the traced graph and will "
        "not train: gate"
    ) in messages, messages
