"""One job per dump folder: the launcher holds a lock on it while its ranks run.

Two jobs writing to one dump folder (a script run twice, a restart while the first still
runs, two people) would replace each other's checkpoints, delete each other's rank logs
and act on each other's error reports.  So each node's launcher takes an exclusive
`flock` on `{dump_folder}/logs/.node<N>.lock` before it touches anything there and keeps
it until it exits.  The kernel drops the lock when the process dies, however it dies, so
a crashed job never leaves a stale lock behind.  The file says who holds it, for the
message the second job prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from torchtitan.errors import UserInputError


def lock_dump_folder(logs: Path, node_rank: int, dump_folder: str):
    """Take this node's lock in `logs` (created if needed), or raise `UserInputError`
    naming the job that holds it.  Returns the open lock file: keep it referenced for as
    long as the lock must be held."""
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f".node{node_rank}.lock"
    handle = open(path, "a+")  # noqa: SIM115 - held open for the launcher's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = _describe(handle.read())
        handle.close()
        raise UserInputError(
            f"--job.dump_folder {dump_folder} is in use by another job ({holder}); wait for "
            "it to end or stop it, or give this job another --job.dump_folder"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
        )
    )
    handle.flush()
    return handle


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"launcher pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "its launcher is still running"
