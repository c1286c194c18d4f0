"""What the trainer expects from a model and its arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig


@dataclass
class BaseModelArgs:
    """Hyper-parameters of one model flavor.

    The trainer copies the flavor's args, lets them read what they need from the job
    config and tokenizer (`update_from_config`), builds the model on the meta device
    from them, and asks them for parameter and FLOP counts for the MFU figure.
    """

    def update_from_config(self, job_config: JobConfig, tokenizer: Any) -> None:
        raise NotImplementedError

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        raise NotImplementedError

    def routed_experts(self) -> int:
        """Routed experts per mixture-of-experts layer (what an expert-parallel degree must
        divide); 0 for a dense model."""
        return 0

    def tensor_parallel_sizes(self) -> dict[str, int]:
        """Sizes a Megatron-style tensor-parallel degree must divide (heads, hidden sizes,
        vocabulary), by name; empty when the model states none."""
        return {}


class ModelProtocol(Protocol):
    """A model the trainer can build on meta and then materialise.

    `init_weights` must fully (re)initialise parameters and buffers in place, so it can
    run after `to_empty()` on whatever (possibly sharded) parameters the parallelisation
    step left behind.
    """

    def __init__(self, model_args: BaseModelArgs) -> None: ...

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...
