"""Run a planning step (or another step that leaves a heap behind: compiling a graph into
inductor's cache) in a forked child process and take back only its answer (text).

Planning allocates hundreds of thousands of small Python objects (strategy tables, the
placement program's rows and columns, memos) and frees almost all of them when the plan is
made.  CPython's allocator returns an arena (1 MiB) to the operating system only once every
object in it is dead, so the few that survive (global caches filled on the way, the plan)
keep the arenas they landed in: on the debug Llama on a 2 x 2 mesh, rank 0 kept 30 arenas,
30 MB of resident memory for the rest of the job, which `malloc_trim` cannot give back.  A
child process that plans and exits returns all of it.

`map_in_children` runs several such steps side by side, one child each, as many at once as
asked (the mesh search solves its candidates' programs so).
The child is forked (copy on write, nothing imported again) and writes its result to a pipe;
an exception there comes back as the same planner error, or as a RuntimeError naming it.  It
dies with this process (a rank killed mid-planning leaves no solver running on).
Where a fork is unsafe or unavailable (not Linux; CUDA already initialised in this process,
which a forked child cannot use), the step runs in this process instead.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from torchtitan.tools.local_processes import die_with_parent

from . import errors


def can_fork() -> bool:
    return sys.platform == "linux" and not torch.cuda.is_initialized()


def cores() -> int:
    """The cores this process may run on: how many children `map_in_children` runs at once
    by default."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def run_in_child(
    fn: Callable[[], str], meanwhile: Callable[[], None] | None = None, task: str = "planning"
) -> str:
    """`fn()` computed in a forked child process (in this one where `can_fork` is False);
    this process runs `meanwhile()` while it waits (after `fn` where there is no child).
    `task` names the step in the errors that come back from the child."""
    if not can_fork():
        text = fn()
        if meanwhile is not None:
            meanwhile()
        return text
    pid, read_end = _fork(fn)
    try:
        if meanwhile is not None:
            meanwhile()
    finally:  # the child is reaped whatever `meanwhile` did
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the {task} process ended without an answer ({_how(status)})")
    return _result(json.loads(data), task)


def map_in_children(
    fns: Sequence[Callable[[], str]], workers: int, task: str = "planning"
) -> list[str | Exception]:
    """`fn()` of each of `fns`, each in a forked child of its own, at most `workers` at a
    time (in this process, one after another, where `can_fork` is False or one worker or one
    function is all there is): per function, in order, the text it returned or the error it
    raised (as `run_in_child` raises it), for the caller to raise or report."""
    if not can_fork() or workers <= 1 or len(fns) <= 1:
        return [_outcome_here(fn) for fn in fns]
    out: list[str | Exception] = [RuntimeError(f"the {task} process did not run")] * len(fns)
    waiting = list(enumerate(fns))[::-1]
    running: dict[int, tuple[int, int, bytearray]] = {}  # read end -> (index, pid, answer)
    selector = selectors.DefaultSelector()
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                i, fn = waiting.pop()
                pid, read_end = _fork(fn)
                running[read_end] = (i, pid, bytearray())
                selector.register(read_end, selectors.EVENT_READ)
            for key, _ in selector.select():
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    running[key.fd][2].extend(chunk)
                    continue
                selector.unregister(key.fd)
                os.close(key.fd)
                i, pid, data = running.pop(key.fd)
                _, status = os.waitpid(pid, 0)
                out[i] = _outcome(bytes(data), status, task)
    finally:
        selector.close()
        for read_end, (_, pid, _) in running.items():  # only after an error here
            os.close(read_end)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return out


def _fork(fn: Callable[[], str]) -> tuple[int, int]:
    """Fork a child that writes `fn()`'s answer to a pipe and exits (dying with this process
    if it goes first): its pid and the pipe's read end, for this process to read."""
    sys.stdout.flush()  # else the child would write this process's buffered text again
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    parent = os.getpid()
    gc.freeze()  # the child's collections leave the inherited objects (and their pages) alone
    try:
        pid = os.fork()
    except BaseException:
        os.close(read_end)
        os.close(write_end)
        raise
    finally:
        if os.getpid() == parent:
            gc.unfreeze()
    if pid == 0:  # the child: answer, then leave without running this process's exit hooks
        os.close(read_end)
        if not die_with_parent(parent):
            os._exit(1)
        _answer(fn, write_end)
    os.close(write_end)
    return pid, read_end


def _outcome_here(fn: Callable[[], str]) -> str | Exception:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - handed to the caller, which raises or reports it
        return e


def _outcome(data: bytes, status: int, task: str) -> str | Exception:
    if not data:
        return RuntimeError(f"the {task} process ended without an answer ({_how(status)})")
    try:
        return _result(json.loads(data), task)
    except Exception as e:  # noqa: BLE001 - handed to the caller, which raises or reports it
        return e


_in_forked_child = False


def in_forked_child() -> bool:
    """Whether this process is a child `run_in_child` forked (it shares its parent's
    connections, such as the job's store, which only the parent may use)."""
    return _in_forked_child


def _answer(fn: Callable[[], str], fd: int) -> None:
    global _in_forked_child
    _in_forked_child = True
    code = 0
    try:
        try:
            reply: list = ["ok", fn()]
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            if not isinstance(e, errors.PlannerError):
                traceback.print_exc()
            reply = ["error", type(e).__name__, str(e), isinstance(e, errors.PlannerError)]
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(json.dumps(reply).encode())
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the child must never return into the caller
        code = 1
    finally:
        os._exit(code)


def _result(reply: list, task: str) -> str:
    if reply[0] == "ok":
        return reply[1]
    _tag, name, message, planner = reply
    raise_as_sent(name, message, planner, f"in the {task} process", task)


def raise_as_sent(
    name: str, message: str, planner: bool, where: str, task: str = "planning"
) -> NoReturn:
    """Raise an error another process (`where`) caught and sent: a planner error as the same
    class (PlannerError if unknown) with the same message, anything else as a RuntimeError
    naming it."""
    if planner:
        raise getattr(errors, name, errors.PlannerError)(message)
    raise RuntimeError(f"{task} failed {where} with {name}: {message}")


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
