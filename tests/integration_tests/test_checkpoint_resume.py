"""Real multi-rank jobs that save, crash, resume and reshard checkpoints (gloo on CPU).

One uninterrupted FSDP dp2 run (checkpoints at steps 5 and 10) is the reference; other
jobs resume from it or from their own checkpoints and must reproduce its losses:
bit for bit on the same mesh, within rtol 1e-4 on another mesh (the global batch is kept
at 4 sequences, so every mesh sees the same data). About 4 minutes on 2 cores.

Run: .venv/bin/python -m pytest tests/integration_tests/test_checkpoint_resume.py -v
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import crash_during_save
import pytest
import torch
from harness import FAST_ARGS, assert_losses_close, launch_nodes, run_training

from torchtitan.components.checkpoint import SafeReader
from torchtitan.tools.loss_compare import read_tb_losses

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
PLANNED = ["--model.name", "llama3_auto_parallel"]
GLOBAL_BATCH = 4


def batch_args(nproc: int, tp: int = 1) -> list[str]:
    """Local batch so that the global batch is GLOBAL_BATCH on `nproc` ranks."""
    dp = nproc // tp
    return [
        "--training.local_batch_size",
        str(GLOBAL_BATCH // dp),
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
        "--parallelism.tensor_parallel_degree",
        str(tp),
    ]


def steps(losses: dict[int, float], first: int, last: int) -> dict[int, float]:
    return {s: losses[s] for s in range(first, last + 1)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """10 uninterrupted steps on dp2; leaves step-5 and step-10 in {dump}/checkpoint."""
    dump = tmp_path_factory.mktemp("reference")
    run_training(2, CKPT + batch_args(2), dump).check()
    return dump


def reference_losses(reference: Path) -> dict[int, float]:
    from torchtitan.tools.tensorboard_io import read_scalars

    return read_scalars(reference / "tb")


def test_stop_resume_and_kill_during_save(reference, tmp_path):
    """Stopped after step 5, restarted, killed while writing step 10, restarted again."""
    expected = reference_losses(reference)
    assert sorted(p.name for p in (reference / "checkpoint").iterdir()) == ["step-10", "step-5"]

    first = run_training(
        2, CKPT + batch_args(2) + ["--training.stop_at_step", "5"], tmp_path
    ).check()
    assert first.losses() == steps(expected, 1, 5)
    assert "stopping after step 5" in first.output
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-5"]

    # The restart resumes at step 6 and reproduces the uninterrupted run exactly; then
    # rank 1 is SIGKILLed in the middle of writing step 10 (see crash_during_save.py), a
    # save in the background while the job goes on to its end.
    killed = crash_during_save.run_training(
        10, 2, CKPT + batch_args(2) + ["--checkpoint.async_mode", "async"], tmp_path
    )
    assert killed.returncode != 0, killed.output[-3000:]
    assert "loaded checkpoint step-5" in killed.output
    assert killed.losses() == expected  # steps 6-10 of the resumed job are bitwise equal
    leftovers = [p.name for p in (tmp_path / "checkpoint").iterdir()]
    partial = [name for name in leftovers if name.startswith("step-10.tmp-")]
    assert "step-10" not in leftovers and len(partial) == 1, leftovers

    # The next job reports the half-written checkpoint, resumes from step 5 and finishes.
    again = run_training(2, CKPT + batch_args(2), tmp_path).check()
    assert re.search(rf"incomplete checkpoint \S*{re.escape(partial[0])}", again.output), (
        again.output[-3000:]
    )
    assert "loaded checkpoint step-5" in again.output
    assert "loaded checkpoint step-10" not in again.output
    assert again.losses() == expected
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-10", "step-5"]


def _resume(
    source: Path, nproc: int, dump: Path, extra: tuple[str, ...] = (), tp: int = 1
) -> dict[int, float]:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source, dump / "checkpoint" / "step-5")
    run = run_training(nproc, CKPT + batch_args(nproc, tp) + list(extra), dump).check()
    assert "loaded checkpoint step-5" in run.output
    return run.losses()


def test_reshard_dp2_to_one_rank_and_export(reference, tmp_path):
    """Also: the final save is a bfloat16 model-only export."""
    expected = reference_losses(reference)
    export = ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    losses = _resume(reference / "checkpoint" / "step-5", 1, tmp_path, tuple(export))
    assert_losses_close(losses, steps(expected, 6, 10), rtol=1e-4)
    meta = SafeReader(tmp_path / "checkpoint" / "step-10").read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in meta and not any(k.startswith("optimizer.") for k in meta)
    assert {m.properties.dtype for m in meta.values()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def tp_checkpoint(reference, tmp_path_factory) -> Path:
    """Steps 1-5 on dp2 × tp2 (4 ranks); their losses match the dp2 reference."""
    dump = tmp_path_factory.mktemp("tp")
    run = run_training(
        4, CKPT + batch_args(4, tp=2) + ["--training.stop_at_step", "5"], dump
    ).check()
    assert_losses_close(run.losses(), steps(reference_losses(reference), 1, 5), rtol=1e-4)
    return dump / "checkpoint" / "step-5"


@pytest.mark.parametrize("nproc", [4, 1], ids=["dp4", "one_rank"])
def test_reshard_dp2_tp2_to(nproc, reference, tp_checkpoint, tmp_path):
    losses = _resume(tp_checkpoint, nproc, tmp_path)
    assert_losses_close(losses, steps(reference_losses(reference), 6, 10), rtol=1e-4)


def test_initial_load_path_model_only(reference, tmp_path):
    """A fresh job starts from the reference's final weights: step 1 only, no resume."""
    source = reference / "checkpoint" / "step-10"
    run = run_training(
        1,
        CKPT
        + batch_args(1)
        + [
            "--checkpoint.initial_load_path",
            str(source),
            "--training.stop_at_step",
            "1",
        ],
        tmp_path,
    ).check()
    assert f"loaded initial_load_path (model weights only) from {source}" in run.output
    losses = run.losses()
    assert list(losses) == [1]  # the step counter was not restored
    assert losses[1] < reference_losses(reference)[1] - 0.2  # but the weights were


def test_bad_initial_load_path_is_one_line_error(tmp_path):
    bad = tmp_path / "no-such-checkpoint"
    run = run_training(1, CKPT + ["--checkpoint.initial_load_path", str(bad)], tmp_path / "dump")
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "initial_load_path" in errors[0], (
        run.output[-3000:]
    )
    assert "torchtitan/components/checkpoint/" not in run.output  # no traceback from us


@pytest.fixture(scope="module")
def two_node_checkpoint(reference, tmp_path_factory) -> Path:
    """Steps 1-5 of hand-written dp4 on two "nodes" of 2 ranks (two launchers meeting at a
    c10d rendezvous on 127.0.0.1); their losses match the dp2 reference."""
    dump = tmp_path_factory.mktemp("two_nodes")
    args = FAST_ARGS + CKPT + batch_args(4) + ["--training.stop_at_step", "5"]
    for proc in launch_nodes(dump, args):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_close(
        read_tb_losses(dump / "tb"), steps(reference_losses(reference), 1, 5), rtol=1e-5
    )
    return dump / "checkpoint" / "step-5"


def test_a_two_node_dp4_checkpoint_continues_on_one_node_of_2(
    reference, two_node_checkpoint, tmp_path
):
    losses = _resume(two_node_checkpoint, 2, tmp_path)
    assert_losses_close(losses, steps(reference_losses(reference), 6, 10), rtol=1e-5)


@pytest.fixture(scope="module")
def planned_tp4_checkpoint(reference, tmp_path_factory) -> Path:
    """Steps 1-5 of the planner's plan on tp4 (4 ranks)."""
    dump = tmp_path_factory.mktemp("planned_tp4")
    args = CKPT + batch_args(4, tp=4) + [*PLANNED, "--training.stop_at_step", "5"]
    run = run_training(4, args, dump).check()
    assert_losses_close(run.losses(), steps(reference_losses(reference), 1, 5), rtol=1e-4)
    return dump / "checkpoint" / "step-5"


@pytest.mark.parametrize("spec", [PLANNED, []], ids=["planned_dp2", "hand_written_dp2"])
def test_a_planned_tp4_checkpoint_continues_on_2_ranks(
    spec, reference, planned_tp4_checkpoint, tmp_path
):
    losses = _resume(planned_tp4_checkpoint, 2, tmp_path, tuple(spec))
    assert_losses_close(losses, steps(reference_losses(reference), 6, 10), rtol=1e-4)
