"""Process groups, determinism, and the collectives the training loop needs."""

from __future__ import annotations

import datetime
import functools
import os
import random
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

P = ParamSpec("P")
R = TypeVar("R")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ranks_per_node() -> int:
    """Ranks on one node, as the launch laid them out (torchrun's LOCAL_WORLD_SIZE: every
    node runs the same number); without torchrun, the whole world."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    return dist.get_world_size() if dist.is_initialized() else 1


def keep_compiled_graphs_per_rank() -> None:
    """Keep this rank's compiled graphs apart from the other ranks' in the compile caches
    they share (`torch.compiler.config.cache_key_tag` gains `rank<rank>`); for graphs that
    name this rank's process groups, as torch.compile's graphs of DTensor code do.  Call it
    before compiling them.

    Ranks of a machine share inductor's cache folder (`$TORCHINDUCTOR_CACHE_DIR`, or
    inductor's default): a kernel, cached by its source, is compiled once by the first rank
    that needs it while the others wait on inductor's lock for it and load it.  A graph that
    hard-codes its rank's group names ('3' here, '4' on the next rank) must not be shared:
    inductor's graph key does not tell the names apart (a warm run without the tag fails:
    "Could not resolve the process group registered under the name 4").  The planner's
    compiled graphs name groups by role instead and are shared
    (autoparallel/execute/shared_compile.py).
    """
    import torch.compiler.config as compiler_config

    compiler_config.cache_key_tag = _tagged_with_rank(compiler_config.cache_key_tag)


def compile_per_rank(fn: Callable[P, R]) -> Callable[P, R]:
    """`torch.compile(fn)`, its graphs kept apart per rank in the compile caches whatever
    the process's own setting (see `keep_compiled_graphs_per_rank`): for a function that
    may be given DTensors (the loss, given a sharded model's output), whose graphs then
    name this rank's process groups, in a process whose other compiled graphs are shared
    between ranks.  The tag is set while `fn` runs, so it holds for its recompiles too."""
    import torch.compiler.config as compiler_config

    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tag = _tagged_with_rank(compiler_config.cache_key_tag)
        with compiler_config.patch(cache_key_tag=tag):  # type: ignore[attr-defined]
            return compiled(*args, **kwargs)

    return call


def _tagged_with_rank(tag: str) -> str:
    """`tag` with `rank<rank>` added (once; rank 0 without a process group)."""
    mine = f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    if mine in tag.split("-"):
        return tag
    return f"{tag}-{mine}" if tag else mine


def init_distributed(init_timeout_seconds: int) -> int:
    """Join the torchrun job: NCCL on GPUs, gloo on CPU.  Returns the world size.

    A run started without torchrun is treated as a world of one.
    """
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=init_timeout_seconds))
    return dist.get_world_size()


def set_collective_timeout(seconds: int) -> None:
    """Let any collective of this rank (default group and every mesh group) wait at most
    `seconds` before it fails; a stalled or dead peer then ends the job."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def set_determinism(seed: int | None, deterministic: bool) -> None:
    """Seed every generator identically on all ranks (all our mesh dims are SPMD).

    With no seed given, rank 0 draws one and broadcasts it, so ranks still agree.
    """
    if seed is None:
        proposal = torch.tensor([random.SystemRandom().randrange(2**31)], dtype=torch.int64)
        if dist.is_initialized():
            proposal = proposal.to(device_type())
            dist.broadcast(proposal, src=0)
        seed = int(proposal.item())
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def dist_reduce(value: torch.Tensor, op: str, mesh: DeviceMesh | None) -> float:
    """Average (op="avg") or maximum (op="max") of a scalar over the mesh's ranks."""
    value = value.detach().float().reshape(1).clone()
    if mesh is not None and mesh.size() > 1:
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(value, op=reduce_op, group=mesh.get_group())
        if op == "avg":
            value /= mesh.size()
    return float(value.item())


def pipeline_sum(value: torch.Tensor, pp_mesh: DeviceMesh | None) -> torch.Tensor:
    """`value` summed over the pipeline ranks (what one stage's ranks hold, on all)."""
    if pp_mesh is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return value


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip the global gradient norm; works when parameters are DTensors on any mesh.

    Each gradient's squared norm is summed on its local shard; shards that share a mesh and
    a set of sharded mesh dims are added up first, so the exact total costs one reduction
    per such group (per mesh dim), not one per parameter.  With pipeline stages
    (`pp_mesh`) each rank holds its stages' parameters only: the totals of the pipeline
    ranks are added up too.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and pp_mesh is None:
        return torch.tensor(0.0)
    groups: dict[tuple, torch.Tensor] = {}
    plain = None
    for g in grads:
        if not isinstance(g, DTensor) or any(p.is_partial() for p in g.placements):
            sq = g.float().pow(2).sum()  # a pending sum: square only the reduced values
            sq = sq.full_tensor() if isinstance(sq, DTensor) else sq
            plain = sq if plain is None else plain + sq
            continue
        sharded = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
        key = (g.device_mesh, sharded)
        sq = g.to_local().float().pow(2).sum()
        groups[key] = groups[key] + sq if key in groups else sq
    total_sq = plain
    for (mesh, sharded), local in groups.items():
        partial = [Partial() if i in sharded else Replicate() for i in range(mesh.ndim)]
        full = DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()
        total_sq = full if total_sq is None else total_sq + full
    if total_sq is None:  # no gradient on this pipeline rank's stages
        total_sq = torch.zeros((), device=_device_of(pp_mesh))
    total_sq = pipeline_sum(total_sq, pp_mesh)
    total_norm = total_sq.sqrt()
    if max_norm > 0:
        clip_coef = min(max_norm / (float(total_norm) + 1e-6), 1.0)
        if clip_coef < 1.0:
            for g in grads:
                g.mul_(clip_coef)
    return total_norm


def _device_of(mesh: DeviceMesh | None) -> torch.device:
    return torch.device(mesh.device_type if mesh is not None else "cpu")


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_param_dtype(name: str) -> torch.dtype:
    """`training.mixed_precision_param`, with "auto" = bf16 on GPUs and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device_type() == "cuda" else torch.float32
    return TORCH_DTYPES[name]
