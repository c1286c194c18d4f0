"""Which failure the launcher names (`torchtitan.launch._failure_line`)."""

from dataclasses import dataclass

from torchtitan.errors import UserInputError
from torchtitan.launch import _failure_line
from torchtitan.tools import rank_errors


@dataclass
class Failure:  # the fields of torchrun's ProcessFailure that the launcher reads
    pid: int
    exitcode: int
    timestamp: int
    signal: str = "<N/A>"

    def signal_name(self) -> str:
        return self.signal


def test_a_death_nobody_sent_beats_a_peers_report_but_not_an_input_error(tmp_path):
    rank_errors.write_report(RuntimeError("Connection closed by peer"), 0, tmp_path)
    killed = {1: Failure(pid=11, exitcode=-9, timestamp=5, signal="SIGKILL")}
    line = _failure_line(tmp_path, tmp_path, {0: Failure(10, 2, 6), **killed}, killed_here=set())
    assert line.startswith("rank 1 died (signal SIGKILL) without an error report;")
    # the same death, but the launcher killed it after rank 0 reported: rank 0's report
    assert _failure_line(
        tmp_path, tmp_path, {0: Failure(10, 2, 6), **killed}, killed_here={11}
    ) == (
        f"rank 0 failed: RuntimeError: Connection closed by peer (traceback: "
        f"{tmp_path / 'error_rank0.log'})"
    )
    rank_errors.write_report(UserInputError("--model.flavor: bad"), 2, tmp_path)
    assert _failure_line(tmp_path, tmp_path, killed, killed_here=set()) == "--model.flavor: bad"


def test_ranks_torchrun_stopped_are_not_the_cause(tmp_path):
    rank_errors.write_report(RuntimeError("boom on rank 1"), 1, tmp_path)
    stopped = Failure(pid=10, exitcode=-15, timestamp=1, signal="SIGTERM")
    line = _failure_line(tmp_path, tmp_path, {0: stopped, 1: Failure(11, 2, 2)}, killed_here=set())
    assert line.startswith("rank 1 failed: RuntimeError: boom on rank 1")


def test_without_any_report_the_first_failure_is_named(tmp_path):
    failures = {3: Failure(13, 1, 9), 2: Failure(12, -15, 7, "SIGTERM")}
    line = _failure_line(tmp_path, tmp_path, failures, killed_here=set())
    assert line.startswith("rank 2 died (signal SIGTERM) without an error report; its output is")
