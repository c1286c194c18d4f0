"""Llama 3 on meta: shapes and parameter counts of every flavor, and init after to_empty."""

import copy

import pytest
import torch

from torchtitan.models.llama3.args import llama3_configs
from torchtitan.models.llama3.model import Transformer

# Published sizes with the Llama 3 vocabulary (128,256).
EXPECTED_PARAMS = {"8B": 8.03e9, "70B": 70.55e9, "405B": 405.85e9}


def _meta_model(flavor, **overrides):
    args = copy.deepcopy(llama3_configs[flavor])
    for key, value in overrides.items():
        setattr(args, key, value)
    with torch.device("meta"):
        return args, Transformer(args)


@pytest.mark.parametrize("flavor", sorted(EXPECTED_PARAMS))
def test_public_flavor_parameter_counts(flavor):
    args, model = _meta_model(flavor)
    nparams, flops = args.get_nparams_and_flops(model, seq_len=8192)
    assert nparams == pytest.approx(EXPECTED_PARAMS[flavor], rel=2e-3)
    assert all(p.is_meta for p in model.parameters())
    embedding = args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.dim * 8192
    assert flops == 6 * (nparams - embedding) + attention


def test_8b_shapes():
    args, model = _meta_model("8B")
    assert args.ffn_hidden_dim == 14336
    block = model.layers["0"]
    assert block.attention.wq.weight.shape == (4096, 4096)
    assert block.attention.wk.weight.shape == (1024, 4096)  # 8 kv heads × 128
    assert block.feed_forward.w1.weight.shape == (14336, 4096)
    assert model.output.weight.shape == (128256, 4096)
    assert len(model.layers) == 32


def test_debugmodel_forward_shape_and_init_after_to_empty():
    args, model = _meta_model("debugmodel", vocab_size=512, max_seq_len=32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    model.init_weights()
    for k, v in model.state_dict().items():
        assert torch.equal(v, first[k]), k  # init is a pure function of the seed
    assert torch.equal(model.layers["0"].attention_norm.weight, torch.ones(args.dim))
    std = model.layers["0"].attention.wq.weight.std().item()
    assert 0.015 < std < 0.025
    # wo is depth-scaled: deeper layers start smaller
    assert model.layers["5"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    tokens = torch.randint(0, 512, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 512)
    assert torch.isfinite(logits).all()
    # RoPE table was rebuilt on the real device (to_empty left garbage in it)
    assert torch.allclose(model.rope_cache[0, :, 0], torch.ones(args.head_dim // 2))


def test_causality():
    _, model = _meta_model("debugmodel", vocab_size=128, max_seq_len=16, n_layers=2)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, 128, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 128
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])
