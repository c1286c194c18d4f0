"""`hf_auto_parallel` end to end: a Hugging Face Llama from the local config in
`tests/assets/hf_llama_debug` trained by the same loop as llama3.

dp2×tp2 on 4 CPU ranks must reproduce the 1-rank run (same global batch) within rtol 1e-4;
its DCP checkpoint holds Hugging Face's parameter names and loads into a plain
`transformers` model; a run resumed from the step-5 checkpoint reproduces steps 6–10
bitwise; a bad config path or a tokenizer larger than the config's vocabulary is one
`error:` line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from harness import REPO, run_training

from torchtitan.components.checkpoint import read_keys
from torchtitan.tools.loss_compare import assert_losses_close

transformers = pytest.importorskip("transformers")

CONFIG = REPO / "tests/assets/hf_llama_debug"
HF = ["--model.name", "hf_auto_parallel", "--model.flavor", str(CONFIG)]
DP2_TP2 = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


@pytest.fixture(scope="module")
def dp2_tp2_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_dp2_tp2")
    return run_training(4, [*HF, *DP2_TP2, *CKPT], folder).check()


def test_hf_llama_dp2_tp2_matches_1rank_and_learns(dp2_tp2_run, tmp_path):
    one = run_training(1, [*HF, "--training.local_batch_size", "4"], tmp_path).check()
    losses = dp2_tp2_run.losses()
    assert_losses_close(losses, one.losses(), rtol=1e-4, what="hf_auto_parallel dp2xtp2 vs 1 rank")
    assert losses[10] < losses[1]
    assert "model.layers.*.self_attn.q_proj.weight" in dp2_tp2_run.output  # the plan summary


def test_checkpoint_has_hf_names_and_loads_into_transformers(dp2_tp2_run):
    import torch.distributed.checkpoint as dcp

    step10 = dp2_tp2_run.dump_folder / "checkpoint" / "step-10"
    config = transformers.AutoConfig.from_pretrained(str(CONFIG))
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    assert expected <= read_keys(step10), sorted(expected - read_keys(step10))[:5]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(step10), no_dist=True)
    model.load_state_dict(state)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) == len(expected)
    logits = model(torch.randint(0, config.vocab_size, (1, 16))).logits
    assert logits.shape == (1, 16, config.vocab_size) and torch.isfinite(logits).all()


def test_resume_from_step5_is_bitwise(dp2_tp2_run, tmp_path):
    shutil.copytree(
        dp2_tp2_run.dump_folder / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5"
    )
    resumed = run_training(4, [*HF, *DP2_TP2, *CKPT], tmp_path).check()
    assert "loaded checkpoint step-5" in resumed.output
    full, losses = dp2_tp2_run.losses(), resumed.losses()
    assert {s: losses[s] for s in range(6, 11)} == {s: full[s] for s in range(6, 11)}


def _error_line(run) -> str:
    lines = [ln for ln in run.output.splitlines() if ln.startswith("error:")]
    assert run.returncode != 0 and len(lines) == 1, run.output[-3000:]
    return lines[0]


def test_bad_config_path_is_one_error_line(tmp_path):
    run = run_training(
        1, ["--model.name", "hf_auto_parallel", "--model.flavor", "meta-llama/Llama-3-8B"], tmp_path
    )
    line = _error_line(run)
    assert "'meta-llama/Llama-3-8B' is not a local Hugging Face config" in line
    assert "never downloaded" in line


def test_tokenizer_larger_than_vocab_is_one_error_line(tmp_path):
    small = tmp_path / "cfg"
    small.mkdir()
    text = (CONFIG / "config.json").read_text().replace('"vocab_size": 2000', '"vocab_size": 1000')
    (small / "config.json").write_text(text)
    run = run_training(
        1, ["--model.name", "hf_auto_parallel", "--model.flavor", str(small)], tmp_path / "out"
    )
    assert "the tokenizer has 2000 tokens but" in _error_line(run)
