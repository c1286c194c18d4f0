"""What a run does when it goes wrong in ways a user meets: training that diverges stops
with one line and keeps its good checkpoints; a second job on the same dump folder is
refused without touching the first; a disk that fills up during a save is one line."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest
from harness import (
    error_lines,
    finish,
    rank_output,
    run_launcher,
    start_launcher,
    wait_for,
)

from torchtitan.components.checkpoint import verify_checkpoint

SHORT = ["--training.seq_len", "64"]


def run(dump, args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    return run_launcher(dump, nproc, [], [*SHORT, *args])


def test_divergence_stops_the_run_and_keeps_the_finite_checkpoints(tmp_path):
    diverging = ["--optimizer.lr", "1e4", "--training.max_norm", "0", "--training.steps", "12"]
    keep = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"]
    done = run(tmp_path, diverging + keep)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = error_lines(done)
    match = re.fullmatch(
        r"error: training diverged at step (\d+): loss (\S+), gradient norm (\S+); stopped "
        r"before the optimizer step, nothing saved after step (\d+); the newest checkpoint, "
        r"from a finite step, is (\S+); lower --optimizer.lr or clip gradients with "
        r"--training.max_norm",
        line,
    )
    assert match, line
    step, loss, norm, last, newest = match.groups()
    assert "nan" in (loss, norm) or "inf" in (loss, norm), line
    assert int(last) == int(step) - 1 and int(step) > 2
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").iterdir())
    assert saved and all(s < int(step) for s in saved), saved  # nothing saved or purged after
    assert newest == str(tmp_path / "checkpoint" / f"step-{saved[-1]}")
    logged = rank_output(tmp_path)
    for s in range(1, int(step)):  # every finite step was logged, the diverged one was not
        assert f"step: {s:2d}" in logged
    assert f"step: {int(step):2d}" not in logged


def test_divergence_without_checkpoints_says_nothing_was_saved(tmp_path):
    done = run(tmp_path, ["--optimizer.lr", "1e4", "--training.max_norm", "0"], nproc=1)
    assert done.returncode == 2
    (line,) = error_lines(done)
    assert "; nothing was saved (--checkpoint.enable is off); " in line, line


def test_a_second_job_on_the_same_dump_folder_is_refused_and_touches_nothing(tmp_path):
    first = start_launcher(tmp_path, 2, [*SHORT, "--training.steps", "1000"])
    try:
        wait_for(lambda: "step:  2" in rank_output(tmp_path), 240, "the first job's step 2")
        launcher_log = (tmp_path / "logs" / "launcher.log").read_text()
        second = run(tmp_path, ["--training.steps", "2"])
        assert second.returncode == 2
        assert error_lines(second) == [
            f"error: --job.dump_folder {tmp_path} is in use by another job (launcher pid "
            f"{first.pid} on {_hostname()}, started {_started(tmp_path)}); wait for it to end "
            "or stop it, or give this job another --job.dump_folder"
        ]
        # the first job's logs are untouched and it trains on
        assert (tmp_path / "logs" / "launcher.log").read_text().startswith(launcher_log)
        steps = rank_output(tmp_path).count("step:")
        wait_for(lambda: rank_output(tmp_path).count("step:") > steps, 120, "more steps")
        first.send_signal(signal.SIGINT)
    finally:
        stopped = finish(first, timeout=60)
    assert stopped.returncode == 128 + signal.SIGINT
    # once it has ended, the folder is free again (the kernel drops the lock with it)
    assert run(tmp_path, ["--training.steps", "2"], nproc=1).returncode == 0


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _started(dump) -> str:
    import json

    return json.loads((dump / "logs" / ".node0.lock").read_text())["started"]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_the_earlier_checkpoint_survives(mode, tmp_path):
    args = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "6"]
    args += ["--checkpoint.async_mode", mode, "--experimental.custom_import", "full_disk"]
    done = run_launcher(tmp_path, 2, [], [*SHORT, *args], FULL_DISK_AT_STEP="4")
    assert done.returncode == 2
    (line,) = error_lines(done)
    folder = tmp_path / "checkpoint"
    assert re.fullmatch(
        rf"error: rank \d failed: CheckpointSaveError: cannot save checkpoint step-4 in "
        rf"{re.escape(str(folder))}: \[Errno 28\] No space left on device; the "
        r"checkpoints saved before it are intact; free space there, or save elsewhere with "
        r"--job.dump_folder / --checkpoint.folder \(traceback: \S+\)",
        line,
    ), line
    assert "Traceback" not in done.stderr
    assert "step-2" in [p.name for p in folder.iterdir()]
    assert "step-4" not in [p.name for p in folder.iterdir()]
    assert verify_checkpoint(folder / "step-2", strict=True) is None


def test_rerunning_a_finished_job_says_there_is_nothing_to_do(tmp_path):
    args = ["--checkpoint.enable", "--training.steps", "2"]
    assert run(tmp_path, args, nproc=1).returncode == 0
    again = run(tmp_path, args, nproc=1)
    assert again.returncode == 0
    assert (
        "nothing to do: resumed at step 2 and --training.steps is 2; raise --training.steps "
        "to train further"
    ) in again.stderr + again.stdout
    assert "step:  1" not in rank_output(tmp_path)


def test_a_plan_predicted_above_the_memory_a_rank_has_stops_before_step_1(tmp_path):
    big = ["--training.seq_len", "8192", "--training.local_batch_size", "64"]
    done = run_launcher(tmp_path, 1, [], ["--model.name", "llama3_auto_parallel", *big])
    assert done.returncode == 2
    (line,) = error_lines(done)
    match = re.fullmatch(
        r"error: auto-parallel planner: constraints cannot all hold: memory budget "
        r"(\d+\.\d+) GiB per rank \(the least memory any plan needs under the other "
        r"constraints is (\d+\.\d+) GiB per rank\); the budget is what a rank has, "
        r"(\d+\.\d) GiB \(the machine's \d+\.\d GiB of RAM shared by 1 ranks\), less 10%: "
        r"lower the need with --activation_checkpoint.mode auto \(the planner recomputes "
        r"blocks to fit\) or full, more ranks, or a smaller --training.local_batch_size or "
        r"--training.seq_len",
        line,
    )
    assert match, line
    budget, least, available = (float(g) for g in match.groups())
    assert least > budget and budget == pytest.approx(0.9 * available, abs=0.1)
    assert "step:  1" not in rank_output(tmp_path)
