"""Pytest entry for the 4-rank numerics check (one torchrun launch, all three meshes).

Runs `autoparallel_numerics.py` under `torchrun --nproc_per_node=4` (gloo, CPU): Llama3
(2 small layers) on dp4, tp4 and dp2xtp2, then the MLP stack and the GPT-2 block on dp2xtp2,
then mixed precision for the MLP.  Takes a few minutes on 2 cores (planning the 2-D mesh for
Llama dominates).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def _torchrun(*args: str, timeout: int = 900, env: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(HERE, "autoparallel_numerics.py"), *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {}))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    out = res.stdout
    if res.returncode != 0 or "ALL OK" not in out:
        pytest.fail(f"torchrun rc={res.returncode}\n{out[-4000:]}\n{res.stderr[-4000:]}")
    return out


def test_llama_all_meshes_match_single_process():
    out = _torchrun("llama", "dp4,tp4,dp2tp2")
    assert out.count("OK   llama/") == 12


def test_mlp_and_gpt2_on_2d_mesh():
    out = _torchrun("mlp,gpt2", "dp2tp2")
    assert out.count("OK   ") == 8


def test_attention_op_split_by_batch_and_heads():
    out = _torchrun("attention", "tp4,dp2tp2")
    assert out.count("OK   attention/") == 10


def test_mixed_precision_mlp():
    out = _torchrun("mlp", "dp4,dp2tp2", "bf16")
    assert "OK   mlp+bf16/dp2tp2 grads" in out


@pytest.mark.skipif(os.environ.get("AP_COMPILE_TEST") != "1",
                    reason="cold inductor compile on 4 ranks takes ~4 min; set AP_COMPILE_TEST=1")
def test_compiled_llama_on_2d_mesh():
    out = _torchrun("mlp,llama", "dp2tp2", env={"AP_COMPILE": "1"}, timeout=1500)
    assert "OK   llama+compile/dp2tp2 grads" in out
