"""Failures and preemption under the launcher: a rank killed mid-run is restarted
(`--max-restarts`, run_train.sh's MAX_RESTARTS) from the newest intact checkpoint and the job
ends with the parameters and optimizer state of an uninterrupted run, bit for bit; SIGTERM
(a scheduler's preemption) stops every rank after its step with a checkpoint, exit code 0,
and the next launch resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from harness import (
    error_lines,
    finish,
    launcher_cmd,
    launcher_env,
    listening,
    node_args,
    rank_output,
    run_launcher,
    start_launcher,
    wait_for,
)

from torchtitan.launch import child_pids
from torchtitan.tools.local_processes import free_port
from torchtitan.tools.loss_compare import REPO, deterministic_args

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="needs Linux /proc to find the ranks"
)

ARGS = [
    "--training.seq_len",
    "64",
    "--checkpoint.enable",
    *deterministic_args(seed=3),
]


def start(dump: Path, args: list[str], node: list[str] = (), nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        launcher_cmd(dump, nproc, list(node), [*ARGS, *args]),
        cwd=REPO,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_pid(launcher: int, rank: int) -> int:
    for pid in child_pids(launcher):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} under launcher {launcher}")


def saved_state(checkpoint: Path, out: Path) -> dict:
    """Every tensor of a DCP checkpoint folder (model, optimizer, ...), read in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def assert_bitwise_equal(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    else:
        assert a == b, path


def test_a_killed_rank_restarts_and_the_job_ends_bitwise_as_an_uninterrupted_run(tmp_path):
    cadence = ["--training.steps", "8", "--checkpoint.interval", "2"]
    reference = finish(start(tmp_path / "ref", cadence))
    assert reference.returncode == 0, reference.stderr[-3000:]

    dump = tmp_path / "killed"
    proc = start(dump, cadence, ["--max-restarts", "1"])
    try:
        wait_for(lambda: "step:  5" in rank_output(dump), 240, "step 5")
        os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    finally:
        done = finish(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 1 of 1 after a failure: resuming from the newest intact checkpoint" in (
        done.stderr
    )
    assert "loaded checkpoint step-4" in done.stderr  # step-6 was not reached, or is later
    assert error_lines(done) == []
    assert_bitwise_equal(
        saved_state(dump / "checkpoint" / "step-8", tmp_path / "killed.pt"),
        saved_state(tmp_path / "ref" / "checkpoint" / "step-8", tmp_path / "ref.pt"),
    )


def test_sigterm_saves_after_the_step_exits_0_and_the_next_launch_resumes(tmp_path):
    proc = start(tmp_path, ["--training.steps", "1000", "--checkpoint.interval", "1000"])
    try:
        wait_for(lambda: "step:  3" in rank_output(tmp_path), 240, "step 3")
        os.kill(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
    finally:
        done = finish(proc)
    assert time.monotonic() - signalled < 60
    assert done.returncode == 0, done.stderr[-3000:]
    assert error_lines(done) == []
    assert "stopped by SIGTERM (preemption): the ranks saved a checkpoint" in done.stderr
    (saved,) = (tmp_path / "checkpoint").glob("step-*")
    step = int(saved.name.removeprefix("step-"))
    assert step >= 3
    resumed = finish(start(tmp_path, ["--training.steps", str(step + 2)]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint step-{step}" in resumed.stderr
    assert f"step: {step + 2:2d}" in resumed.stderr
    assert f"step: {step:2d} " not in resumed.stderr  # not trained again


def test_restarts_without_checkpoints_are_refused_before_any_rank_starts(tmp_path):
    proc = run_launcher(
        tmp_path, 2, ["--max-restarts", "2"], ["--training.seq_len", "64"], timeout=120
    )
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "error: MAX_RESTARTS (--max-restarts) 2 restarts the ranks from the newest checkpoint, "
        "but --checkpoint.enable is off: every restart would begin again at step 1; add "
        "--checkpoint.enable"
    ]


def test_a_whole_node_killed_rejoins_and_the_job_ends_bitwise_as_an_uninterrupted_run(tmp_path):
    cadence = ["--training.steps", "8", "--checkpoint.interval", "2"]
    reference = finish(start(tmp_path / "ref", cadence, nproc=4))  # one node of four
    assert reference.returncode == 0, reference.stderr[-3000:]

    dump, port = tmp_path / "nodes", free_port()
    restart = ["--max-restarts", "1"]
    node0, node1 = start(dump, cadence, node_args(2, 0, port, *restart)), None
    try:
        # The first agent at the endpoint hosts the rendezvous store; on loopback either
        # could.  The node killed below must not be that one: torchrun's c10d rendezvous
        # does not survive its host (on a cluster, the node RDZV_ENDPOINT names).
        wait_for(lambda: listening(port), 120, "node 0 hosting the rendezvous")
        node1 = start(dump, cadence, node_args(2, 1, port, *restart))
        wait_for(lambda: "step:  5" in rank_output(dump), 240, "step 5")
        for pid in child_pids(node1.pid):  # the whole "node": its ranks and its launcher
            os.kill(pid, signal.SIGKILL)
        node1.kill()
        node1.communicate()
        node1 = start(dump, cadence, node_args(2, 1, port, *restart))  # the node comes back
        done0, done1 = finish(node0), finish(node1)
    finally:
        for proc in (node0, node1):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert done0.returncode == 0, done0.stderr[-3000:]
    assert done1.returncode == 0, done1.stderr[-3000:]
    assert_bitwise_equal(
        saved_state(dump / "checkpoint" / "step-8", tmp_path / "nodes.pt"),
        saved_state(tmp_path / "ref" / "checkpoint" / "step-8", tmp_path / "ref.pt"),
    )


@pytest.mark.parametrize(
    "sig, line",
    [
        (
            signal.SIGTERM,
            "error: stopped by SIGTERM: the ranks were ended; nothing saved "
            "(--checkpoint.enable is off)",
        ),
        (signal.SIGINT, "error: stopped by SIGINT: the ranks were ended"),
    ],
)
def test_a_signal_without_checkpoints_is_one_line_and_128_plus_the_signal(sig, line, tmp_path):
    proc = start_launcher(tmp_path, 2, ["--training.seq_len", "64", "--training.steps", "1000"])
    try:
        wait_for(lambda: "step:  2" in rank_output(tmp_path), 240, "step 2")
        os.kill(proc.pid, sig)
    finally:
        done = finish(proc, timeout=60)
    assert done.returncode == 128 + sig
    assert error_lines(done) == [line]
    assert "Traceback" not in done.stdout + done.stderr
    assert "KeyboardInterrupt" not in done.stdout + done.stderr
    assert not child_pids(proc.pid)


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    proc = start_launcher(tmp_path, 2, ["--training.seq_len", "64", "--training.steps", "1000"])
    try:
        wait_for(lambda: "step:  2" in rank_output(tmp_path), 240, "step 2")
        ranks = child_pids(proc.pid)
        assert len(ranks) == 2
        proc.kill()  # SIGKILL: the launcher cannot pass anything on
        proc.communicate(timeout=60)
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 30, "ranks")
    finally:
        if proc.poll() is None:
            proc.kill()
