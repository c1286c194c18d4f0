"""`torchtitan.autoparallel.child_process`: a planning step made in a forked child gives back
its answer and its errors, and leaves neither its side effects nor its heap in this process."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from torchtitan.autoparallel import child_process
from torchtitan.autoparallel.child_process import map_in_children, run_in_child
from torchtitan.autoparallel.errors import InfeasiblePlanError
from torchtitan.tools.heap import give_back_freed_heap

pytestmark = pytest.mark.skipif(not child_process.can_fork(), reason="forks on Linux only")

KEPT: list = []


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmRSS:\s+(\d+)", f.read())
    assert match is not None
    return int(match.group(1))


def _fragmenting_step() -> str:
    """Many small objects, one in a thousand kept: the kept ones pin the allocator's arenas
    (what planning does to the process that plans)."""
    made = [[i] for i in range(600_000)]
    KEPT.extend(made[::1000])
    del made
    return "planned"


def test_the_answer_comes_from_another_process():
    assert run_in_child(lambda: str(os.getpid())) != str(os.getpid())


def test_this_process_works_meanwhile(tmp_path):
    """The child waits for what `meanwhile` does in this process: it sees it only if the
    two run at the same time."""
    signal_file = tmp_path / "traced"

    def waits_for_the_parent() -> str:
        deadline = time.monotonic() + 60
        while not signal_file.exists():
            if time.monotonic() > deadline:
                return "alone"
            time.sleep(0.01)
        return "together"

    assert run_in_child(waits_for_the_parent, meanwhile=signal_file.touch) == "together"


def test_the_child_is_reaped_when_meanwhile_fails(monkeypatch):
    reaped = []

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        reaped.append(os.waitstatus_to_exitcode(real_waitpid(pid, options)[1]))
        return pid, 0

    def fails() -> None:
        raise ValueError("meanwhile broke")

    real_waitpid = os.waitpid
    monkeypatch.setattr(os, "waitpid", waitpid)
    with pytest.raises(ValueError, match="meanwhile broke"):
        run_in_child(lambda: "planned", meanwhile=fails)
    assert reaped == [0]  # the child answered, left and was waited for


def test_a_planner_error_comes_back_as_itself():
    def infeasible() -> str:
        raise InfeasiblePlanError("constraints cannot all hold: memory budget 1 GiB")

    with pytest.raises(InfeasiblePlanError, match=r"^constraints cannot all hold: memory budget"):
        run_in_child(infeasible)


def test_another_error_comes_back_named(capfd):
    def broken() -> str:
        return str({}["missing"])

    with pytest.raises(
        RuntimeError, match=r"^planning failed in the planning process with KeyError: 'missing'"
    ):
        run_in_child(broken)
    assert "Traceback" in capfd.readouterr().err  # the child shows where


def test_a_child_that_dies_is_an_error_naming_the_signal():
    with pytest.raises(RuntimeError, match=r"ended without an answer \(killed by signal 9\)"):
        run_in_child(lambda: str(os.kill(os.getpid(), signal.SIGKILL)))


def test_children_answer_in_order_each_with_its_own_error():
    def infeasible() -> str:
        raise InfeasiblePlanError("constraints cannot all hold: memory budget 1 GiB")

    answers = map_in_children(
        [
            lambda: f"first {os.getpid()}",
            infeasible,
            lambda: str({}["missing"]),
            lambda: str(os.kill(os.getpid(), signal.SIGKILL)),
            lambda: "last",
        ],
        workers=2,
    )
    first, error, other, killed, last = answers
    assert isinstance(first, str) and first.startswith("first ") and first != f"first {os.getpid()}"
    assert isinstance(error, InfeasiblePlanError) and str(error).startswith("constraints cannot")
    assert isinstance(other, RuntimeError) and "with KeyError: 'missing'" in str(other)
    assert isinstance(killed, RuntimeError) and "killed by signal 9" in str(killed)
    assert last == "last"


def test_children_run_side_by_side(tmp_path):
    """Each child waits for the other's mark: both see it only if they run at once."""

    def meets(me: str, other: str) -> str:
        (tmp_path / me).touch()
        deadline = time.monotonic() + 60
        while not (tmp_path / other).exists():
            if time.monotonic() > deadline:
                return "alone"
            time.sleep(0.01)
        return "together"

    answers = map_in_children([lambda: meets("a", "b"), lambda: meets("b", "a")], workers=2)
    assert answers == ["together", "together"]


def test_one_worker_runs_in_this_process():
    assert map_in_children([lambda: str(os.getpid())] * 2, workers=1) == [str(os.getpid())] * 2


def _dead(pid: int) -> bool:
    """Gone, or a zombie (ended, not yet reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_child_dies_with_this_process(tmp_path):
    """A process killed while its child plans (a rank SIGKILLed mid-job) takes the child
    with it: no solver is left running on a core nobody reads."""
    pid_file = tmp_path / "child.pid"

    def plans_for_a_minute() -> str:
        (tmp_path / "pid.tmp").write_text(str(os.getpid()))
        (tmp_path / "pid.tmp").rename(pid_file)
        time.sleep(60)
        return "late"

    parent = os.fork()
    if parent == 0:  # the process that plans in a child, killed below
        try:
            run_in_child(plans_for_a_minute)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(pid_file.read_text())
    os.kill(parent, signal.SIGKILL)
    os.waitpid(parent, 0)
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _dead(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the planning child outlived the process that forked it")


def test_the_heap_and_side_effects_stay_in_the_child():
    give_back_freed_heap()
    before = _rss_kib()
    assert run_in_child(_fragmenting_step) == "planned"
    give_back_freed_heap()
    assert KEPT == []  # the child's world ended with it
    assert _rss_kib() - before < 4_000
    # the same step in this process keeps tens of MB (which is why the trainer forks)
    _fragmenting_step()
    give_back_freed_heap()
    assert _rss_kib() - before > 20_000
    KEPT.clear()


def test_no_fork_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not child_process.can_fork()
    assert run_in_child(lambda: str(os.getpid())) == str(os.getpid())
    calls: list[str] = []
    run_in_child(lambda: str(calls.append("plan")), meanwhile=lambda: calls.append("meanwhile"))
    assert calls == ["plan", "meanwhile"]  # one after the other, both here
