"""Training loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import compile_per_rank


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits (batch, seq, vocab) against labels (batch, seq).

    Computed in fp32 whatever the logits' dtype.
    """
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def build_cross_entropy_loss(job_config: JobConfig):
    compile_config = job_config.compile
    if compile_config.enable and "loss" in compile_config.components:
        # compiled per rank: a sharded model's logits are DTensors whose graphs name groups
        return compile_per_rank(cross_entropy_loss)
    return cross_entropy_loss
