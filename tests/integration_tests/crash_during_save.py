"""The trainer with a crash in the middle of one checkpoint save, for the resume tests.

    CRASH_DURING_SAVE=10 torchrun --standalone --nproc_per_node=2 \
        tests/integration_tests/crash_during_save.py <trainer options>

runs `torchtitan.train`'s `main` with DCP's file writer wrapped: rank 1 SIGKILLs itself
while it saves step `$CRASH_DURING_SAVE`, after its data files are written but before
the checkpoint is complete (no `.metadata`, no rename). `run_training` launches it as
`harness.run_training` launches the trainer, with this script in place of
`-m torchtitan.train`.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

STEP_ENV = "CRASH_DURING_SAVE"
CRASHING_RANK = 1


def crash_rank_during_save(step: int) -> None:
    """Make this process SIGKILL itself once its data files for `step-{step}` are written."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data
    prefix = f"step-{step}.tmp-"  # the manager saves into step-N.tmp-<run id>

    def write_data_then_die(self, plan, planner):
        future = write_data(self, plan, planner)
        if Path(self.path).name.startswith(prefix):
            future.wait()
            print(f"{STEP_ENV}: killing this rank in the middle of a save", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_data_then_die


def run_training(step: int, nproc: int, args: list[str], dump_folder: Path):
    """`harness.run_training(nproc, args, dump_folder)`, rank 1 killed while saving `step`."""
    from unittest import mock

    from harness import run_training as run_trainer

    from torchtitan.tools import loss_compare

    launch = loss_compare.launch_and_wait

    def launch_this_script(cmd: list[str], env: dict, timeout: float, label: str):
        at = cmd.index("torchtitan.train")
        assert cmd[at - 1] == "-m", cmd
        script = str(Path(__file__).resolve())
        return launch([*cmd[: at - 1], script, *cmd[at + 1 :]], env, timeout, label)

    with mock.patch.object(loss_compare, "launch_and_wait", launch_this_script):
        return run_trainer(nproc, args, dump_folder, env={STEP_ENV: str(step)})


if __name__ == "__main__":
    # As `python -m torchtitan.train` from the repo root: that root first on the path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if int(os.environ["RANK"]) == CRASHING_RANK:
        crash_rank_during_save(int(os.environ[STEP_ENV]))
    from torchtitan.train import main

    main()
