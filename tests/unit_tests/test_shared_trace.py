"""The whole model's trace, shared by the ranks of a job (trace/shared_trace.py): what one
rank publishes loads as the same trace, and the key tells apart models whose parameters have
the same shapes.  The 4-rank tests train on traces loaded this way (the trainer's log says
"whole-model trace: loaded what another rank traced")."""

import os
import warnings

import torch

from torchtitan.autoparallel import child_process
from torchtitan.autoparallel.child_process import run_in_child
from torchtitan.autoparallel.plan.plan import graph_fingerprint
from torchtitan.autoparallel.trace import shared_trace
from torchtitan.autoparallel.trace.joint import trace_joint
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer


def _model(n_heads: int) -> Transformer:
    args = TransformerModelArgs(dim=32, n_layers=2, n_heads=n_heads, vocab_size=64, max_seq_len=8)
    with torch.device("meta"):
        return Transformer(args)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8))


def test_a_published_trace_loads_as_the_same_trace():
    tg = trace_joint(_model(4), _tokens)
    with warnings.catch_warnings():  # e.g. a pytree leaf remade as the deprecated LeafSpec
        warnings.simplefilter("error")
        loaded = shared_trace._loads(shared_trace._dumps(tg))
    assert str(loaded.gm.graph) == str(tg.gm.graph)
    assert graph_fingerprint(loaded.gm) == graph_fingerprint(tg.gm)
    by_name = {n.name: n for n in loaded.gm.graph.nodes}
    for a in tg.gm.graph.nodes:  # traced values (fake tensors) and annotations
        b = by_name[a.name]
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (vb.shape, vb.stride(), vb.dtype) == (va.shape, va.stride(), va.dtype)
        assert b.meta.get("custom") == a.meta.get("custom")
    # every role points into the loaded graph
    assert {f: n.name for f, n in loaded.params.items()} == {
        f: n.name for f, n in tg.params.items()
    }
    assert [n.name for n in loaded.outputs] == [n.name for n in tg.outputs]
    assert {f: g.name for f, g in loaded.grads.items() if g} == {
        f: g.name for f, g in tg.grads.items() if g
    }
    assert {n.name for n in loaded.forward_nodes} == {n.name for n in tg.forward_nodes}
    assert all(n.graph is loaded.gm.graph for n in loaded.inputs + loaded.outputs)


def test_the_key_tells_apart_models_with_the_same_parameter_shapes():
    def key(model, asked=1):
        return shared_trace._key(model, _tokens, None, [], asked)

    assert key(_model(4)) == key(_model(4))
    assert key(_model(4)) != key(_model(2))  # the same weights' shapes, other heads
    assert key(_model(4)) != key(_model(4), asked=2)


def test_a_planning_child_leaves_the_store_to_its_parent():
    """A planning or compiling child shares its parent's store connection: it must not use it
    (a process merely forked, as the test harness forks its ranks, may)."""
    assert run_in_child(lambda: str(child_process.in_forked_child())) == "True"
    assert not child_process.in_forked_child()
    pid = os.fork()
    if pid == 0:
        os._exit(1 if child_process.in_forked_child() else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
