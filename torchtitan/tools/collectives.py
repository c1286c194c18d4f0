"""Count the collectives a piece of work issues, by kind, with torch.profiler.

Each collective a process group runs shows up as one profiler event named after its backend
and op (`gloo:all_gather_into_tensor`, `nccl:reduce_scatter_tensor_coalesced`, ...); the
count is the number of such events.  A count is stable on a noisy machine where times are
not, which makes it the figure to compare executors by.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping

BACKENDS = ("gloo:", "nccl:")


@contextlib.contextmanager
def count_collectives(enabled: bool = True):
    """Yield a Counter (op name -> calls) filled in when the block exits."""
    counts: Counter = Counter()
    if not enabled:
        yield counts
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    for event in prof.events():
        if event.name.startswith(BACKENDS):
            counts[event.name.split(":", 1)[1]] += 1


def summary(counts: Mapping[str, int]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"{sum(counts.values())} collectives ({parts or 'none'})"


__all__ = ["count_collectives", "summary"]
