"""What a lowered plan's graphs (lower.Partition) do with the parameters, read off the graphs,
and a one-rank plan lowered both ways (eager, for inductor): shared by the executor's,
re-gather's and in-place sums' unit tests and the 4-rank numerics checks."""

from __future__ import annotations

import torch
from autoparallel_models import tiny_llama
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.autoparallel import AutoParallel
from torchtitan.autoparallel.execute import executor
from torchtitan.autoparallel.execute.buckets import AG
from torchtitan.autoparallel.graph.nodes import param_side
from torchtitan.autoparallel.policies.units import unit_of


def param_gathers(part, graph: str) -> list:
    """All-gathers of `graph` ("fwd" or "bwd") computed from parameters alone (the plan may
    gather activations too)."""
    gm = getattr(part, graph)
    names = part.fwd_names if graph == "fwd" else part.saved_names
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    side = param_side(gm.graph.nodes, {n for n, f in zip(phs, names) if f is not None})
    return [n for n in gm.graph.nodes if n.target is AG and n in side]


def gathered_units(part, ag, units: list[str]) -> set[str]:
    """The FSDP units (`units`: units.fsdp_units) of the parameters backward gather `ag`
    reads."""
    phs = [n for n in part.bwd.graph.nodes if n.op == "placeholder"]
    fqn = {n: f for n, f in zip(phs, part.saved_names) if f is not None}
    seen, stack = set(), [ag]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return {unit_of(fqn[n], units) for n in seen if n in fqn}


def backward_gathered_units(part, units: list[str]) -> set[str]:
    """The units whose parameters the backward all-gathers."""
    return set().union(*(gathered_units(part, ag, units) for ag in param_gathers(part, "bwd")))


def eager_then_for_inductor(fake_world, monkeypatch, n_layers: int):
    """A one-rank planned tiny Llama run eager, then with the graphs made for inductor (called
    boxed, not compiled): its two LoweredPlans, and each run's parameter gradients."""
    monkeypatch.setattr(executor, "InductorOnFirstCall", lambda gm, options: executor._boxed(gm))
    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            model = tiny_llama(n_layers=n_layers, vocab=64, seq=32)
        with AutoParallel(model, lambda: torch.zeros(4, 32, dtype=torch.long), mesh) as autop:
            pm = autop.apply_placement(autop.optimize_placement())
        pm.to_empty(device="cpu")
        torch.manual_seed(0)
        pm.init_weights()
        tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
        runs = []
        for compiled in (False, True):
            if compiled:
                pm.compile()
            pm(tokens).float().logsumexp(-1).mean().backward()
            runs.append({n: p.grad.to_local() for n, p in pm.named_parameters()})
            pm.zero_grad(set_to_none=True)
    eager, for_inductor = pm._ap_executor.lowered.values()
    return eager, for_inductor, runs
