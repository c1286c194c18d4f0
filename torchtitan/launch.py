"""Start a training job: preflight, then torchrun, then one line for whatever failed.

`run_train.sh` runs `python -m torchtitan.launch --nproc N [--log-ranks 0] [--config-file
F] -- <train options>`.  Before any rank starts, the configuration goes through
`torchtitan.preflight.check`.  The ranks run under torchrun (in this process, so its
report of a failure can be taken over): their console output is shown for
`--log-ranks`, every rank's full output is kept under `{dump_folder}/logs/`, and torchrun's
own messages go to `{dump_folder}/logs/launcher.log`.  When a rank fails, the line of
the report that explains it (`torchtitan.tools.rank_errors`) is printed as `error: ...`
and the exit code is 2 — no traceback from torchrun on the terminal.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from torchtitan.components.metrics import COLOR_ENV
from torchtitan.config import main_parse
from torchtitan.errors import UserInputError
from torchtitan.tools import rank_errors

# Once a rank has reported its failure, the others get this long to exit before they are
# killed (torchrun's agent waits 30 s after its SIGTERM, which a stopped rank never sees).
SHUTDOWN_TIMEOUT_S = 5


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m torchtitan.launch")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start")
    parser.add_argument("--log-ranks", default="0", help="ranks whose output is shown")
    parser.add_argument("--config-file", help="TOML used unless the options name one")
    own, train = argv, []
    if "--" in argv:
        i = argv.index("--")
        own, train = argv[:i], argv[i + 1 :]
    args = parser.parse_args(own)
    named = any(t.split("=")[0].replace("-", "_") == "__job.config_file" for t in train)
    if args.config_file and not named:
        train = ["--job.config_file", args.config_file, *train]
    return args, train


def _log_to_file(path: Path) -> None:
    """torchrun's agent logs (rendezvous, 'failed (exitcode: 2)', ...) go to `path` only."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elastic = logging.getLogger("torch.distributed")
    elastic.handlers = [handler]  # replaces torch's own console handler in this process
    elastic.propagate = False


def _torchrun_args(nproc: int, log_ranks: str, log_dir: Path, train: list[str]):
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--role",
            "rank",
            "--local-ranks-filter",
            log_ranks,
            "--tee",
            "3",
            "--log-dir",
            str(log_dir),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            "-m",
            "torchtitan.train",
            *train,
        ]
    )


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is `parent` (for the launcher: the ranks torchrun started);
    Linux /proc only, empty elsewhere."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry.parent.name))
    return pids


def _kill_ranks_after_failure(folder: Path) -> set[int]:
    """Daemon: when a first rank report appears, SIGKILL the ranks left after the grace.
    Returns the (growing) set of pids it killed."""
    killed: set[int] = set()

    def watch() -> None:
        while not rank_errors.read_reports(folder):
            time.sleep(0.5)
        time.sleep(SHUTDOWN_TIMEOUT_S)
        for pid in child_pids(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass

    threading.Thread(target=watch, name="kill-ranks-after-failure", daemon=True).start()
    return killed


def _died_on_its_own(failure, killed_here: set[int]) -> bool:
    """A rank death by a signal that neither torchrun (SIGTERM, when it stops the ranks
    left after a failure) nor this launcher (SIGKILL, `_kill_ranks_after_failure`) sent:
    the OOM killer, a segfault, an abort."""
    name = failure.signal_name()
    return name not in ("<N/A>", "SIGTERM") and failure.pid not in killed_here


def _failure_line(folder: Path, failures: dict, killed_here: set[int]) -> str:
    """Which failure to tell the user about.  A rank that died on its own writes no report,
    and its peers then fail with secondary errors ("connection closed"), so such a death
    wins over every report but an input error; otherwise the report `first_report` picks,
    and without any report the first rank torchrun saw fail."""
    report = rank_errors.first_report(folder)
    reported = {r["rank"] for r in rank_errors.read_reports(folder)}
    died = {
        rank: f
        for rank, f in failures.items()
        if rank not in reported and _died_on_its_own(f, killed_here)
    }
    if report is not None and (report["user_error"] or not died):
        return report["line"]
    rank, failure = min((died or failures).items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    how = (
        f"signal {failure.signal_name()}"
        if failure.signal_name() != "<N/A>"
        else f"exit code {failure.exitcode}"
    )
    return (
        f"rank {rank} died ({how}) without an error report; its output is under "
        f"{folder / 'ranks'} and torchrun's in {folder / 'launcher.log'}"
    )


def run(nproc: int, log_ranks: str, train: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from torchtitan import preflight

    job_config = main_parse(train)  # prints the help, or one error line, and exits
    try:
        print(preflight.check(job_config, nproc), flush=True)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = Path(job_config.job.dump_folder).resolve() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    rank_errors.clear_reports(folder)
    shutil.rmtree(folder / "ranks", ignore_errors=True)
    _log_to_file(folder / "launcher.log")
    os.environ[rank_errors.ERROR_DIR_ENV] = str(folder)
    os.environ.setdefault(COLOR_ENV, "1" if sys.stderr.isatty() else "0")
    killed_here = _kill_ranks_after_failure(folder)
    try:
        torchrun(_torchrun_args(nproc, log_ranks, folder / "ranks", train))
    except ChildFailedError as e:
        print(f"error: {_failure_line(folder, e.failures, killed_here)}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> None:
    args, train = _parse(argv)
    code = run(args.nproc, args.log_ranks, train)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
