"""Hand-written parallelism for Llama 3 — the baseline the auto-parallel planner is judged by.

The order is fixed and matters: tensor parallelism → activation checkpointing → per-block
compile → FSDP/HSDP or DDP.  (AC wraps the TP-sharded block; compile sees the wrapped block;
FSDP hooks go outermost so parameter gathers are not recompiled or recomputed.)
"""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import StageIO
from torchtitan.distributed.utils import (
    TORCH_DTYPES,
    keep_compiled_graphs_per_rank,
    resolve_param_dtype,
)
from torchtitan.errors import UserInputError
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.tools.logging import logger
from torchtitan.torch_private import replicate


def check_llama_parallelism(
    model_args: BaseModelArgs, parallel_dims: ParallelDims, job_config: JobConfig
) -> None:
    """What Megatron-style TP and DDP need of the mesh (see `TrainSpec.check_parallelism_fn`):
    the tp degree divides heads, kv-heads, dim, the SwiGLU width, the vocabulary (when the
    loss is vocabulary-parallel) and the sequence (sequence parallelism); DDP is not
    combined with TP; a zero-bubble pipeline schedule has no data-parallel dim."""
    schedule = job_config.parallelism.pipeline_parallel_schedule
    if parallel_dims.pp > 1 and parallel_dims.dp_degree > 1 and "zerobubble" in schedule.lower():
        # measured: pp 2 x dp_shard 2 (or dp_replicate 2) under ZBVZeroBubble trains to a
        # step-2 loss of 8.1515 where one rank (and 1F1B on that mesh) gives 8.1510
        raise UserInputError(
            f"--parallelism.pipeline_parallel_schedule {schedule} with data parallelism "
            f"(degree {parallel_dims.dp_degree}): the FSDP stages' gradients differ from one "
            "process's under torch's zero-bubble weight step; use 1F1B or Interleaved1F1B, "
            "or --model.name llama3_auto_parallel (its stages are exact under it)"
        )
    parallel_dims.check_tensor_parallel_sizes(
        model_args.tensor_parallel_sizes(),
        job_config.training.seq_len,
        f"llama3 {job_config.model.flavor}",
    )
    if (
        parallel_dims.tp_enabled
        and parallel_dims.dp_replicate_enabled
        and not parallel_dims.dp_shard_enabled
    ):
        raise UserInputError(
            "DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1) "
            "cannot be combined with tensor parallelism; use HSDP "
            "(data_parallel_shard_degree > 1) instead"
        )


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    stage: StageIO | None = None,
) -> nn.Module:
    """FSDP / HSDP / DDP, TP, activation checkpointing and compile as the job asks; a
    pipeline `stage` is parallelised like a whole model (its inputs do not matter here)."""
    del stage
    training = job_config.training
    if job_config.parallelism.fsdp_reshard_after_forward == "auto":
        raise UserInputError(
            "--parallelism.fsdp_reshard_after_forward auto: only the auto-parallel models "
            "(llama3_auto_parallel, hf_auto_parallel) choose what to gather again; use "
            "default, always or never"
        )
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.world_mesh["tp"], parallel_dims.loss_parallel_enabled)
    if job_config.activation_checkpoint.mode == "auto":
        raise UserInputError(
            "--activation_checkpoint.mode auto: only the auto-parallel models "
            "(llama3_auto_parallel, hf_auto_parallel) choose what to recompute; use none, "
            "selective or full"
        )
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable and "model" in job_config.compile.components:
        keep_compiled_graphs_per_rank()  # the blocks' graphs name this rank's groups
        for block in _blocks(model):
            block.compile(fullgraph=True)
        logger.info("compiled each transformer block with torch.compile")

    if parallel_dims.dp_shard_enabled:
        apply_fsdp(
            model,
            parallel_dims,
            MixedPrecisionPolicy(
                param_dtype=resolve_param_dtype(training.mixed_precision_param),
                reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
            ),
            job_config.parallelism.fsdp_reshard_after_forward,
        )
    elif parallel_dims.dp_replicate_enabled:
        replicate(model, device_mesh=parallel_dims.world_mesh["dp_replicate"], bucket_cap_mb=100)
        logger.info("applied DDP to the model")
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in order (`model.layers`, a ModuleDict)."""
    return list(cast(nn.ModuleDict, model.layers).values())


def _redistribute_output_sync(output_layouts, use_local_output, mod, outputs, device_mesh):
    """Output hook of the two styles below: like torch's, but the redistribute waits.

    torch's Colwise/RowwiseParallel redistribute their output with `async_op=True`, so
    `.to_local()` hands out an `AsyncCollectiveTensor` (ACT).  When that ACT is the input
    of a `torch.compile`d region, torch 2.13 drops its gradient: AOTAutograd replaces
    ACT inputs by `act.trigger_wait()` (torch/_functorch/_aot_autograd/frontend_utils.py),
    which returns the inner tensor without `requires_grad`, so the compiled backward
    returns None for that input.  Here that input is the embedding output entering the
    first compiled block (and, without loss parallelism, the logits entering a compiled
    loss): the embedding silently gets no gradient (FSDP) or the eager redistribute's
    backward crashes on a plain zero gradient (TP only: "'Tensor' object has no
    attribute '_local_tensor'").  A synchronous redistribute returns a plain tensor; the
    numerics are identical and the lost overlap is one wait the next op needs anyway.
    """
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)
    return outputs.to_local() if use_local_output else outputs


class _SyncOutputRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output redistribute is synchronous (see above)."""

    _prepare_output_fn = staticmethod(_redistribute_output_sync)


class _SyncOutputColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose output redistribute is synchronous (see above)."""

    _prepare_output_fn = staticmethod(_redistribute_output_sync)


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism, as torchtitan plans it.

    Between blocks the residual stream is split along the sequence (Shard(1)); norms run
    on their sequence shard; attention/FFN inputs are gathered, the column-parallel
    projections (wq/wk/wv/w1/w3) split heads/hidden units, and the row-parallel ones
    (wo/w2) reduce-scatter back to sequence shards.  With loss parallelism the logits
    stay split along the vocabulary into the cross-entropy.

    The embedding and the output projection hand their results to code that may be
    compiled (the first block, the loss), so their output redistributes are synchronous:
    see `_redistribute_output_sync`.  Inside the blocks the async ones are fine (the
    compiled graph traces them).
    """
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
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    logger.info(f"applied tensor + sequence parallelism (loss parallel: {loss_parallel})")


def apply_fsdp(
    model: nn.Module,
    parallel_dims: ParallelDims,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward_policy: str,
) -> None:
    """FSDP2 per transformer block, then the root (embeddings, final norm, output).

    With a replicate degree > 1 the mesh is 2-D (replicate, shard): HSDP.
    Policy "default" reshards every block after forward except the last one, whose
    parameters backward would gather again immediately.
    """
    names = parallel_dims.dp_mesh_names
    mesh = parallel_dims.world_mesh[names if len(names) > 1 else names[0]]
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        if reshard_after_forward_policy == "default":
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward_policy == "always"
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward_policy == "always",
    )
    kind = "HSDP" if len(names) > 1 else "FSDP"
    logger.info(
        f"applied {kind} (param dtype {mp_policy.param_dtype}, reduce {mp_policy.reduce_dtype})"
    )
