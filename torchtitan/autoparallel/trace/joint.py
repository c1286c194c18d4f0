"""Stage 1: trace a meta-device model into a joint forward+backward ATen graph on fake tensors.

The model's parameters and buffers are swapped (on a structural copy) for *fake CPU* tensors
— not meta ones: meta tensors silently drop the backward through `nll_loss`/cross-entropy.
Nothing is allocated, so an 8B model traces on a laptop.  SDPA becomes the planner's own
attention op where it can (attention.py), else bmm/softmax through the MATH backend.

The result, `TracedGraph`, identifies every placeholder and graph output by role (parameter
FQN, buffer FQN, user input, tangent, forward output, parameter gradient) using AOTAutograd's
descriptors.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from torchtitan.torch_private import (
    DataDependentOutputException,
    FakeTensorMode,
    GradAOTOutput,
    PlainAOTOutput,
    aot_export_joint_with_descriptors,
    compile_session_context,
    fx_utils,
    pytree,
)

from ..errors import PlannerError
from ..ops.attention import route_attention
from . import repeat

log = logging.getLogger(__name__)


@dataclass
class TracedGraph:
    """A joint graph plus the role of each placeholder/output.

    `outputs[i]` is the node producing forward output i and `tangents[i]` its tangent
    placeholder (None if the output needs no gradient).  `grads[fqn]` is the node producing
    the gradient of parameter `fqn` (None if the parameter gets no gradient);
    `input_grads[i]` the gradient of input i, for an input that requires one (a pipeline
    stage's hidden states), else None.
    """

    gm: fx.GraphModule
    params: dict[str, fx.Node]
    buffers: dict[str, fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    tangents: list[fx.Node | None]
    grads: dict[str, fx.Node | None]
    input_spec: Any  # pytree spec of the user's forward args
    output_spec: Any  # pytree spec of the forward output
    input_grads: list[fx.Node | None] = field(default_factory=list)
    param_dtype: torch.dtype | None = None
    forward_nodes: set[fx.Node] = field(default_factory=set)
    # repeated blocks (repeat.py): which stacks were found, the block label of each node
    # traced inside one, and, for a shallow trace, each node's weight (blocks it stands for)
    blocks: list = field(default_factory=list)
    labels: dict[fx.Node, str] = field(default_factory=dict)
    weights: dict[fx.Node, int] = field(default_factory=dict)
    shallow: bool = False

    def weight(self, node: fx.Node) -> int:
        return self.weights.get(node, 1)

    def tensor_val(self, node: fx.Node) -> torch.Tensor | None:
        v = node.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None


def check_on_meta(model: nn.Module) -> None:
    """Raise a PlannerError naming the first parameter/buffer not on the meta device."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device.type != "meta":
                raise PlannerError(
                    f"model must be built on the meta device: {kind} '{name}' is on {t.device}"
                )


def _fakeify(model: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replace (in place) every meta parameter/buffer with a fake CPU tensor, keeping aliases."""
    memo: dict[int, Any] = {}  # id of a meta tensor -> its fake copy (parameter)

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = fake_like(b)
            mod._buffers[name] = memo[id(b)]


class _CastParams(nn.Module):
    """Trace-time wrapper: the wrapped model sees its floating parameters cast to `dtype`.

    This puts an explicit cast node right after each parameter placeholder, so the solver can
    place an all-gather after the cast (low precision) and the backward grad cast before the
    gradient reduction (high precision).
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        # like FSDP2's cast_forward_inputs: floating inputs run in the compute dtype too
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t, (args, kwargs)
        )
        params = {
            n: (p.to(self.dtype) if p.is_floating_point() else p)
            for n, p in self.inner.named_parameters(remove_duplicate=False)
        }
        return torch.func.functional_call(
            self.inner, params, args, kwargs, tie_weights=True, strict=False
        )


def trace_joint(
    model: nn.Module,
    input_fn: Callable[[], Any],
    param_dtype: torch.dtype | None = None,
    blocks: list | None = None,
    shallow: bool = False,
) -> TracedGraph:
    """Trace `model` (on meta) with global-shaped inputs from `input_fn` into a joint graph.

    `blocks` (from `repeat.find_repeated_blocks`) labels the nodes of each repeated block;
    with `shallow=True` only the first, second and last block of each stack are traced and
    nodes are weighted by the number of blocks they stand for (see repeat.py)."""

    check_on_meta(model)
    blocks = list(blocks or [])
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_model = repeat.shallow_copy(model, blocks) if shallow and blocks else copy.deepcopy(model)
    _fakeify(fake_model, fake_mode)
    containers = [b.container for b in blocks]
    notes = repeat.block_labels(fake_model, containers) + [
        (mod, {MODULE_KEY: fqn or type(model).__name__}) for fqn, mod in fake_model.named_modules()
    ]
    args, flat_inputs, input_spec = _example_inputs(input_fn, fake_mode)
    traced_mod: nn.Module = fake_model
    if param_dtype is not None:
        traced_mod = _CastParams(fake_model, param_dtype)
    joint = _export(traced_mod, args, notes)
    gm = joint.graph_module
    _check_outputs(gm.graph)
    _reject_random_ops(gm.graph)
    roles = _roles(gm.graph, "inner." if param_dtype is not None else "")
    _merge_tied(gm.graph, roles.params, roles.grads, fake_model)  # after the last lookup
    if len(roles.inputs) != len(flat_inputs):
        raise PlannerError(
            f"traced graph has {len(roles.inputs)} input placeholders for "
            f"{len(flat_inputs)} inputs "
            "(an input is unused or aliased)"
        )
    needs_grad = [n for n, p in model.named_parameters() if p.requires_grad]
    if needs_grad and all(g is None for g in roles.grads.values()):
        raise PlannerError("traced graph has no backward: no parameter received a gradient")
    _warn_frozen(roles, set(needs_grad))

    tg = TracedGraph(
        gm=gm,
        params=roles.params,
        buffers=roles.buffers,
        inputs=roles.inputs,
        outputs=roles.outputs,
        tangents=roles.tangents,
        grads=roles.grads,
        input_grads=roles.input_grads,
        input_spec=input_spec,
        output_spec=getattr(joint, "out_spec", None),
        param_dtype=param_dtype,
    )
    tg.forward_nodes = forward_nodes(tg)
    if blocks:
        _label_blocks(tg, fake_model, blocks, shallow)
    return tg


def _example_inputs(input_fn: Callable[[], Any], fake_mode: FakeTensorMode):
    """`input_fn()` under the fake mode: (args tuple, flat tensors, their pytree spec)."""
    with fake_mode:
        inputs = input_fn()
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    flat_inputs, input_spec = pytree.tree_flatten(args)
    for i, x in enumerate(flat_inputs):
        if not isinstance(x, torch.Tensor):
            raise PlannerError(f"input_fn must return tensors; input {i} is {type(x).__name__}")
    return args, flat_inputs, input_spec


def _export(traced_mod: nn.Module, args: tuple, notes: list):
    """The joint forward+backward of `traced_mod` on `args`, nodes annotated with `notes`."""
    with contextlib.ExitStack() as stack, route_attention():
        stack.enter_context(fx_traceback.preserve_node_meta())
        # model code that asks "am I being compiled?" gets yes, as under torch.compile, so
        # data-dependent checks (transformers' mask helpers) take their traced branch.  Not
        # "exporting": the plan is lowered per input shape anyway, and export's caution (an
        # explicit causal mask instead of SDPA's is_causal) would cost the fused attention
        stack.enter_context(compile_session_context())
        stack.enter_context(_annotating(notes))
        try:
            return aot_export_joint_with_descriptors(stack, traced_mod, args)
        except (DataDependentOutputException, GuardOnDataDependentSymNode) as e:
            raise PlannerError(_data_dependent_message(e)) from None


@dataclass
class _Roles:
    params: dict[str, fx.Node]
    buffers: dict[str, fx.Node]
    grads: dict[str, fx.Node | None]
    inputs: list[fx.Node]
    input_grads: list[fx.Node | None]
    outputs: list[fx.Node]
    tangents: list[fx.Node | None]


def _roles(graph: fx.Graph, prefix: str) -> _Roles:
    """The placeholders and outputs of the joint graph by role, from AOT's descriptors
    (parameter names without the `prefix` of a cast wrapper)."""

    def strip(fqn: str) -> str:
        return fqn[len(prefix) :] if prefix and fqn.startswith(prefix) else fqn

    grads: dict[str, fx.Node | None] = {}
    for desc, (_p, g) in fx_utils.get_param_and_grad_nodes(graph).items():
        grads[strip(desc.target)] = g
    inputs = sorted(
        fx_utils.get_plain_input_and_grad_nodes(graph).items(), key=lambda kv: kv[0].idx
    )
    outs = sorted(
        fx_utils.get_plain_output_and_tangent_nodes(graph).items(), key=lambda kv: kv[0].idx
    )
    return _Roles(
        params={strip(k): v for k, v in fx_utils.get_named_param_nodes(graph).items()},
        buffers={strip(k): v for k, v in fx_utils.get_named_buffer_nodes(graph).items()},
        grads=grads,
        inputs=[n for _d, (n, _g) in inputs],
        input_grads=[g for _d, (_n, g) in inputs],
        outputs=[o for _d, (o, _t) in outs],
        tangents=[t for _d, (_o, t) in outs],
    )


def _label_blocks(tg: TracedGraph, fake_model: nn.Module, blocks: list, shallow: bool) -> None:
    """Block labels of the nodes of repeated blocks, and weights on a shallow trace."""
    containers = [b.container for b in blocks]
    names = {n: f for f, n in {**tg.params, **tg.buffers}.items()}
    keys = {c: [k for k, _m in fake_model.get_submodule(c).named_children()] for c in containers}
    tg.blocks, tg.shallow = blocks, shallow
    tg.labels = repeat.read_labels(tg.gm, names, containers, keys)
    if shallow:
        tg.weights = repeat.weights_of(tg.labels, blocks)


_PLANNER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the whole package
MODULE_KEY = "autoparallel_module"  # node.meta["custom"] key: FQN of the module that ran it


@contextlib.contextmanager
def _annotating(entries: list[tuple[nn.Module, dict]]):
    """While tracing, nodes traced inside each module carry its annotation in
    `node.meta["custom"]` (nested modules: the innermost wins per key).  Annotations a
    raising forward left open are closed on the way out, innermost first."""
    handles, open_ctx = [], []

    def pre(_m, _a, note):
        ctx = fx_traceback.annotate(note)
        ctx.__enter__()
        open_ctx.append(ctx)

    def post(_m, _a, _o):
        open_ctx.pop().__exit__(None, None, None)

    for mod, note in entries:
        handles += [
            mod.register_forward_pre_hook(functools.partial(pre, note=note)),
            mod.register_forward_hook(post),
        ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ctx:
            open_ctx.pop().__exit__(None, None, None)


def _data_dependent_message(e: Exception) -> str:
    """Name the op whose result depends on tensor values and the model line that asked for it
    (the innermost frame of the traceback outside torch)."""
    torch_dir = os.path.dirname(torch.__file__)
    where = "the model's forward"
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not frame.filename.startswith(torch_dir) and not frame.filename.startswith(_PLANNER):
            where = f"{frame.filename}:{frame.lineno} ({frame.line})"
            break
    op = getattr(e, "func", None) or str(e).splitlines()[0]
    return (
        f"data-dependent op {op} at {where}: the planner traces with fake tensors and cannot "
        "branch on tensor values; make the control flow independent of the data "
        "(or guard it with torch.compiler.is_compiling())"
    )


def _warn_frozen(roles: Any, needs_grad: set[str]) -> None:
    """Warn about parameters that take part in the forward but get no gradient in the traced
    graph: they will not train (eager may differ: a gradient lost in tracing is a bug)."""
    frozen = sorted(
        fqn
        for fqn, node in roles.params.items()
        if fqn in needs_grad and roles.grads.get(fqn) is None and node.users
    )
    if frozen:
        log.warning(
            "%d parameter(s) used in the forward receive no gradient in the traced graph and "
            "will not train: %s",
            len(frozen),
            ", ".join(frozen),
        )


def _merge_tied(graph: fx.Graph, params: dict, grads: dict, model: nn.Module) -> None:
    """One placeholder per parameter *tensor*: AOTAutograd gives a tied parameter (an LM head
    sharing the embedding's weight) a placeholder per name.  The aliases' uses move to the
    first name's placeholder and its gradient becomes the sum of both uses' gradients."""
    first: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), fqn)
        if canon == fqn or fqn not in params or canon not in params:
            continue
        alias, keep = params.pop(fqn), params[canon]
        alias.replace_all_uses_with(keep)
        g_alias, g_keep = grads.pop(fqn, None), grads.get(canon)
        out = next(n for n in graph.nodes if n.op == "output")
        if g_alias is None or g_keep is None:
            total = g_keep if g_alias is None else g_alias
        else:
            with graph.inserting_before(out):
                total = graph.call_function(torch.ops.aten.add.Tensor, (g_keep, g_alias))
            total.meta = dict(g_keep.meta)
        grads[canon] = total
        flat = list(out.args[0])
        flat = [None if a is g_alias else total if a is g_keep else a for a in flat]
        out.args = (flat,)
        graph.erase_node(alias)


def _reject_random_ops(graph: fx.Graph) -> None:
    """Random ops (dropout in train mode, ...) would draw different numbers on every rank
    than one process draws for the same slice; name the op and the module instead."""
    for n in graph.nodes:
        tags = getattr(n.target, "tags", ())
        if n.op == "call_function" and torch.Tag.nondeterministic_seeded in tags:
            where = n.meta.get("custom", {}).get(MODULE_KEY) or "the model's forward"
            raise PlannerError(
                f"random op {n.target} in '{where}' is not supported: every rank would draw "
                "other numbers than one process (e.g. dropout in train mode); set its "
                "probability to 0 or call model.eval()"
            )


def _check_outputs(graph: fx.Graph) -> None:
    """Only plain outputs and gradients are supported; name anything else (e.g. a buffer the
    forward mutates in place, like BatchNorm's running stats) instead of dropping it."""
    out = next(n for n in graph.nodes if n.op == "output")
    for desc in out.meta.get("desc", []):
        if desc is not None and not isinstance(desc, (PlainAOTOutput, GradAOTOutput)):
            what = getattr(getattr(desc, "mutated_input", None), "target", None) or desc
            raise PlannerError(
                f"unsupported side effect in forward: {type(desc).__name__} ({what}); "
                "in-place updates of inputs or buffers are not supported"
            )


def forward_nodes(tg: TracedGraph) -> set[fx.Node]:
    """Nodes needed to compute the forward outputs (ancestors of the outputs, no tangents)."""
    seen: set[fx.Node] = set()
    stack = list(tg.outputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen
