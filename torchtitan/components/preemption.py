"""SIGTERM as "stop after this step and save": what a scheduler (SLURM, Kubernetes) sends
before it kills a job.

The handler only raises a flag; after every step all ranks agree (one all-reduce of that
flag, so a signal that reaches ranks at different moments still stops them all after the
same step), the trainer saves a checkpoint and leaves with exit code 0, and the next launch
resumes from it.  Only with checkpointing on: without it there is nothing to keep, and
SIGTERM ends a rank at once as usual.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


class Preemption:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.device = device
        self._requested = False
        if self.enabled:
            signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame) -> None:
        self._requested = True

    def agreed(self) -> bool:
        """Whether any rank got SIGTERM.  A collective: every rank calls it after every step."""
        if not self.enabled:
            return False
        flag = torch.tensor([int(self._requested)], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
