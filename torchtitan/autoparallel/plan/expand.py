"""Run a plan made on a shallow trace on the whole model's graph (see repeat.py).

The k-th placed node of full block i takes the plan entry of the k-th placed node of the
block that represents i; unlabelled nodes map in order; every pair must be the same op.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch.fx as fx

from ..errors import PlannerError
from ..graph.nodes import is_placed
from ..trace.joint import TracedGraph
from ..trace.repeat import RepeatedBlocks
from .plan import Plan, graph_fingerprint


def expand_plan(plan: Plan, full_tg: TracedGraph) -> Plan:
    """The plan of a shallow trace, re-keyed by the nodes of the whole model's graph."""
    blocks = [RepeatedBlocks.from_json(b) for b in plan.blocks]
    nodes = expand_nodes(plan.nodes, full_tg.gm, full_tg.labels, blocks)
    return dataclasses.replace(
        plan,
        nodes=nodes,
        blocks=[],
        graph_fingerprint=graph_fingerprint(full_tg.gm),
    )


def expand_nodes(
    plan_nodes: dict[str, dict],
    full_gm: fx.GraphModule,
    full_labels: dict[fx.Node, str],
    blocks: list[RepeatedBlocks],
) -> dict[str, dict]:
    """Per-node plan entries for the full graph, read off the shallow plan (module docstring)."""
    by_name = {b.container: b for b in blocks}
    classes: dict[str | None, list[str]] = defaultdict(list)
    for name, entry in plan_nodes.items():
        classes[entry.get("block")].append(name)

    def rep_label(lab: str | None) -> str | None:
        if lab is None:
            return None
        cname, _, i = lab.rpartition("#")
        return f"{cname}#{by_name[cname].representative(int(i))}"

    count: dict[str | None, int] = defaultdict(int)
    out: dict[str, dict] = {}
    for n in full_gm.graph.nodes:
        if not is_placed(n):
            continue
        lab = full_labels.get(n)
        k = count[lab]
        count[lab] += 1
        names = classes.get(rep_label(lab), [])
        if k >= len(names) or plan_nodes[names[k]]["op"] != str(n.target):
            where = f"block '{lab}'" if lab else "outside the repeated blocks"
            theirs = plan_nodes[names[k]]["op"] if k < len(names) else "nothing"
            raise PlannerError(
                f"the model's repeated blocks do not trace identically: node {k} {where} is "
                f"{n.target} ('{n.name}') in the full model but {theirs} in the planned copy; "
                "plan with share_repeated=False"
            )
        entry = dict(plan_nodes[names[k]])
        entry.pop("block", None)
        out[n.name] = entry
    for lab, k in count.items():
        if k != len(classes.get(rep_label(lab), [])):
            raise PlannerError(
                f"the model's repeated blocks do not trace identically: {k} nodes in "
                f"{lab or 'the rest of the graph'} of the full model, "
                f"{len(classes.get(rep_label(lab), []))} in the planned copy; "
                "plan with share_repeated=False"
            )
    return out
