"""Launch real multi-rank training jobs (gloo) from tests and read their losses.

The runner, `Run` and the loss comparison live in `torchtitan.tools.loss_compare` (shared
with `scripts/loss_compare.py`); this module adds the small, fast test configuration.  The
ranks are forked from one process that imported the trainer once
(`torchtitan.tools.forked_ranks`: ~6 s less per launch than torchrun's interpreter per rank
on 2 cores); what torchrun itself does (restarts, nodes, signals) is tested through the
launcher, `run_launcher` and the functions after it.

The trainer leaves through barrier + flush + os._exit, which avoids gloo's occasional
SIGABRT in interpreter teardown (cpu_feasibility.md §2).  A rank can still die of a native
signal mid-run on this loaded box (SIGSEGV or SIGABRT inside gloo, the other ranks reporting
"Connection closed by peer"), at a step that the identical run before or after passes: such
a launch is repeated once, with a warning that pytest's summary shows (`native_crash`).
Any other non-zero exit, or a second crash, is a failure reported with the output's tail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

from torchtitan.tools import loss_compare
from torchtitan.tools.local_processes import free_port
from torchtitan.tools.loss_compare import DEBUG_TOML, REPO, Run, assert_losses_close  # noqa: F401

# Small and deterministic: enough steps and tokens to see the curve, quick on 2 cores.
# Options given to run_training come after these, so they override them.
FAST_ARGS = [
    "--training.steps",
    "10",
    "--training.seq_len",
    "64",
    *loss_compare.deterministic_args(seed=42),
]


def run_training(
    nproc: int,
    args: list[str],
    dump_folder: Path,
    timeout: int = 600,
    env: dict[str, str] | None = None,
    inductor_cache: Path | None = None,
    config_file: Path = DEBUG_TOML,
) -> Run:
    """Run `python -m torchtitan.train` on `nproc` CPU ranks with the debug config,
    FAST_ARGS and then `args` (see `loss_compare.run_training` for `inductor_cache`).

    A launch whose rank died of a native signal is run once more from the folder as it was
    before (the crashed attempt's is kept beside it, `<folder>.native-crash`)."""
    folder = Path(dump_folder)
    before = folder.with_name(f"{folder.name}.before-launch")
    shutil.rmtree(before, ignore_errors=True)
    if folder.exists():  # a checkpoint or plan a test put there: small, copied as it is
        shutil.copytree(folder, before, symlinks=True)

    def launch() -> Run:
        return loss_compare.run_training(
            nproc,
            [*FAST_ARGS, *args],
            dump_folder,
            timeout=timeout,
            env=env,
            inductor_cache=inductor_cache,
            config_file=config_file,
            forked=True,
        )

    run = launch()
    if signal := native_crash(run.returncode, run.output):
        kept = folder.with_name(f"{folder.name}.native-crash")
        shutil.rmtree(kept, ignore_errors=True)
        folder.rename(kept)
        if before.exists():
            before.rename(folder)
        warnings.warn(
            f"{dump_folder}: a rank died of {signal} (output in {kept}); run again", stacklevel=2
        )
        run = launch()
    shutil.rmtree(before, ignore_errors=True)
    return run


# torchrun's summary line for a rank ended by a signal: "exitcode  : -11 (pid: 123)  (SIGSEGV)"
_SIGNAL_EXIT = re.compile(r"exitcode\s*:\s*-\d+ \(pid: \d+\)\s+\((SIGSEGV|SIGABRT)\)")


def native_crash(returncode: int, output: str) -> str | None:
    """The signal ("SIGSEGV" or "SIGABRT") that killed a rank of a failed torchrun launch,
    or None when it failed otherwise (an error, a timeout, an assertion) or succeeded."""
    if returncode == 0:
        return None
    found = _SIGNAL_EXIT.search(output)
    return found.group(1) if found else None


def run_check_script(
    script: Path, nproc: int, args: list[str], timeout: float
) -> subprocess.CompletedProcess:
    """`script *args` on `nproc` forked ranks (one OpenMP thread per rank, output
    captured), repeated once if a rank died of a native signal (module docstring)."""
    cmd = loss_compare.rank_command(nproc, [str(script), *args], forked=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def launch() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    res = launch()
    if signal := native_crash(res.returncode, res.stdout + res.stderr):
        warnings.warn(f"{script.name}: a rank died of {signal}; run again", stacklevel=2)
        res = launch()
    return res


# ---- the launcher (`python -m torchtitan.launch`, what run_train.sh runs) ----------------
def listening(port: int) -> bool:
    """Whether a socket on this machine listens on TCP `port` (Linux: /proc/net/tcp*)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        # local address "ADDR:PORT" in hex; state 0A is LISTEN
        if any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows):
            return True
    return False


def launcher_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=str(REPO / "tests" / "assets" / "custom_specs"),
    )
    env.pop("TORCHTITAN_ERROR_DIR", None)
    env.update(extra)
    return env


def launcher_cmd(dump: Path, nproc: int, node_args: list[str], args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchtitan.launch",
        "--nproc",
        str(nproc),
        *node_args,
        "--config-file",
        str(DEBUG_TOML),
        "--",
        "--job.dump_folder",
        str(dump),
        *args,
    ]


def run_launcher(
    dump: Path,
    nproc: int,
    node_args: list[str],
    args: list[str],
    timeout: int = 600,
    **env: str,
) -> subprocess.CompletedProcess:
    """`launcher_cmd` run to its end from the repository, output captured."""
    return subprocess.run(
        launcher_cmd(dump, nproc, node_args, args),
        cwd=REPO,
        env=launcher_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_launcher(dump: Path, nproc: int, args: list[str]) -> subprocess.Popen:
    """`launcher_cmd` on one node started in the background from the repository, with
    its stdout and stderr piped (`finish` waits for it and collects them)."""
    return subprocess.Popen(
        launcher_cmd(dump, nproc, [], args),
        cwd=REPO,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def node_args(nnodes: int, node_rank: int, port: int, *extra: str) -> list[str]:
    return [
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *extra,
    ]


def launch_nodes(
    dump: Path, args: list[str], nnodes: int = 2, nproc: int = 2, timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Start `nnodes` launchers of `nproc` ranks sharing `dump`; wait for all of them."""
    port = free_port()
    procs = [
        subprocess.Popen(
            launcher_cmd(dump, nproc, node_args(nnodes, r, port), args),
            cwd=REPO,
            env=launcher_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nnodes)
    ]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return done


def launch_one(dump: Path, args: list[str], nproc: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher_cmd(dump, nproc, [], args),
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rank_output(dump: Path) -> str:
    return "".join(p.read_text() for p in (dump / "logs").rglob("stderr.log"))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
