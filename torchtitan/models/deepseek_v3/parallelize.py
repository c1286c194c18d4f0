"""Hand-written parallelism for the MoE decoder: what a user would otherwise run.

* Tensor parallelism (with sequence parallelism) on attention and the dense layers'
  feed-forwards, as for Llama 3.  A mixture-of-experts feed-forward takes the whole
  sequence (gathered from the tp ranks) and its output is split back along the sequence:
  inside the tp group every rank runs the router, the shared experts and its routed experts
  on the same tokens.
* Expert parallelism (`--parallelism.expert_parallel_degree`): the routed experts' stacked
  weights become DTensors split on the expert dim over the `ep` mesh dim, and the experts
  module is wrapped so its forward dispatches tokens by all-to-all
  (`distributed/expert_parallel.py`).
* FSDP2 per block over all shard ranks; the routed experts, when split by EP, are sharded by
  FSDP only over the shard ranks outside their EP group (`dp_shard`), and their gradients are
  divided by every data-parallel rank (each expert's gradient already sums the tokens of its
  whole EP group).
"""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.distributed.parallel_dims import EP, ParallelDims
from torchtitan.distributed.utils import (
    TORCH_DTYPES,
    keep_compiled_graphs_per_rank,
    resolve_param_dtype,
)
from torchtitan.errors import UserInputError
from torchtitan.models.deepseek_v3.args import MoEModelArgs
from torchtitan.models.deepseek_v3.model import MoE
from torchtitan.models.llama3.parallelize import (
    _SyncOutputColwiseParallel,
    _SyncOutputRowwiseParallel,
)
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.tools.logging import logger


def check_moe_parallelism(
    model_args: BaseModelArgs, parallel_dims: ParallelDims, job_config: JobConfig
) -> None:
    """TP must divide heads, kv-heads, the hidden sizes, the sequence (and the vocabulary
    with loss parallelism); no DDP, no EP with HSDP (EP must divide the routed experts:
    `config/resolve.py` checks that for every spec)."""
    args = cast(MoEModelArgs, model_args)
    parallel_dims.check_tensor_parallel_sizes(
        args.tensor_parallel_sizes(), job_config.training.seq_len, f"MoE {job_config.model.flavor}"
    )
    if parallel_dims.dp_replicate_enabled and parallel_dims.ep_enabled:
        raise UserInputError(
            "--parallelism.expert_parallel_degree > 1 with data_parallel_replicate_degree > 1 "
            "is not supported by the hand-written MoE plan; use the shard degree only"
        )
    if parallel_dims.dp_replicate_enabled and not parallel_dims.dp_shard_enabled:
        raise UserInputError(
            "DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1) is "
            "not supported by the hand-written MoE plan; use FSDP or HSDP"
        )


def parallelize_moe(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig):
    if job_config.parallelism.fsdp_reshard_after_forward == "auto":
        raise UserInputError(
            "--parallelism.fsdp_reshard_after_forward auto: only the auto-parallel models "
            "choose what to gather again; use default, always or never"
        )
    if job_config.activation_checkpoint.mode == "auto":
        raise UserInputError(
            "--activation_checkpoint.mode auto: only the auto-parallel models choose what to "
            "recompute; use none, selective or full"
        )
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.world_mesh["tp"],
            parallel_dims.loss_parallel_enabled,
            moe_as_dtensor=not parallel_dims.dp_shard_enabled,
        )
    if parallel_dims.ep_enabled:
        apply_ep(model, parallel_dims)
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable and "model" in job_config.compile.components:
        keep_compiled_graphs_per_rank()  # the blocks' graphs name this rank's groups
        for block in _blocks(model):
            block.compile(fullgraph=True)
    training = job_config.training
    mp_policy = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(training.mixed_precision_param),
        reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
    )
    if parallel_dims.dp_shard_enabled:
        apply_fsdp(
            model, parallel_dims, mp_policy, job_config.parallelism.fsdp_reshard_after_forward
        )
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(cast(nn.ModuleDict, model.layers).values())


def _moe_of(block: nn.Module) -> MoE | None:
    ff = getattr(block, "feed_forward", None)
    if ff is None:  # an activation-checkpoint wrapper
        ff = getattr(getattr(block, "_checkpoint_wrapped_module", None), "feed_forward", None)
    return ff if isinstance(ff, MoE) else None


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool, moe_as_dtensor: bool) -> None:
    """Llama 3's TP plan for attention, dense feed-forwards and the head; an MoE
    feed-forward sees the whole sequence and hands back its sequence shard.  Without FSDP
    (which makes every parameter a DTensor) its parameters become replicated DTensors on
    the tp mesh and it runs on DTensors (`moe_as_dtensor`): the optimizer cannot mix
    DTensors and plain tensors; with FSDP it runs on plain tensors."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": _SyncOutputRowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "norm": SequenceParallel(),
            "output": _SyncOutputColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in _blocks(model):
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        moe = _moe_of(block)
        if moe is not None:
            plan["feed_forward"] = _WholeSequence(local=not moe_as_dtensor)
            if moe_as_dtensor:
                distribute_module(moe, tp_mesh)
        else:
            plan.update(
                {
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
    logger.info(f"applied tensor + sequence parallelism (loss parallel: {loss_parallel})")


class _WholeSequence(PrepareModuleInput):
    """The module's input gathered along the sequence into a plain tensor; its output, the
    same on every tp rank, split back along the sequence.  `local`: the input as a plain
    tensor, else as a replicated DTensor."""

    def __init__(self, local: bool):
        super().__init__(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=local
        )

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        super()._apply(module, device_mesh)
        out = PrepareModuleOutput(
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True
        )
        return out._apply(module, device_mesh)


def apply_ep(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Routed experts split on their expert dim over the `ep` mesh dim, run through
    `ExpertParallel`."""
    ep_mesh = parallel_dims.world_mesh[EP]
    group = ep_mesh.get_group().group_name
    for block in _blocks(model):
        moe = _moe_of(block)
        if moe is None:
            continue
        experts = moe.experts
        for name in ("w1", "w2", "w3"):
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(w, ep_mesh, [Shard(0)])))
        moe.experts = ExpertParallel(experts, group)  # type: ignore[assignment]
    logger.info(f"applied expert parallelism over {parallel_dims.ep} ranks")


def apply_fsdp(
    model: nn.Module, parallel_dims: ParallelDims, mp_policy: MixedPrecisionPolicy, policy: str
) -> None:
    """FSDP2 per block, then the root; experts split by EP sharded over `dp_shard` only."""
    mesh = parallel_dims.fsdp_mesh()
    names = parallel_dims.world_mesh.mesh_dim_names or ()
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        reshard = i < len(blocks) - 1 if policy == "default" else policy == "always"
        moe = _moe_of(block)
        ignored = None
        if moe is not None and parallel_dims.ep_enabled:
            ignored = _shard_expert_parallel(moe.experts, parallel_dims, names, mp_policy, reshard)
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard,
            ignored_params=ignored,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=policy == "always")
    logger.info(
        f"applied FSDP (param dtype {mp_policy.param_dtype}, reduce {mp_policy.reduce_dtype})"
    )


def _shard_expert_parallel(
    experts: nn.Module, parallel_dims: ParallelDims, names, mp_policy, reshard: bool
) -> set[nn.Parameter] | None:
    """Each expert's gradient sums its EP group's tokens: divide by all data-parallel ranks
    (FSDP over the other shard ranks adds theirs; without it, nothing else divides).
    Returns the parameters the block's FSDP must leave alone (None: FSDP has them)."""
    ranks = parallel_dims.dp_degree
    if "dp_shard" in names:
        fully_shard(
            experts,
            mesh=parallel_dims.world_mesh["dp_shard"],
            mp_policy=mp_policy,
            reshard_after_forward=reshard,
        )
        cast(FSDPModule, experts).set_gradient_divide_factor(float(ranks))
        return None
    for p in experts.parameters():
        p.register_hook(lambda g: g / ranks)
    return set(experts.parameters())
