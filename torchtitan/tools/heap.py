"""Give freed heap memory back to the operating system.

Planning builds large short-lived Python structures (the traced graph's strategy tables, the
solver's program).  Once they are garbage, glibc's allocator keeps most of the freed pages
mapped for reuse, so the process's RSS — what the trainer reports as peak memory on CPU, and
what the kernel's OOM killer counts — stays at the planning high-water mark for the whole run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def give_back_freed_heap() -> bool:
    """Collect garbage, then ask the C allocator to return its free pages (glibc's
    `malloc_trim`); False where the C library has no such call (musl, macOS, Windows)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
