"""Start a training job: preflight, then torchrun, then one line for whatever failed.

`run_train.sh` runs `python -m torchtitan.launch --nproc N [--log-ranks 0] [--config-file
F] [--cwd DIR] -- <train options>` (relative paths among the options mean DIR).  Before
any rank starts, the configuration goes through `torchtitan.preflight.check`.  The ranks
run under torchrun (in this process, so its report of a failure can be taken over): their
console output is shown for `--log-ranks`, every rank's full output is kept under
`{dump_folder}/logs/`, and torchrun's own messages go to `{dump_folder}/logs/launcher.log`.
When a rank fails, the line of the report that explains it (`torchtitan.tools.rank_errors`)
is printed as `error: ...` and the exit code is 2 — no traceback from torchrun on the
terminal."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.metrics import COLOR_ENV
from torchtitan.config import main_parse
from torchtitan.config.cli_paths import resolve_cli_paths
from torchtitan.errors import UserInputError
from torchtitan.tools import rank_errors
from torchtitan.tools.folder_lock import lock_dump_folder

# Once a rank has reported its failure, the others get this long to exit before they are
# killed (torchrun's agent waits 30 s after its SIGTERM, which a stopped rank never sees).
SHUTDOWN_TIMEOUT_S = 5
# After SIGTERM (preemption), the ranks get this long to finish their step and save.
PREEMPT_GRACE_S = 120


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit in the job: `nnodes` launchers (one per node, each
    starting `nproc` ranks) meet at `rdzv_endpoint` (torchrun's c10d rendezvous).  One
    node without an endpoint is torchrun's `--standalone`."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "torchtitan"
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None

    def describe(self) -> str:
        """One line for the launcher's log: this node's place and the rendezvous."""
        where = (
            "one node (standalone)"
            if self.standalone
            else f"node {self.node_rank} of {self.nnodes}, rendezvous '{self.rdzv_id}' at "
            f"{self.rdzv_endpoint}"
        )
        restarts = f", up to {self.max_restarts} restarts" if self.max_restarts else ""
        return f"{where}: {self.nproc} ranks here, {self.world_size} in all{restarts}"

    def check(self) -> None:
        """One `UserInputError` naming the variable (as `run_train.sh` spells it) at fault."""
        if self.nproc < 1:
            raise UserInputError(f"NGPU (--nproc) must be at least 1, got {self.nproc}")
        if self.nnodes < 1:
            raise UserInputError(f"NNODES (--nnodes) must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserInputError(
                f"NODE_RANK (--node-rank) {self.node_rank} is not in 0..{self.nnodes - 1} "
                f"for NNODES {self.nnodes}"
            )
        if self.max_restarts < 0:
            raise UserInputError(
                f"MAX_RESTARTS (--max-restarts) must be 0 or more, got {self.max_restarts}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise UserInputError(
                f"NNODES {self.nnodes} needs RDZV_ENDPOINT (--rdzv-endpoint host:port), the "
                "address every node's launcher meets at, e.g. RDZV_ENDPOINT=node0:29500"
            )
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserInputError(
                    f"RDZV_ENDPOINT (--rdzv-endpoint) {self.rdzv_endpoint!r} is not host:port, "
                    "e.g. node0:29500"
                )


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m torchtitan.launch")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--rdzv-endpoint", help="host:port where the nodes' launchers meet")
    parser.add_argument("--rdzv-id", default="torchtitan", help="the job's rendezvous id")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank this many times after a failure (resuming from the newest "
        "intact checkpoint)",
    )
    parser.add_argument("--log-ranks", default="0", help="local ranks whose output is shown")
    parser.add_argument("--config-file", help="TOML used unless the options name one")
    parser.add_argument(
        "--cwd",
        help="the directory the user ran the command in: relative paths among the train "
        "options mean it (config/cli_paths.py)",
    )
    own, train = argv, []
    if "--" in argv:
        i = argv.index("--")
        own, train = argv[:i], argv[i + 1 :]
    args = parser.parse_args(own)
    named = any(t.split("=")[0].replace("-", "_") == "__job.config_file" for t in train)
    if args.config_file and not named:
        train = ["--job.config_file", args.config_file, *train]
    if args.cwd:
        train = resolve_cli_paths(train, args.cwd)
    return args, train


def _log_to_file(path: Path, first_line: str) -> None:
    """torchrun's agent logs (rendezvous, 'failed (exitcode: 2)', ...) go to `path` only,
    after `first_line`."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elastic = logging.getLogger("torch.distributed")
    elastic.handlers = [handler]  # replaces torch's own console handler in this process
    elastic.propagate = False
    own = logging.getLogger("torchtitan.launch")
    own.handlers = [handler]
    own.propagate = False
    own.setLevel(logging.INFO)
    own.info(first_line)


def _torchrun_args(
    nodes: Nodes, log_ranks: str, log_dir: Path, train: list[str], sigterm: bool = True
):
    """torchrun's options; `sigterm=False` leaves SIGTERM to this launcher (`_Preemption`)."""
    from torch.distributed.run import get_args_parser

    if nodes.standalone:
        where = ["--standalone"]
    else:
        where = [  # no --node-rank: the c10d rendezvous orders the nodes itself
            f"--nnodes={nodes.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes.rdzv_endpoint}",
            f"--rdzv-id={nodes.rdzv_id}",
        ]
    return get_args_parser().parse_args(
        [
            *where,
            f"--nproc_per_node={nodes.nproc}",
            f"--max-restarts={nodes.max_restarts}",
            "--signals-to-handle",
            "SIGTERM,SIGINT,SIGHUP,SIGQUIT" if sigterm else "SIGINT,SIGHUP,SIGQUIT",
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


def _kill(pids: list[int], killed: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except ProcessLookupError:
            pass


def _attempt_of(pid: int) -> int | None:
    """The restart count torchrun gave rank process `pid` (None if it is gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"TORCHELASTIC_RESTART_COUNT="):
            return int(entry.split(b"=", 1)[1])
    return 0


def _kill_ranks_after_failure(folder: Path) -> set[int]:
    """Daemon: when a new rank report appears, SIGKILL the ranks of that attempt still
    alive after the grace (ranks torchrun started again after a restart, with a higher
    restart count, are left alone).  Returns the (growing) set of pids it killed."""
    killed: set[int] = set()

    def watch() -> None:
        handled: set[tuple[int, float]] = set()
        while True:
            reports = rank_errors.read_reports(folder)
            new = [r for r in reports if (r["rank"], r["time"]) not in handled]
            if not new:
                time.sleep(0.5)
                continue
            time.sleep(SHUTDOWN_TIMEOUT_S)
            attempts = {r.get("attempt", 0) for r in new}
            handled |= {(r["rank"], r["time"]) for r in new}
            ranks = [pid for pid in child_pids(os.getpid()) if _attempt_of(pid) in attempts]
            _kill(ranks, killed)

    threading.Thread(target=watch, name="kill-ranks-after-failure", daemon=True).start()
    return killed


class _Preemption:
    """SIGTERM to the launcher (a scheduler preempting the job): passed on to this node's
    ranks, which save a checkpoint after their step and exit 0 (`components/preemption`);
    any rank still running `PREEMPT_GRACE_S` later is killed."""

    def __init__(self) -> None:
        self.signalled = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.signalled:
            return
        self.signalled = True
        ranks = child_pids(os.getpid())
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

        def deadline() -> None:
            time.sleep(PREEMPT_GRACE_S)
            _kill(ranks, set())

        threading.Thread(target=deadline, name="preemption-deadline", daemon=True).start()


def _died_on_its_own(failure, killed_here: set[int]) -> bool:
    """A rank death by a signal that neither torchrun (SIGTERM, when it stops the ranks
    left after a failure) nor this launcher (SIGKILL, `_kill_ranks_after_failure`) sent:
    the OOM killer, a segfault, an abort."""
    name = failure.signal_name()
    return name not in ("<N/A>", "SIGTERM") and failure.pid not in killed_here


def _failure_line(folder: Path, own: Path, failures: dict, killed_here: set[int]) -> str:
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
        f"{own / 'ranks'} and torchrun's in {own / 'launcher.log'}"
    )


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _keep_traceback(e: BaseException) -> str:
    """Write `e`'s traceback to a temporary file (preflight writes nothing into the dump
    folder) and return its path."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="torchtitan-preflight-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(e)))
    return path


def _log_folders(dump_folder: str, nodes: Nodes) -> tuple[Path, Path]:
    """(the job's report folder, this node's own log folder).  Rank reports are named by
    global rank, so every node's launcher can read them all when the dump folder is shared;
    rank output and torchrun's log are per node."""
    reports = Path(dump_folder).resolve() / "logs"
    own = reports if nodes.nnodes == 1 else reports / f"node{nodes.node_rank}"
    return reports, own


def run(nodes: Nodes, log_ranks: str, train: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from torchtitan import preflight

    job_config = main_parse(train)  # prints the help, or one error line, and exits
    try:
        nodes.check()
        if nodes.max_restarts and not job_config.checkpoint.enable:
            raise UserInputError(
                f"MAX_RESTARTS (--max-restarts) {nodes.max_restarts} restarts the ranks from "
                "the newest checkpoint, but --checkpoint.enable is off: every restart would "
                "begin again at step 1; add --checkpoint.enable"
            )
        print(preflight.check(job_config, nodes.world_size), flush=True)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug, or an input preflight does not know
        print(
            f"error: preflight failed: {_one_line(e)} (traceback: {_keep_traceback(e)})",
            file=sys.stderr,
        )
        return 2
    folder, own = _log_folders(job_config.job.dump_folder, nodes)
    try:  # held until this process ends
        lock = lock_dump_folder(folder, nodes.node_rank, job_config.job.dump_folder)  # noqa: F841
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    own.mkdir(parents=True, exist_ok=True)
    rank_errors.clear_reports(folder)  # before the rendezvous: no rank runs yet anywhere
    shutil.rmtree(own / "ranks", ignore_errors=True)
    _log_to_file(own / "launcher.log", nodes.describe())
    os.environ[rank_errors.ERROR_DIR_ENV] = str(folder)
    os.environ.setdefault(COLOR_ENV, "1" if sys.stderr.isatty() else "0")
    # Output lines carry the global rank (torchrun's default is the node-local one).
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    if nodes.max_restarts:
        # Every attempt's ranks get a store of their own (rank 0 hosts it).  On the agent's
        # shared store the keys of the attempt before remain, and a restarted rank reads its
        # dead peers' addresses from them (gloo: "connectFullMesh failed ... refused").
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    preemption = None
    if job_config.checkpoint.enable:  # SIGTERM is ours: stop after a step, with a checkpoint
        preemption = _Preemption()
    killed_here = _kill_ranks_after_failure(folder)
    try:
        torchrun(_torchrun_args(nodes, log_ranks, own / "ranks", train, preemption is None))
    except ChildFailedError as e:
        if preemption is not None and preemption.signalled and not rank_errors.read_reports(folder):
            print(
                f"error: stopped by SIGTERM: the ranks did not finish their step and save "
                f"within {PREEMPT_GRACE_S} s and were killed",
                file=sys.stderr,
            )
            return 128 + signal.SIGTERM
        print(f"error: {_failure_line(folder, own, e.failures, killed_here)}", file=sys.stderr)
        return 2
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        saved = "; nothing saved (--checkpoint.enable is off)" if name == "SIGTERM" else ""
        print(f"error: stopped by {name}: the ranks were ended{saved}", file=sys.stderr)
        return 128 + int(e.sigval)
    if preemption is not None and preemption.signalled:
        print(
            "stopped by SIGTERM (preemption): the ranks saved a checkpoint after their step; "
            "launch the same command again to resume",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str]) -> None:
    args, train = _parse(argv)
    nodes = Nodes(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
    )
    code = run(nodes, args.log_ranks, train)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
