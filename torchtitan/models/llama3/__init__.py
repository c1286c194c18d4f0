"""The `llama3` TrainSpec: Llama 3 with hand-written parallelism."""

from collections.abc import Callable
from typing import Any, cast

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.datasets.dataloader import build_hf_dataloader
from torchtitan.distributed.pipeline import PipelineSplit
from torchtitan.models.llama3.args import TransformerModelArgs, llama3_configs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import check_llama_parallelism, parallelize_llama
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec

__all__ = ["Transformer", "TransformerModelArgs", "llama3_configs", "get_train_spec"]


def get_train_spec() -> TrainSpec:
    """The llama3 spec; other specs reuse it (`dataclasses.replace`) with their own
    `parallelize_fn` and its `check_parallelism_fn`."""
    return TrainSpec(
        name="llama3",
        # called only with this spec's flavors (TransformerModelArgs), which TrainSpec's
        # Callable[[BaseModelArgs], Any] cannot say
        model_cls=cast(Callable[[BaseModelArgs], Any], Transformer),
        flavors=llama3_configs,
        parallelize_fn=parallelize_llama,
        check_parallelism_fn=check_llama_parallelism,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_hf_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        pipeline_split=PipelineSplit(
            first=("tok_embeddings",), blocks="layers", last=("norm", "output")
        ),
    )
