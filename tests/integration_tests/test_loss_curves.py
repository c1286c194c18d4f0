"""Loss curves of parallel configurations must match the 1-rank run step by step.

The reference is one rank with local batch 4 (FAST_ARGS: 10 steps, seq 64, seed 42,
deterministic). It must reproduce the golden file (same CPU numerics, rtol 1e-5) and
learn (loss at step 10 < step 1). Every 4-rank configuration sees the same global batch
(local_batch_size × dp degree = 4) and must match the reference within rtol 1e-4: only
the order of floating-point reductions may differ.

Activation checkpointing does not change the math, so instead of the full cross product
each mesh runs once without AC and once with one AC variant (full, selective op-level,
selective every-2nd-block: each variant is covered, on different meshes). About 30 s per
4-rank launch on 2 CPU cores, plus ~70 s for a cold inductor compile; the inductor cache lives in
`{repo}/.cache/inductor/<test id>/rank<r>` so that reruns are warm.

Run: .venv/bin/python -m pytest tests/integration_tests/test_loss_curves.py -v
"""

from __future__ import annotations

import pytest
from harness import REPO, run_training

from torchtitan.tools.loss_compare import assert_losses_close, read_golden

GOLDEN = REPO / "tests/assets/losses/llama3_cpu_1rank.txt"
GLOBAL_BATCH = 4
INDUCTOR_CACHE = REPO / ".cache" / "inductor"

DP_SHARD = "--parallelism.data_parallel_shard_degree"
DP_REPLICATE = "--parallelism.data_parallel_replicate_degree"
TP = "--parallelism.tensor_parallel_degree"
AC = "--activation_checkpoint.mode"

# id -> (data-parallel degree, options). All use 4 ranks.
MESHES = {
    "fsdp4": (4, [DP_SHARD, "4"]),
    "tp4": (1, [DP_SHARD, "1", TP, "4"]),
    "fsdp2_tp2": (2, [DP_SHARD, "2", TP, "2"]),
    "hsdp2x2": (4, [DP_REPLICATE, "2", DP_SHARD, "2"]),
    "ddp4": (4, [DP_REPLICATE, "4", DP_SHARD, "1"]),
}
# The AC variant each mesh is checked with in addition to "none": id suffix -> options.
AC_VARIANTS = {
    "full": [AC, "full"],
    "sel_op": [AC, "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "sel_2": [AC, "selective", "--activation_checkpoint.selective_ac_option", "2"],
}
AC_OF_MESH = {
    "fsdp4": "full",
    "tp4": "sel_op",
    "fsdp2_tp2": "sel_2",
    "hsdp2x2": "full",
    "ddp4": "sel_op",
}

CONFIGS = (
    [
        pytest.param(dp, [*opts, AC, "none"], id=f"{name}-ac_none")
        for name, (dp, opts) in MESHES.items()
    ]
    + [
        pytest.param(
            dp, [*opts, *AC_VARIANTS[AC_OF_MESH[name]]], id=f"{name}-ac_{AC_OF_MESH[name]}"
        )
        for name, (dp, opts) in MESHES.items()
    ]
    + [
        pytest.param(
            2, [*MESHES["fsdp2_tp2"][1], AC, "none", "--compile.enable"], id="fsdp2_tp2-compile"
        ),
    ]
)


def local_batch(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the 1-rank run, computed once for the module."""
    out = tmp_path_factory.mktemp("ref_1rank")
    run = run_training(1, local_batch(1), out).check()
    return run.losses()


def test_reference_matches_golden(reference):
    assert_losses_close(
        reference, read_golden(GOLDEN), rtol=1e-5, what=f"1-rank run vs {GOLDEN.name}"
    )


def test_reference_learns(reference):
    assert reference[10] < reference[1], f"loss did not go down: {reference}"


@pytest.mark.parametrize("dp, options", CONFIGS)
def test_4rank_matches_1rank(reference, dp, options, tmp_path, request):
    # A cached graph names its process groups: keep one cache per configuration (and
    # run_training keeps one per rank inside it).
    cache = INDUCTOR_CACHE / request.node.callspec.id
    run = run_training(4, [*options, *local_batch(dp)], tmp_path, inductor_cache=cache).check()
    assert_losses_close(
        run.losses(), reference, rtol=1e-4, what=f"4 ranks {' '.join(options)} vs 1 rank"
    )
