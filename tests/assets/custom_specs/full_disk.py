"""A disk that fills up during one save, for the launcher tests: imported with
`--experimental.custom_import full_disk` (this folder on PYTHONPATH), rank 1's writes of
checkpoint `step-$FULL_DISK_AT_STEP` fail with ENOSPC as a full disk's would."""

import errno
import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

_write_data = FileSystemWriter.write_data


def _write_data_on_a_full_disk(self, plan, planner):
    step = os.environ.get("FULL_DISK_AT_STEP")
    if os.environ.get("RANK") == "1" and Path(self.path).name.startswith(f"step-{step}.tmp-"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = _write_data_on_a_full_disk
