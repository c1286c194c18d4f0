"""A lowered graph as bytes and back: its nodes in order, their targets and arguments, and
the tensors its `get_attr` nodes read; no node metadata (nothing reads it once a graph is
lowered).  The loaded graph's nodes keep their names, so its Python code is the same.

Plain `pickle` does the work: a node an argument refers to is written as its name, an op
as its qualified name (`aten::mm.default`), and both are looked up again on load.
(`torch.fx`'s own `GraphPickler` keeps the metadata too, through `dill`, several times
slower on a transformer's graphs.)
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload


class _NodeRef:
    """A reference to an earlier node, by name, until the loaded graph has that node."""

    def __init__(self, name: str):
        self.name = name


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        if isinstance(obj, OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "node":
            return _NodeRef(rest[0])
        qualified, overload = rest
        namespace, name = qualified.split("::")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def dumps(gm: fx.GraphModule) -> bytes:
    nodes = [(n.op, n.name, n.target, n.args, n.kwargs) for n in gm.graph.nodes]
    attrs = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    buf = io.BytesIO()
    _Pickler(buf).dump((nodes, attrs))
    return buf.getvalue()


def loads(data: bytes) -> fx.GraphModule:
    nodes, attrs = _Unpickler(io.BytesIO(data)).load()
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        return made[a.name] if isinstance(a, _NodeRef) else a

    for op, name, target, args, kwargs in nodes:
        args = fx.node.map_aggregate(args, resolve)
        kwargs = fx.node.map_aggregate(kwargs, resolve)
        if op == "output":
            made[name] = graph.output(args[0])
            continue
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"graph node {name!r} loaded as {node.name!r}")
        made[name] = node
    return fx.GraphModule(attrs, graph)  # copies each attribute a get_attr node reads
