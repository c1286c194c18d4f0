"""Every private torch API the project uses, imported in one place.

torch promises nothing about these names (underscore modules, DTensor's strategy
machinery, AOTAutograd's joint export, FSDP's helpers); this module is the one to update
when a torch release moves one.  A name the installed torch lacks is an `ImportError`
naming it, the installed torch and the one the project is tested with — at import, never
a silent fallback.  Public torch APIs are imported where they are used; so is inductor
(`torch._inductor.*`, slow to import and only needed with `--compile.enable`), whose knobs
`distributed/inductor_comms.py` checks against the installed torch itself.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

TESTED_WITH = "2.13.0"


def _attribute_or_submodule(mod: Any, name: str) -> Any:
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{mod.__name__}.{name}")


def _require(module: str, *names: str) -> list[Any]:
    try:
        mod = importlib.import_module(module)
        return [_attribute_or_submodule(mod, name) for name in names]
    except ImportError as e:
        raise ImportError(
            f"torchtitan needs {module}.{{{', '.join(names)}}} ({e}); torch "
            f"{torch.__version__} does not provide it — torchtitan is tested with torch=="
            f"{TESTED_WITH} (see torchtitan/torch_private.py)"
        ) from None


# DTensor: specs, sharding strategies and their single-dim rules
DTensorSpec, TensorMeta = _require(
    "torch.distributed.tensor._dtensor_spec", "DTensorSpec", "TensorMeta"
)
OpSchema, OpSpec, OpStrategy, TupleStrategy = _require(
    "torch.distributed.tensor._op_schema", "OpSchema", "OpSpec", "OpStrategy", "TupleStrategy"
)
(
    fill_single_dim_strategy_placeholders,
    get_num_tensor_inputs,
    insert_single_dim_replication_strategy,
    SingleDimStrategyInfo,
) = _require(
    "torch.distributed.tensor._ops.single_dim_strategy",
    "_fill_single_dim_strategy_placeholders",
    "_get_num_tensor_inputs",
    "_insert_single_dim_replication_strategy",
    "_SingleDimStrategyInfo",
)
(expand_to_full_mesh_op_strategy,) = _require(
    "torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy"
)
(register_single_dim_pointwise,) = _require(
    "torch.distributed.tensor._ops._pointwise_ops", "_register_single_dim_pointwise"
)
compute_local_shape_and_global_offset, compute_global_tensor_info = _require(
    "torch.distributed.tensor._utils",
    "compute_local_shape_and_global_offset",
    "compute_global_tensor_info",
)

# AOTAutograd's joint export and fake tensors
(aot_export_joint_with_descriptors,) = _require(
    "torch._functorch.aot_autograd", "aot_export_joint_with_descriptors"
)
(fx_utils,) = _require("torch._functorch._aot_autograd", "fx_utils")
GradAOTOutput, PlainAOTOutput = _require(
    "torch._functorch._aot_autograd.descriptors", "GradAOTOutput", "PlainAOTOutput"
)
DataDependentOutputException, FakeTensor, FakeTensorMode = _require(
    "torch._subclasses.fake_tensor", "DataDependentOutputException", "FakeTensor", "FakeTensorMode"
)
(compile_session_context,) = _require("torch.compiler", "_compile_session_context")
# a module whose inputs inductor's compile_fx takes as one list it empties (boxed call)
GmWrapper, counters = _require("torch._dynamo.utils", "GmWrapper", "counters")
# graph modules that generate their Python code when first called, not when built (the
# lowering's intermediate graphs are never called)
make_graph_module, use_lazy_graph_module = _require(
    "torch.fx._lazy_graph_module", "_make_graph_module", "_use_lazy_graph_module"
)
# the tracing context whose fake mode's shape env inductor's FX graph cache requires
TracingContext, tracing = _require("torch._guards", "TracingContext", "tracing")

# DTensor's redistribution-cost helper, which strategy enumeration calls and the planner
# replaces while enumerating (strategies.py prices edges itself).  Each strategy module
# binds the name at import, so every binding is patched; at least the defining one must exist.
REDISTRIBUTE_COST_MODULES = [
    f"torch.distributed.tensor._ops.{name}"
    for name in (
        "utils",
        "_view_ops",
        "_math_ops",
        "_matrix_ops",
        "_tensor_ops",
        "single_dim_strategy",
        "_pointwise_ops",
        "_embedding_ops",
        "_conv_ops",
        "_random_ops",
        "_einsum_strategy",
    )
]
_require(REDISTRIBUTE_COST_MODULES[0], "generate_redistribute_costs")

# pytrees, dispatch modes
(pytree,) = _require("torch.utils", "_pytree")
TorchDispatchMode, get_current_dispatch_mode_stack = _require(
    "torch.utils._python_dispatch", "TorchDispatchMode", "_get_current_dispatch_mode_stack"
)

# the manual baseline's DDP and activation checkpointing, DCP's nested state dicts
(replicate,) = _require("torch.distributed._composable.replicate", "replicate")
(checkpoint_wrapper,) = _require(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"
)
(set_element,) = _require("torch.distributed.checkpoint._nested_dict", "set_element")

# expert parallelism: a process group named by a graph's string argument; a group registered
# under a second name (compiled graphs that name groups by role: execute/shared_compile.py)
(resolve_process_group,) = _require("torch.distributed.distributed_c10d", "_resolve_process_group")
(register_process_group,) = _require("torch._C._distributed_c10d", "_register_process_group")
# a lock file shared by a machine's processes (one of them compiles a graph, as inductor does)
(FileLock,) = _require("torch.utils._filelock", "FileLock")
# the job's key-value store (ranks hand each other lowered graphs: execute/shared_lowering.py)
(get_default_store,) = _require("torch.distributed.distributed_c10d", "_get_default_store")


def planning_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """A `DeviceMesh` over ranks 0..prod(shape)-1 with no process groups behind it
    (DeviceMesh's private `_init_backend=False`): one rank can plan for meshes the job
    never builds, without a collective that every rank would have to join."""
    import inspect

    from torch.distributed.device_mesh import DeviceMesh

    if "_init_backend" not in inspect.signature(DeviceMesh.__init__).parameters:
        raise ImportError(
            f"torchtitan needs DeviceMesh(..., _init_backend=False); torch "
            f"{torch.__version__} does not provide it — torchtitan is tested with torch=="
            f"{TESTED_WITH} (see torchtitan/torch_private.py)"
        )
    ranks = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)


# DTensor's Replicate -> Shard step (a local chunk at this rank's coordinate), which the
# lowering replaces with a chunk picked at run time (autoparallel/execute/local_shards.py)
(DTensorShard,) = _require("torch.distributed.tensor.placement_types", "Shard")
if not hasattr(DTensorShard, "_replicate_to_shard"):
    raise ImportError(
        f"torchtitan needs Shard._replicate_to_shard; torch {torch.__version__} does not "
        f"provide it — torchtitan is tested with torch=={TESTED_WITH} (see "
        "torchtitan/torch_private.py)"
    )
