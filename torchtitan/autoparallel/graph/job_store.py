"""The job's key-value store, where the ranks of one job hand each other graphs (a trace, a
lowering) instead of each making its own.

None where there is nothing to share or no store to share through: no process group, one
rank, a fake process group, or a forked child of a rank (planning or compiling for it: it
shares its parent's connection to the store, which only the parent may use).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchtitan.torch_private import get_default_store

from ..child_process import in_forked_child

# how long a rank waits for another to make what it shares (a large model's lowering takes
# minutes; a rank that fails publishes that it failed, so nobody waits for it that long)
WAIT = timedelta(hours=1)


def job_store() -> Any:
    """The store every rank of the job reaches (c10d's `Store`), or None (see above)."""
    if in_forked_child() or not dist.is_initialized():
        return None
    if dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    return get_default_store()
