"""Eager lowered graphs write a sum, or an all-reduce, into an operand that dies at it
(execute/in_place.py): only where nothing else can see the operand change, with the
functional graph's results."""

import operator

import pytest
import torch
import torch.distributed as dist
from lowered_graphs import eager_then_for_inductor
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan.autoparallel.execute.in_place import accumulate_in_place, reduce_in_place

aten = torch.ops.aten


def _sums(x, w, y, bias, wide):
    fresh = torch.mm(x, w) + y  # a new product read once: into it
    inputs = x + y  # both are the caller's tensors: a new sum
    m = torch.mm(x, w)
    twice = m + y  # m is read again below: a new sum
    viewed = torch.mm(x, w).view(-1) + y.reshape(-1)  # through a view of a new product: into it
    swapped = bias + torch.mm(x, w)  # into the second operand, which has the sum's shape
    promoted = torch.mm(x, w) + wide  # the sum is float64: a new sum
    scaled = torch.add(y, torch.mm(x, w), alpha=2.0)  # alpha: only the first operand, an input
    unsafe = aten._unsafe_view(torch.mm(x, w), [16]) + y.reshape(-1)  # into the product
    of_input = aten._unsafe_view(x, [16]) + y.reshape(-1)  # a view of an input: a new sum
    return fresh, inputs, twice, m * 2, viewed, swapped, promoted, scaled, unsafe, of_input


def _examples():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 4, generator=g),
        torch.randn(4, 4, generator=g),
        torch.randn(4, 4, generator=g),
        torch.randn(4, generator=g),
        torch.randn(4, 4, generator=g, dtype=torch.float64),
    ]


def test_only_sums_into_operands_nothing_else_sees():
    gm = make_fx(_sums, tracing_mode="fake")(*_examples())
    adds = [n for n in gm.graph.nodes if n.target in (aten.add.Tensor, aten.add_.Tensor)]
    assert len(adds) == 9
    assert accumulate_in_place(gm) == 4
    in_place = [n.target is aten.add_.Tensor for n in adds]
    assert in_place == [True, False, False, True, True, False, False, True, False]
    # each in-place sum writes into the product, never into a graph input
    for n in adds:
        if n.target is aten.add_.Tensor:
            into = n.args[0]
            while into.target not in (aten.mm.default, operator.getitem):
                into = into.args[0]
            assert into.target is aten.mm.default, gm.code
    inputs = _examples()
    before = [t.clone() for t in inputs]
    for got, want in zip(gm(*inputs), _sums(*_examples())):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for t, b in zip(inputs, before):
        assert torch.equal(t, b)  # no input was written


def test_eager_graphs_sum_in_place_compiled_ones_stay_functional(fake_world, monkeypatch):
    """The planned Llama's eager backward accumulates its gradients in place, the graphs for
    inductor keep `add` (inductor plans buffers itself), and the gradients are bitwise the
    same."""
    eager, functional, grads = eager_then_for_inductor(fake_world, monkeypatch, n_layers=2)

    def count(lp, target):
        return sum(n.target is target for n in lp.partition.bwd.graph.nodes)

    assert count(eager, aten.add_.Tensor) > 10 and count(functional, aten.add_.Tensor) == 0
    assert count(functional, aten.add.Tensor) >= count(eager, aten.add_.Tensor)
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("alpha", [1, 2.0])
def test_a_sum_into_a_dying_operand_matches_the_functional_sum(alpha):
    def f(x, w, y):
        return torch.add(torch.mm(x, w), y, alpha=alpha)

    args = _examples()[:3]
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert accumulate_in_place(gm) == 1
    assert torch.equal(gm(*args), f(*args))


_funcol = torch.ops._c10d_functional


def _reductions(x, w, y, group):
    def reduce(t):
        return _funcol.wait_tensor(_funcol.all_reduce(t, "sum", group))

    bucket = reduce(torch.cat([torch.mm(x, w).reshape(-1), y.reshape(-1)]))  # packed: in place
    of_input = reduce(x)  # the caller's tensor: a copy is reduced
    m = torch.mm(x, w)
    read_again = reduce(m) + m  # m is read again: a copy is reduced
    strided = reduce(torch.mm(x, w).t())  # not contiguous: a copy is reduced
    viewed = reduce(torch.mm(x, w).view(-1))  # a view of a new product: in place
    return bucket, of_input, read_again, strided, viewed


def test_an_all_reduce_of_a_dying_operand_reduces_it_in_place(fake_world):
    with fake_world(2):
        group = dist.group.WORLD.group_name
        args = _examples()[:3]
        gm = make_fx(lambda x, w, y: _reductions(x, w, y, group), tracing_mode="fake")(*args)
        reduces = [n for n in gm.graph.nodes if "all_reduce" in str(n.target)]
        assert len(reduces) == 5
        assert reduce_in_place(gm) == 2
        assert [n.target is _funcol.all_reduce_.default for n in reduces] == [
            True,
            False,
            False,
            False,
            True,
        ]
        before = [t.clone() for t in args]
        for got, want in zip(gm(*args), _reductions(*args, group)):
            assert torch.equal(got, want)  # (the fake group reduces nothing)
        for t, b in zip(args, before):
            assert torch.equal(t, b)  # no input was written
