"""Count the collectives a piece of work issues, by kind, with torch.profiler.

Each collective a process group runs shows up as one profiler event named after its backend
and op (`gloo:all_gather_into_tensor`, `nccl:reduce_scatter_tensor_coalesced`, ...); the
count is the number of such events, and the events' recorded input shapes give the elements
each kind sends from this rank.  Counts are stable on a noisy machine where times are not,
which makes them the figures to compare executors by.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Mapping

BACKENDS = ("gloo:", "nccl:")


class CollectiveCounts(Counter):
    """Calls per collective kind; `sent_elements[kind]`: the elements its inputs held."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_elements: Counter = Counter()


@contextlib.contextmanager
def count_collectives(enabled: bool = True):
    """Yield a CollectiveCounts filled in when the block exits."""
    counts = CollectiveCounts()
    if not enabled:
        yield counts
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield counts
    for event in prof.events():
        if event.name.startswith(BACKENDS):
            kind = event.name.split(":", 1)[1]
            counts[kind] += 1
            counts.sent_elements[kind] += sum(math.prod(s) for s in event.input_shapes if s)


def summary(counts: Mapping[str, int]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"{sum(counts.values())} collectives ({parts or 'none'})"


__all__ = ["count_collectives", "summary"]
