"""Small facts about processes on this machine that launchers and their ranks share."""

from __future__ import annotations

import os
import signal
import socket
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when `parent` (its parent's pid, read before
    any work) dies, even by SIGKILL.  Linux only (prctl PR_SET_PDEATHSIG); elsewhere it
    does nothing.  False when the parent is already gone (it died before the request took
    effect): the caller should leave."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent
