"""What the torchrun check scripts share: a checked line per result, and one way to leave.

`check(name, ok, detail)` prints `OK   name detail` / `FAIL name detail` on rank 0 (`quiet`:
only failures) and raises on failure; with `$CHECK_RESULTS` set, rank 0 also appends each
printed line as `{"ok": ..., "line": "name detail"}` to that file (JSON lines), which the
tests read.
`run_checks(body)` starts gloo, runs `body()` on every rank, records `ALL OK` on rank 0,
and leaves through barrier + flush + `os._exit` (gloo ranks can abort in interpreter
teardown otherwise): exit 0, or 1 with the traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch.distributed as dist

RESULTS_ENV = "CHECK_RESULTS"


def _record(ok: bool, line: str) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"ok": ok, "line": line}) + "\n")


def check(name: str, ok: bool, detail: str = "", quiet: bool = False) -> None:
    if dist.get_rank() == 0 and (not ok or not quiet):
        print(f"{'OK  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        _record(ok, f"{name} {detail}".strip())
    if not ok:
        raise AssertionError(f"{name} {detail}")


def run_checks(body: Callable[[], None]) -> None:
    dist.init_process_group("gloo")
    rc = 0
    try:
        body()
        if dist.get_rank() == 0:
            print("ALL OK", flush=True)
            _record(True, "ALL OK")
    except Exception:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if rc == 0:
        dist.barrier()
    os._exit(rc)
