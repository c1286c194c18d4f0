"""Start the ranks of a short one-node CPU job by forking one process that has done the
imports, instead of starting an interpreter per rank as torchrun does.

    python -m torchtitan.tools.forked_ranks --nproc 4 -m torchtitan.train --job.config_file ...
    python -m torchtitan.tools.forked_ranks --nproc 2 path/to/check_script.py args...
    python -m torchtitan.tools.forked_ranks --nproc 4 --preload transformers.modeling_utils ...

On a small CPU machine each rank's interpreter start and imports (torch, DTensor, the
trainer: ~3.5 CPU-s) cost more than a ten-step test run; here they are paid once.  Before
forking, this process imports what the target imports at its top level (read from its
source, never run) and the modules `--preload` names (what the target imports later, inside
a function: an optional dependency, inductor for a compiled run); each rank then runs the
target as `__main__` with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and this process's stdout and stderr.

A rank that fails ends the others (SIGTERM, then SIGKILL after `GRACE_S`); a rank ended by
a signal is reported in torchrun's words (`exitcode  : -11 (pid: 12)  (SIGSEGV)`), and the
exit code is 1 when any rank failed, as torchrun's.  Every rank dies with this process.
What torchrun adds is not here (restarts, rendezvous across nodes, log files): the
product's launcher stays `torchtitan.launch`; this is for tests and loss comparisons.
CUDA must not be initialised before the fork, and nothing here does.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import importlib.util
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from torchtitan.tools.local_processes import die_with_parent, free_port

GRACE_S = 30.0


def _parse(argv: list[str]) -> argparse.Namespace:
    """This launcher's options, then `-m MODULE args...` or `SCRIPT args...` as they are."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.forked_ranks",
        usage="%(prog)s --nproc N [--preload MODULE ...] (-m MODULE | SCRIPT) [args ...]",
    )
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start")
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module to import before forking, besides the target's top-level imports "
        "(repeatable); one that fails to import is left to the rank that needs it",
    )
    split = 0  # this launcher's options come first; each takes a value, but the help
    while split < len(argv) and argv[split].startswith("-") and argv[split] != "-m":
        split += 1 if "=" in argv[split] or argv[split] in ("-h", "--help") else 2
    args = parser.parse_args(argv[:split])
    target = argv[split:]
    args.module = None
    if target[:1] == ["-m"]:
        if len(target) < 2:
            parser.error("-m needs a module name")
        args.module, target = target[1], target[2:]
    elif not target:
        parser.error("give a script to run, or -m MODULE")
    args.target = target
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: give 1 or more ranks")
    return args


def _source_of(module: str | None, script: str | None) -> Path | None:
    if script is not None:
        return Path(script)
    spec = importlib.util.find_spec(module) if module else None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _top_level_imports(source: Path) -> list[str]:
    """The absolute modules a file imports at its top level, in order (none when it does
    not parse: the ranks report that)."""
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except (SyntaxError, ValueError, OSError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _warm_up(source: Path | None, preload: list[str]) -> None:
    """Import what the target will import, so that the forked ranks find it loaded.  A
    module that fails to import here is left for the rank to import, and to report."""
    for name in [*(_top_level_imports(source) if source is not None else []), *preload]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - the rank meets the same error, in context
            continue


def _run_rank(rank: int, args: argparse.Namespace, port: int, parent: int) -> None:
    """In a forked child: become rank `rank`, run the target, exit with its code."""
    if not die_with_parent(parent):
        os._exit(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = 0
    try:
        if args.module is not None:
            sys.argv = [args.module, *args.target]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.target)  # sys.path[0] is the script's folder (`launch`)
            runpy.run_path(args.target[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the rank's failure
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _describe(pid: int, status: int) -> str:
    """A failed rank's exit in torchrun's words (its summary's `exitcode` line)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"exitcode  : -{sig} (pid: {pid})  ({signal.Signals(sig).name})"
    return f"exitcode  : {os.WEXITSTATUS(status)} (pid: {pid})"


def _stop(ranks: dict[int, int]) -> None:
    """SIGTERM the ranks still running; SIGKILL those alive after GRACE_S."""
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while ranks and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
        else:
            ranks.pop(pid, None)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def launch(args: argparse.Namespace) -> int:
    """Fork the ranks, wait for them; 0 when every rank exited 0, else 1."""
    script = None if args.module is not None else args.target[0]
    if script is not None and not Path(script).is_file():
        print(f"error: {script}: no such script", file=sys.stderr)
        return 2
    if script is not None:
        sys.path.insert(0, str(Path(script).resolve().parent))
    if args.nproc > 1:  # as torchrun: ranks sharing a machine do not each take every core
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _warm_up(_source_of(args.module, script), args.preload)
    port, parent = free_port(), os.getpid()
    # What the ranks inherit is never collected: the collector would otherwise visit (and
    # so copy, page by page) every inherited object in every rank.
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(args.nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, args, port, parent)
        ranks[pid] = rank
    failures: list[str] = []
    while ranks:
        pid, status = os.waitpid(-1, 0)
        if pid not in ranks:  # not a rank (a helper process an import started)
            continue
        rank = ranks.pop(pid)
        if status != 0:
            failures.append(f"[forked_ranks] rank {rank} failed: {_describe(pid, status)}")
            _stop(ranks)
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str]) -> None:
    sys.exit(launch(_parse(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
