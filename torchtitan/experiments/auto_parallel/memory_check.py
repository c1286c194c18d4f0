"""Refuse a plan that cannot fit before anything is allocated.

The planner predicts each rank's peak memory (parameters, gradients, optimizer state,
saved activations, the backward's working set).  When that prediction is above what a
rank has, the job would only die at its first large allocation (or, on CPU, by the
kernel's OOM killer), so it stops before step 1 with the figures and the knobs that lower
them.  What a rank has: its GPU's memory; on CPU, an equal share of the machine's RAM
among the ranks on it.
"""

from __future__ import annotations

import os

import torch

from torchtitan.autoparallel import Plan
from torchtitan.distributed.utils import device_type, ranks_per_node
from torchtitan.errors import UserInputError


def memory_per_rank() -> tuple[float, str]:
    """(bytes one rank has, where that figure comes from)."""
    if device_type() == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return float(props.total_memory), f"the memory of one {props.name}"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = ranks_per_node()
    return ram / ranks, f"the machine's {ram / 2**30:.1f} GiB of RAM shared by {ranks} ranks"


def check_plan_fits(plan: Plan) -> None:
    """Raise `UserInputError` when `plan`'s predicted peak is above a rank's memory."""
    predicted = plan.predicted
    peak = predicted.get("peak_bytes_per_rank")
    if peak is None:
        return
    available, source = memory_per_rank()
    if peak <= available:
        return
    parts = ", ".join(
        f"{label} {predicted.get(key, 0.0) / 2**30:.1f}"
        for key, label in (
            ("param_bytes_per_rank", "parameters"),
            ("grad_bytes_per_rank", "gradients"),
            ("optim_bytes_per_rank", "optimizer state"),
            ("activation_bytes_per_rank", "saved activations"),
            ("transient_bytes_per_rank", "backward working set"),
        )
    )
    raise UserInputError(
        f"the plan needs {peak / 2**30:.1f} GiB per rank ({parts}) but a rank has "
        f"{available / 2**30:.1f} GiB ({source}); lower it with --activation_checkpoint.mode "
        "auto (the planner recomputes blocks to fit) or full, more ranks, or a smaller "
        "--training.local_batch_size or --training.seq_len"
    )
