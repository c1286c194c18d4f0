"""An fx graph as bytes and back: its nodes in order, their targets and arguments, the
tensors its `get_attr` nodes read, and the node metadata asked for.  The loaded graph's
nodes keep their names, so its Python code is the same.

Plain `pickle` does the work: a node an argument refers to is written as its name, an op as
its qualified name (`aten::mm.default`), and both are looked up again on load; a fake tensor
in the metadata (a traced value, `val`) is written as its shape, strides, offset, dtype and
device and made again in the loading process's fake mode.  (`torch.fx`'s own `GraphPickler`
goes through `dill`, several times slower on a transformer's graphs.)
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

from torchtitan.torch_private import FakeTensor, FakeTensorMode


class _NodeRef:
    """A reference to an earlier node, by name, until the loaded graph has that node."""

    def __init__(self, name: str):
        self.name = name


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        if isinstance(obj, pytree.TreeSpec) and obj.is_leaf():
            # pickle would remake it as a `LeafSpec`, a class torch deprecates (a warning
            # from every rank that loads); torch's own leaf stands for every leaf
            return ("leaf",)
        if isinstance(obj, OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, FakeTensor):
            return (
                "fake",
                tuple(obj.shape),
                obj.stride(),
                obj.storage_offset(),
                obj.dtype,
                obj.device.type,
                obj.requires_grad,
            )
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, fake_mode: FakeTensorMode | None):
        super().__init__(io.BytesIO(data))
        self.fake_mode = fake_mode

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "node":
            return _NodeRef(rest[0])
        if kind == "leaf":
            return pytree.treespec_leaf()
        if kind == "fake":
            shape, stride, offset, dtype, device, requires_grad = rest
            if self.fake_mode is None:
                self.fake_mode = FakeTensorMode()
            with self.fake_mode:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if offset:
                    t = t.as_strided(shape, stride, offset)
            return t.requires_grad_(requires_grad) if requires_grad else t
        qualified, overload = rest
        namespace, name = qualified.split("::")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def dumps(gm: fx.GraphModule, metas: Sequence[str] = (), extra: Any = None) -> bytes:
    """`gm` as bytes, with the node metadata under the keys `metas` and any `extra` object
    (nodes in it are written by name too)."""
    nodes = [
        (n.op, n.name, n.target, n.args, n.kwargs, {k: n.meta[k] for k in metas if k in n.meta})
        for n in gm.graph.nodes
    ]
    attrs = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    buf = io.BytesIO()
    _Pickler(buf).dump((nodes, attrs, extra))
    return buf.getvalue()


def loads(data: bytes, fake_mode: FakeTensorMode | None = None) -> tuple[fx.GraphModule, Any]:
    """The graph module `dumps` wrote, and its `extra` object with nodes resolved in it.
    Fake tensors in the metadata are made in `fake_mode` (a new one if None)."""
    nodes, attrs, extra = _Unpickler(data, fake_mode).load()
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        return made[a.name] if isinstance(a, _NodeRef) else a

    for op, name, target, args, kwargs, meta in nodes:
        args = fx.node.map_aggregate(args, resolve)
        kwargs = fx.node.map_aggregate(kwargs, resolve)
        if op == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"graph node {name!r} loaded as {node.name!r}")
        node.meta.update(meta)
        made[name] = node
    gm = fx.GraphModule(attrs, graph)  # copies each attribute a get_attr node reads
    return gm, _resolve_nodes(extra, made)


def _resolve_nodes(obj: Any, made: dict[str, fx.Node]) -> Any:
    """`obj` with every node reference replaced by the loaded node (in dicts, lists, tuples
    and sets, keys included)."""
    if isinstance(obj, _NodeRef):
        return made[obj.name]
    if isinstance(obj, dict):
        return {_resolve_nodes(k, made): _resolve_nodes(v, made) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(_resolve_nodes(x, made) for x in obj)
    return obj
