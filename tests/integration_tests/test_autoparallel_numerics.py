"""Pytest entry for the 4-rank numerics check (`autoparallel_numerics.py` on forked ranks).

Each model/mesh pair trains 5 AdamW steps next to a single-process copy, comparing the
forward and every parameter gradient at every step (eager: the lowered local graphs;
compiled: the same graphs through inductor): Llama3 (2 small layers) on dp4, tp4 and
dp2xtp2; an MLP stack (planned from a shallow trace), a GPT-2 block, an LM with an LM head
tied to its embedding, an MLP-Mixer with LayerNorm, advanced indexing and five Hugging Face
models; mixed precision; the errors that must reach every rank alike (train-mode dropout, an
infeasible plan, an uneven batch split).  Also: sharded init against one process
(sharded_init_check.py) and every indexing strategy on real shards (strategy_check.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import pytest
from harness import native_crash

from torchtitan.tools.loss_compare import rank_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
# per model and mesh: init, forward x5, grads x5, params after 5 steps, lowering shared
CHECKS = 5


class Checks:
    """What rank 0 recorded (rank_checks.py, `$CHECK_RESULTS`): `count(prefix)` passed
    checks starting with it; `text in checks`: a passed check containing it."""

    def __init__(self, records: list[dict]):
        self.passed = [r["line"] for r in records if r["ok"]]
        self.failed = [r["line"] for r in records if not r["ok"]]

    def count(self, prefix: str) -> int:
        return sum(line.startswith(prefix) for line in self.passed)

    def __contains__(self, text: str) -> bool:
        return any(text in line for line in self.passed)


def _line(checks: Checks, prefix: str) -> str:
    """The passed check line starting with `prefix`."""
    lines = [line for line in checks.passed if line.startswith(prefix)]
    if not lines:
        pytest.fail(f"no passed check starts with {prefix!r}")
    return lines[0]


def _on_4_ranks(
    *args: str,
    timeout: int = 900,
    env: dict | None = None,
    script: str = "autoparallel_numerics.py",
) -> Checks:
    # what the ranks would each import later, imported once before the fork
    models = args[0].split(",") if args else []
    preload = ["transformers.modeling_utils"] if any(m.startswith("hf") for m in models) else []
    if (env or {}).get("AP_COMPILE") == "1":
        preload.append("torch._inductor.compile_fx")
    cmd = rank_command(4, [os.path.join(HERE, script), *args], forked=True, preload=preload)
    res, records = _launch(cmd, timeout, env)
    if signal := native_crash(res.returncode, res.stdout + res.stderr):  # see harness.py
        warnings.warn(
            f"{script} {' '.join(args)}: a rank died of {signal}; run again", stacklevel=2
        )
        res, records = _launch(cmd, timeout, env)
    checks = Checks(records)
    if res.returncode != 0 or "ALL OK" not in checks or checks.failed:
        pytest.fail(f"launch rc={res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return checks


def _launch(cmd: list[str], timeout: int, env: dict | None):
    """One launch: its completed process and the checks rank 0 recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "checks.jsonl"
        full_env = dict(
            os.environ,
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            PYTHONHASHSEED="0",  # one hash seed for all ranks, as run_train.sh
            CHECK_RESULTS=str(results),
            **(env or {}),
        )
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
        )
        records = (
            [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
        )
    return res, records


def test_llama_all_meshes_match_single_process():
    checks = _on_4_ranks("llama", "dp4,tp4,dp2tp2")
    assert checks.count("llama/") == 3 * CHECKS
    assert "llama/dp2tp2 grads x5" in checks
    for mesh in ("dp4", "tp4", "dp2tp2"):  # one rank's lowering, run by those it compared with
        assert f"llama/{mesh} lowering loaded by 2 of 4 ranks" in checks, mesh


def test_recomputed_blocks_match_single_process():
    """Blocks that recompute fully, selectively and not at all, in turn (4-layer Llama,
    5-block MLP from a shallow trace), the root and last unit keeping their gathered
    parameters and the others gathering them again: every gradient at 5 steps on dp4, tp4,
    dp2xtp2; the lowered forward keeps only what each block's policy keeps, and the backward
    gathers again only the units the plan says."""
    checks = _on_4_ranks("llama+recompute,mlp+recompute", "dp4,tp4,dp2tp2")
    for model in ("llama+recompute", "mlp+recompute"):
        assert checks.count(f"{model}/") == 3 * (CHECKS + 2), model
        assert f"{model}/dp2tp2 grads x5" in checks
    assert "llama+recompute/tp4 recomputes 3 blocks" in checks
    assert "mlp+recompute/dp4 recomputes 4 blocks" in checks
    assert "llama+recompute/dp4 gathers again 3 of 5 units" in checks


def test_mlp_gpt2_tied_mixer_indexing_elementwise_on_all_meshes():
    checks = _on_4_ranks("mlp,gpt2,tied,mixer,indexing,elementwise", "dp4,tp4,dp2tp2")
    for model in ("mlp", "gpt2", "tied", "mixer", "indexing", "elementwise"):
        assert checks.count(f"{model}/") == 3 * CHECKS, model
    # ranks with the same program load one rank's lowering (all but the two that compare
    # theirs); the indexing model's graphs fix a rank's index at trace time (gloo's
    # all-to-all, a gather and a chunk), so each of its ranks lowers its own
    for mesh in ("dp4", "tp4", "dp2tp2"):
        assert f"mlp/{mesh} lowering loaded by 2 of 4 ranks" in checks, mesh
    assert "indexing/dp4 lowering loaded by 0 of 4 ranks" in checks


HF_MODELS = ("hf_llama", "hf_qwen2", "hf_mistral", "hf_gpt2", "hf_bert")
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e .[dev])",
)


@needs_transformers
def test_hf_models_on_all_meshes():
    """Hugging Face Llama (GQA), Qwen2, Mistral, GPT-2 (tied) and BERT (tied, encoder) with
    their own init, and RoBERTa (its one-row token-type embedding is gathered in a bucket with
    others, which once made a strided view): init bitwise, forward and every gradient at 5
    steps on dp4, tp4, dp2xtp2."""
    models = (*HF_MODELS, "hf:roberta")
    checks = _on_4_ranks(",".join(models), "dp4,tp4,dp2tp2")
    for model in models:
        assert checks.count(f"{model}/") == 3 * CHECKS, model


@needs_transformers
def test_hf_models_compiled():
    """A GQA decoder and the tied encoder through inductor, 3 steps (cold compiles are slow
    here; every family on every mesh: AP_COMPILE_TEST=1)."""
    checks = _on_4_ranks(
        "hf_llama,hf_bert", "dp2tp2", env={"AP_COMPILE": "1", "AP_STEPS": "3"}, timeout=1500
    )
    assert "hf_llama+compile/dp2tp2 grads x3" in checks
    assert "hf_bert+compile/dp2tp2 params after 3 steps" in checks
    # the 4 ranks' graphs are the same code (no rank in a group name or a chunk offset), a
    # forward and a backward per model, compiled once on this machine
    for model in ("hf_llama", "hf_bert"):
        assert "of 2 distinct" in _line(checks, f"{model}+compile/dp2tp2 graphs compiled")


@needs_transformers
@pytest.mark.skipif(
    os.environ.get("AP_COMPILE_TEST") != "1",
    reason="15 cold compiles on 4 ranks; set AP_COMPILE_TEST=1",
)
def test_hf_models_compiled_on_all_meshes():
    checks = _on_4_ranks(
        ",".join(HF_MODELS),
        "dp4,tp4,dp2tp2",
        env={"AP_COMPILE": "1", "AP_STEPS": "3"},
        timeout=3600,
    )
    for model in HF_MODELS:
        assert checks.count(f"{model}+compile/") == 3 * (CHECKS - 1), model  # init is eager


def test_sharded_init_writes_match_single_process():
    """Random fills, writes through views (a padding row), indexed writes and plain tensors
    copied into sharded buffers, under every placement of a 1-D and a 2-D mesh."""
    checks = _on_4_ranks(script="sharded_init_check.py")
    assert checks.count("init/") == 9


def test_indexing_strategies_equal_one_process():
    """Every strategy of index / index_put / gather / scatter_add (and their backward ops)
    computed on real shards equals one process, on a 1-D and a 2-D mesh."""
    checks = _on_4_ranks(script="strategy_check.py")
    assert "strategies/2x2 covers index, index_put, gather, scatter_add" in checks
    assert "strategies/4 aten.index.Tensor" in checks


def test_errors_reach_every_rank():
    checks = _on_4_ranks("errors", "dp4,dp2tp2")
    assert checks.count("errors/") == 8


def test_dtensor_reference_interpreter():
    checks = _on_4_ranks("gpt2,tied", "dp2tp2", env={"AP_EXECUTOR": "dtensor"})
    assert "gpt2/dp2tp2 grads x5" in checks and "tied/dp2tp2 params after 5 steps" in checks


def test_attention_op_split_by_batch_and_heads():
    checks = _on_4_ranks("attention", "tp4,dp2tp2")
    assert checks.count("attention/") == 10


def test_mixed_precision_mlp():
    checks = _on_4_ranks("mlp", "dp4,dp2tp2", "bf16")
    assert "mlp+bf16/dp2tp2 grads x1" in checks  # one step against the fp32 reference


def test_compiled_matches_single_process_from_step_2_on():
    """The models whose compiled gradients used to go wrong from the second call on
    (LayerNorm statistics captured as constants) and Llama, 5 steps through inductor."""
    checks = _on_4_ranks(
        "mixer,tied,llama+recompute", "dp2tp2", env={"AP_COMPILE": "1"}, timeout=1500
    )
    assert "mixer+compile/dp2tp2 grads x5" in checks
    assert "tied+compile/dp2tp2 params after 5 steps" in checks
    assert "llama+recompute+compile/dp2tp2 grads x5" in checks
    assert "llama+recompute+compile/dp2tp2 recomputes 3 blocks" in checks


@pytest.mark.skipif(
    os.environ.get("AP_COMPILE_TEST") != "1",
    reason="two more cold compiles of Llama on 4 ranks; set AP_COMPILE_TEST=1",
)
def test_compiled_llama_on_1d_meshes():
    checks = _on_4_ranks("llama", "dp4,tp4", env={"AP_COMPILE": "1"}, timeout=1500)
    assert "llama+compile/dp4 grads x5" in checks and "llama+compile/tp4 grads x5" in checks


def test_moe_on_all_meshes_and_with_expert_parallelism():
    """The MoE decoder (tiny_moe): init bitwise, forward and every gradient at 5 steps on
    dp4, tp4, dp2xtp2 with the layouts the solver picks, and with the routed experts split
    over the first mesh dim (tokens dispatched by all-to-all inside the lowered graphs)."""
    checks = _on_4_ranks("moe,moe+ep,moe_bias+ep", "dp4,tp4,dp2tp2")
    for mesh in ("dp4", "tp4", "dp2tp2"):
        assert f"moe/{mesh} grads x5" in checks
        assert f"moe_bias+ep/{mesh} grads x5" in checks
        assert f"moe+ep/{mesh} grads x5" in checks
        assert f"moe+ep/{mesh} expert-parallel kernels 4 of 4" in checks
        # the experts' all-to-all finds its rank when it runs: one rank's lowering serves
        for model in ("moe", "moe+ep"):
            assert f"{model}/{mesh} lowering loaded by 2 of 4 ranks" in checks, (model, mesh)


def test_replicated_plan_matches_single_process():
    """With no parameter bound (the trainer's default when memory is plentiful) the dp4 plan
    replicates every parameter and all-reduces the gradients: every gradient at 5 steps."""
    checks = _on_4_ranks("llama+replicated", "dp4")
    assert "llama+replicated/dp4 grads x5" in checks
    assert "llama+replicated/dp4 params replicated 21 of 21, backward all-reduces" in checks


def test_expert_parallel_and_replicated_plans_compiled():
    checks = _on_4_ranks("moe+ep,llama+replicated", "dp4", env={"AP_COMPILE": "1"}, timeout=1500)
    assert "moe+ep+compile/dp4 grads x5" in checks
    assert "moe+ep+compile/dp4 expert-parallel kernels 4 of 4" in checks
    assert "llama+replicated+compile/dp4 grads x5" in checks
    assert "llama+replicated+compile/dp4 params replicated 21 of 21" in checks
    # the ranks' graphs name process groups by role and pick their chunks at run time, so on
    # dp4 every rank's graphs are the same code, and the check passed only if no more graphs
    # were compiled on the machine than are distinct
    assert "of 2 distinct" in _line(checks, "llama+replicated+compile/dp4 graphs compiled")
    assert "of 2 distinct" in _line(checks, "moe+ep+compile/dp4 graphs compiled")


@needs_transformers
def test_hf_moe_family_through_the_experts_op():
    """transformers' Mixtral (tiny config): its experts module runs as titan.routed_experts;
    init bitwise, forward and every gradient at 5 steps on dp2xtp2."""
    checks = _on_4_ranks("hf:mixtral", "dp2tp2")
    assert "hf:mixtral/dp2tp2 grads x5" in checks
