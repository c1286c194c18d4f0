"""Stage 4b (report): the solver's Solution written as a Plan — placements, predicted
compute and communication (forward / backward, per parameter), memory per rank, solver
facts — for the whole model."""

from __future__ import annotations

from typing import Any

from ..cost.memory import param_chains, plan_memory
from ..graph import placements as P
from ..graph.edge_keys import ConsumerEdge, GradEdge, HubEdge, InputGradEdge
from ..solve.problem import PlanningProblem
from ..solve.program import Solution
from ..strategies.table import StrategyTable, placed
from ..trace.joint import TracedGraph
from .plan import Plan, graph_fingerprint


def solution_to_plan(problem: PlanningProblem, sol: Solution, timings: dict[str, float]) -> Plan:
    """The plan the solver chose, for the whole model (a shallow trace's parameters read
    off the traced ones standing for them), with its predictions and solver facts."""
    tg, table, mesh = problem.tg, problem.table, problem.mesh
    pick = lambda node: table.nodes[node].strategies[sol.choice[node]]  # noqa: E731
    # parameters and buffers of the whole model, each read off the traced one standing for it
    full_params = list(problem.model.param_shapes)
    traced = problem.traced_name
    grads = {f: P.fmt(pl) for f, pl in sol.grad_placement.items()}
    comm_per_param = param_comm(tg, table, sol)
    regather = problem.regather
    return Plan(
        mesh_shape=list(mesh.shape),
        mesh_dim_names=list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)]),
        params={f: P.fmt(pick(tg.params[traced(f)]).out[0]) for f in full_params},
        grads={f: grads[traced(f)] for f in full_params if traced(f) in grads},
        buffers={
            f: P.fmt(pick(tg.buffers[traced(f)]).out[0])
            for f in problem.model.buffer_names
            if traced(f) in tg.buffers
        },
        inputs=[P.fmt(pick(n).out[0]) for n in tg.inputs],
        outputs=[P.fmt(sol.sink_placement[i]) for i in range(len(tg.outputs))],
        nodes=_node_entries(tg, table, sol),
        param_shapes={f: list(s) for f, s in problem.model.param_shapes.items()},
        param_comm_us={
            f: comm_per_param[traced(f)] for f in full_params if traced(f) in comm_per_param
        },
        predicted=_predicted(problem, sol),
        solver={
            "status": sol.status,
            "optimal": sol.optimal,
            "gap": sol.gap,
            "objective": sol.objective,
            "num_vars": sol.num_vars,
            "num_rows": sol.num_rows,
        },
        timings=dict(timings),
        graph_fingerprint=graph_fingerprint(tg.gm),
        blocks=[b.to_json() for b in problem.blocks] if tg.shallow else [],
        recompute=problem.recompute_policies(sol.recompute),
        regathered=regather.model_units(sol.regathered),
        backward_gathers=regather.model_units(backward_gathers(tg, table, sol)),
    )


def _node_entries(tg: TracedGraph, table: StrategyTable, sol: Solution) -> dict[str, dict]:
    """Per graph node: the placements its inputs are redistributed to, its outputs', the
    hubs of values several consumers share, and its block label on a shallow trace."""
    nodes: dict[str, dict[str, Any]] = {}
    for node, ns in table.nodes.items():
        if node.op != "call_function":
            continue
        st = ns.strategies[sol.choice[node]]
        nodes[node.name] = {
            "op": str(node.target),
            "ins": [P.fmt(p) for p in st.ins],
            "out": [P.fmt(p) for p in st.out],
        }
        hubs = [sol.hubs.get((node, i)) for i in range(len(st.out))]
        if any(h is not None for h in hubs):  # where a value shared by consumers is sent
            nodes[node.name]["hubs"] = [P.fmt(h) if h is not None else "-" for h in hubs]
        if tg.shallow:
            nodes[node.name]["block"] = tg.labels.get(node)
    return nodes


def _forward_backward_comm(tg: TracedGraph, sol: Solution) -> tuple[float, float]:
    """Predicted communication of the forward and of the backward (every block counted)."""
    fwd_comm = bwd_comm = 0.0
    for key, us in sol.edge_comm.items():
        if isinstance(key, (ConsumerEdge, HubEdge)):
            us *= tg.weight(key.node)
            forward = key.node in tg.forward_nodes
        elif isinstance(key, GradEdge):
            us *= tg.weight(tg.params[key.fqn])
            forward = False
        elif isinstance(key, InputGradEdge):
            forward = False
        else:  # an output leaves the forward
            forward = True
        if forward:
            fwd_comm += us
        else:
            bwd_comm += us
    return fwd_comm, bwd_comm


def _predicted(problem: PlanningProblem, sol: Solution) -> dict[str, float]:
    """The plan's predicted figures: time split by kind, parameter fraction, memory."""
    tg, table = problem.tg, problem.table
    fwd_comm, bwd_comm = _forward_backward_comm(tg, sol)
    nbytes = lambda n: n.meta["val"].numel() * n.meta["val"].element_size() * tg.weight(n)  # noqa: E731
    total = sum(nbytes(n) for n in tg.params.values())
    local = sum(
        nbytes(n)
        * P.shard_fraction(
            n.meta["val"].shape,
            placed(table.nodes[n].strategies[sol.choice[n]].out[0]),
            table.mesh_shape,
        )
        for n in tg.params.values()
    )
    return {
        "compute_us": sol.compute_us,
        "comm_us": sol.comm_us,
        # parameter gathers / gradient reductions hide behind up to
        # overlap_efficiency x compute; activation communication is exposed
        "overlappable_comm_us": sol.overlappable_comm_us,
        "exposed_comm_us": sol.exposed_comm_us,
        "recompute_us": sol.recompute_us,
        "regather_us": sol.regather_us,
        "step_us": sol.compute_us + sol.recompute_us + sol.exposed_comm_us,
        "fwd_comm_us": fwd_comm,
        "bwd_comm_us": bwd_comm,
        "param_fraction": (local / total) if total else 1.0,
        **plan_memory(
            tg,
            table,
            sol.choice,
            regather=problem.regather,
            counts=sol.recompute,
            regathered=sol.regathered,
        ),
    }


def param_comm(tg: TracedGraph, table: StrategyTable, sol: Solution) -> dict[str, float]:
    """Predicted communication attributable to each parameter: redistributions of the
    parameter and of its single-input chain (cast, transpose, view) plus its gradient's."""
    owner = param_chains(tg, table)
    out = {fqn: 0.0 for fqn in tg.params}
    for key, us in sol.edge_comm.items():
        if isinstance(key, GradEdge):
            out[key.fqn] += us
        elif isinstance(key, ConsumerEdge):  # hubs carry activations
            src = table.nodes[key.node].sources[key.arg][0]
            if src in owner:
                out[owner[src]] += us
    return out


def backward_gathers(tg: TracedGraph, table: StrategyTable, sol: Solution) -> frozenset[str]:
    """Traced parameters the plan's backward gathers: those it makes again from the sharded
    parameters (`sol.regathered`), and those whose kept chain value a backward node reads
    through a redistribution of its own (a plan may keep a sharded copy and gather it in the
    backward: gathering again by placement)."""
    owner = param_chains(tg, table)
    out = set(sol.regathered)
    for key, us in sol.edge_comm.items():
        if isinstance(key, ConsumerEdge) and us > 0 and key.node not in tg.forward_nodes:
            src = table.nodes[key.node].sources[key.arg][0]
            if src in owner:  # into the backward from the chain (a backward transpose too)
                out.add(owner[src])
    return frozenset(out)
