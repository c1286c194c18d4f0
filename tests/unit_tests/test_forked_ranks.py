"""`torchtitan.tools.forked_ranks`: ranks forked from one process that imported once get
torchrun's environment and meet in a process group; a failing rank ends the others and is
reported in torchrun's words (the integration harness's native-crash rule reads torchrun's
`exitcode  : -11 (pid: N)  (SIGSEGV)`); the ranks die with the launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchtitan.tools.loss_compare import REPO, rank_command


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(cmd: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ranks_get_torchruns_environment_and_meet_in_a_process_group(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
        # one write per line: ranks share the pipe
        seen = " ".join(os.environ[k] for k in keys)
        sys.stdout.write(f"{seen} {sys.argv[1:]} {int(total.item())}\\n")
        dist.destroy_process_group()
        """,
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run(
        rank_command(3, [str(script), "--flag", "x"], forked=True),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"{r} {r} 3 3 1 ['--flag', 'x'] 6" for r in range(3)]


def test_a_failing_rank_ends_the_others_and_is_named(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit("rank 1 gives up")
        time.sleep(600)  # the others would wait for it forever
        """,
    )
    start = time.monotonic()
    res = _run(rank_command(3, [str(script)], forked=True))
    assert time.monotonic() - start < 60
    assert res.returncode == 1
    assert "rank 1 gives up" in res.stderr
    assert "[forked_ranks] rank 1 failed: exitcode  : 1 (pid: " in res.stderr
    assert "SIG" not in res.stderr


def test_a_rank_killed_by_a_signal_reads_as_torchruns_native_crash(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(600)
        """,
    )
    res = _run(rank_command(2, [str(script)], forked=True))
    assert res.returncode == 1
    crash = r"\[forked_ranks\] rank 0 failed: exitcode  : -11 \(pid: \d+\)  \(SIGSEGV\)"
    assert re.search(crash, res.stderr), res.stderr


def test_a_module_runs_as_main_with_its_arguments(tmp_path):
    (tmp_path / "forked_probe.py").write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    sys.stdout.write(f'main {os.environ[\"RANK\"]} {sys.argv[1:]}\\n')\n"
    )
    cmd = rank_command(2, ["-m", "forked_probe", "--a", "1"], forked=True)
    res = _run(cmd, PYTHONPATH=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"main {r} ['--a', '1']" for r in range(2)]


def test_the_ranks_die_with_the_launcher(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = _script(
        tmp_path,
        f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        time.sleep(600)
        """,
    )
    proc = subprocess.Popen(rank_command(2, [str(script)], forked=True), cwd=REPO)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ranks = [int(p.name) for p in pids.iterdir()]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived the launcher"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as dead
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "2", "/no/such/script.py"], "error: /no/such/script.py: no such script"),
        (["--nproc", "0", "x.py"], "--nproc 0: give 1 or more ranks"),
        (["--nproc", "2"], "give a script to run, or -m MODULE"),
    ],
)
def test_bad_input_is_one_line(argv, message):
    res = _run([sys.executable, "-m", "torchtitan.tools.forked_ranks", *argv])
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_a_script_that_does_not_parse_fails_in_its_ranks(tmp_path):
    script = _script(tmp_path, "def broken(:\n")
    res = _run(rank_command(2, [str(script)], forked=True))
    assert res.returncode == 1
    assert "SyntaxError" in res.stderr
    assert res.stderr.count("[forked_ranks] rank ") == 1  # the first; it ends the other


def test_preloaded_modules_are_imported_before_the_fork(tmp_path):
    """A module the target imports only inside a function (here `json.tool`) is found
    loaded in every rank when `--preload` names it, and a preload that does not import is
    left to the ranks (the target here never needs it)."""
    script = _script(
        tmp_path,
        """
        import sys

        sys.stdout.write(f"json.tool loaded: {'json.tool' in sys.modules}\\n")
        """,
    )
    without = _run(rank_command(2, [str(script)], forked=True))
    with_it = _run(
        rank_command(2, [str(script)], forked=True, preload=["json.tool", "no_such_module_x"])
    )
    assert without.returncode == 0 and with_it.returncode == 0, with_it.stderr
    assert without.stdout.count("json.tool loaded: False") == 2
    assert with_it.stdout.count("json.tool loaded: True") == 2
