"""`run_train.sh`'s launcher on 2 CPU ranks: a rank's failure is one `error:` line and exit
code 2 (details in `{dump}/logs/`), a stalled rank ends the job within the train timeout,
a bad cached plan is planned again, `--help` starts no rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import launcher_env

from torchtitan.autoparallel import Plan
from torchtitan.launch import child_pids
from torchtitan.tools.loss_compare import DEBUG_TOML, REPO

FAST = ["--training.seq_len", "64", "--training.seed", "1", "--lr_scheduler.warmup_steps", "1"]


def _launch_cmd(dump: Path, *args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchtitan.launch",
        "--nproc",
        str(nproc),
        "--config-file",
        str(DEBUG_TOML),
        "--",
        "--job.dump_folder",
        str(dump),
        *FAST,
        *args,
    ]


def _launch(dump: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _launch_cmd(dump, *args),
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize(
    "spec, line",
    [
        (
            "fails_on_rank1",
            "rank 1 failed: RuntimeError: boom on rank 1 (traceback: {logs}/error_rank1.log)",
        ),
        ("refuses_on_rank1", "--model.flavor: rank 1 refuses it"),
    ],
)
def test_a_rank_failure_is_one_line_from_that_rank(spec, line, tmp_path):
    proc = _launch(
        tmp_path,
        "--training.steps",
        "2",
        "--experimental.custom_import",
        "failing_specs",
        "--model.name",
        spec,
    )
    logs = tmp_path / "logs"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _error_lines(proc) == ["error: " + line.format(logs=logs)]  # rank 1 is not shown
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "ChildFailedError" not in proc.stdout + proc.stderr
    assert (
        (logs / "error_rank1.log")
        .read_text()
        .rstrip()
        .endswith(
            "RuntimeError: boom on rank 1"
            if spec == "fails_on_rank1"
            else "UserInputError: --model.flavor: rank 1 refuses it"
        )
    )
    assert json.loads((logs / "error_rank1.json").read_text())["rank"] == 1
    # torchrun's own account goes to the log (which rank it saw first is a race: rank 0
    # fails too, on the closed connection, moments after rank 1)
    assert "failed (exitcode: 2) local_rank: " in (logs / "launcher.log").read_text()


def test_an_unexpected_failure_in_preflight_is_one_line_with_its_traceback_kept(tmp_path):
    proc = _launch(
        tmp_path,
        "--experimental.custom_import",
        "failing_specs",
        "--model.name",
        "tokenizer_bug",
    )
    assert proc.returncode == 2
    (line,) = _error_lines(proc)
    match = re.fullmatch(
        r"error: preflight failed: RuntimeError: tokenizer bug \(traceback: (\S+)\)", line
    )
    assert match, line
    assert "Traceback" not in proc.stdout + proc.stderr
    kept = Path(match.group(1))
    assert kept.read_text().rstrip().endswith("RuntimeError: tokenizer bug")
    kept.unlink()
    assert not (tmp_path / "logs").exists()  # nothing written before the ranks would start


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in child_pids(launcher):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            pass
    return None


def _rank_output(dump: Path, rank: int) -> str:
    """What rank `rank` logged so far (torchrun keeps it under {dump}/logs/ranks/)."""
    return "".join(p.read_text() for p in (dump / "logs" / "ranks").rglob(f"{rank}/stderr.log"))


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "sig, pattern",
    [
        # stopped: its peers time out after the first step, the stopped rank is killed
        (
            signal.SIGSTOP,
            r"rank 0 failed: CollectiveTimeoutError: step \d+: a collective waited "
            r"longer than --comm\.train_timeout_seconds 5; another rank stalled or died",
        ),
        # killed (as by the OOM killer): no report of its own, yet it is the rank named
        (signal.SIGKILL, r"rank 1 died \(signal SIGKILL\) without an error report"),
    ],
)
def test_a_stopped_or_killed_rank_ends_the_job_soon_naming_the_cause(sig, pattern, tmp_path):
    proc = subprocess.Popen(
        _launch_cmd(tmp_path, "--training.steps", "1000", "--comm.train_timeout_seconds", "5"),
        cwd=REPO,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: "step:  3" in _rank_output(tmp_path, 0), 180, "step 3")
        rank1 = _rank_pid(proc.pid, 1)
        assert rank1 is not None
        os.kill(rank1, sig)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2
    errors = [e for e in stderr.splitlines() if e.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.match("error: " + pattern, errors[0]), errors[0]
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after rank 1 got {sig.name}"


def test_a_bad_cached_plan_is_planned_again_and_replaced(tmp_path):
    args = ("--model.name", "llama3_auto_parallel", "--training.steps", "1")
    first = _launch(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    (plan_file,) = (tmp_path / "plans").glob("*.json")
    good = Plan.from_json(plan_file.read_text())
    plan_file.write_text(plan_file.read_text()[:2000])  # truncated
    second = _launch(tmp_path, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"cached plan {plan_file} is unusable (not a plan: " in second.stderr
    assert "planning again and replacing it" in second.stderr
    assert Plan.from_json(plan_file.read_text()).params == good.params
    assert "\x1b[" not in second.stdout + second.stderr  # no colour codes off a terminal
    assert "step:  1" in second.stderr


def test_help_is_printed_once_and_starts_no_rank(tmp_path):
    proc = _launch(tmp_path, "--help")
    assert proc.returncode == 0
    assert proc.stdout.count("usage:") == 1 and "--comm.train_timeout_seconds" in proc.stdout
    assert "[rank" not in proc.stdout + proc.stderr
    assert not (tmp_path / "logs").exists()


def test_planner_settings_come_from_the_autoparallel_section(tmp_path):
    section = (
        "--model.name",
        "llama3_auto_parallel",
        "--training.steps",
        "1",
        "--job.custom_config_module",
        "torchtitan.experiments.auto_parallel.job_config",
    )
    uncached = _launch(tmp_path / "uncached", *section, "--autoparallel.no_plan_cache")
    assert uncached.returncode == 0, uncached.stderr[-3000:]
    assert not (tmp_path / "uncached" / "plans").exists()
    tight = _launch(tmp_path / "tight", *section, "--autoparallel.memory_budget_gib", "0.0001")
    assert tight.returncode == 2
    (line,) = _error_lines(tight)  # and the least memory any plan needs
    assert re.fullmatch(
        r"error: auto-parallel planner: constraints cannot all hold: memory budget 0\.0001 GiB "
        r"per rank \(the least memory any plan needs under the other constraints is "
        r"0\.0\d+ GiB per rank\)",
        line,
    ), line


def test_relative_paths_mean_the_directory_run_train_sh_is_run_from(tmp_path):
    data = tmp_path / "data" / "docs.jsonl"
    data.parent.mkdir()
    data.write_text(
        "\n".join(json.dumps({"text": f"document {i} " + "word " * 300}) for i in range(8))
    )
    proc = subprocess.run(
        [str(REPO / "run_train.sh"), *FAST, "--training.steps", "1"]
        + ["--job.dump_folder", "out", "--training.dataset_path", "data/docs.jsonl"],
        cwd=tmp_path,
        env=launcher_env(NGPU="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "logs" / "launcher.log").is_file()
    assert not (REPO / "out").exists()
    assert f"from {data}" in proc.stdout + proc.stderr  # "Preparing dataset ... from <path>"
