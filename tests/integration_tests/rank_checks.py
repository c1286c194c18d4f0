"""What the torchrun check scripts share: a checked line per result, and one way to leave.

`check(name, ok, detail)` prints `OK   name detail` / `FAIL name detail` on rank 0 (`quiet`:
only failures) and raises on failure.  `run_checks(body)` starts gloo, runs `body()` on every
rank, prints `ALL OK` on rank 0, and leaves through barrier + flush + `os._exit` (gloo ranks
can abort in interpreter teardown otherwise): exit 0, or 1 with the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import torch.distributed as dist


def check(name: str, ok: bool, detail: str = "", quiet: bool = False) -> None:
    if dist.get_rank() == 0 and (not ok or not quiet):
        print(f"{'OK  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        raise AssertionError(f"{name} {detail}")


def run_checks(body: Callable[[], None]) -> None:
    dist.init_process_group("gloo")
    rc = 0
    try:
        body()
        if dist.get_rank() == 0:
            print("ALL OK", flush=True)
    except Exception:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if rc == 0:
        dist.barrier()
    os._exit(rc)
