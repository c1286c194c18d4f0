"""The `deepseek_v3` TrainSpec: the MoE decoder with hand-written parallelism (FSDP, EP, TP)."""

from collections.abc import Callable
from typing import Any, cast

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.datasets.dataloader import build_hf_dataloader
from torchtitan.models.deepseek_v3.args import MoEModelArgs, moe_configs
from torchtitan.models.deepseek_v3.balancing import build_moe_optimizers
from torchtitan.models.deepseek_v3.model import MoETransformer
from torchtitan.models.deepseek_v3.parallelize import check_moe_parallelism, parallelize_moe
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec

__all__ = ["MoETransformer", "MoEModelArgs", "moe_configs", "get_train_spec"]


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        name="deepseek_v3",
        model_cls=cast(Callable[[BaseModelArgs], Any], MoETransformer),
        flavors=moe_configs,
        parallelize_fn=parallelize_moe,
        check_parallelism_fn=check_moe_parallelism,
        build_optimizers_fn=build_moe_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_hf_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
    )
