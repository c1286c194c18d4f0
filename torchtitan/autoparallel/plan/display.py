"""Plans for people, all display in one place: the short summary the trainer logs
(`plan_summary`), the full table (`plan_table`), grouped parameter rows, the one-line
summary and the HTML page `scripts/plan.py` prints and writes."""

from __future__ import annotations

import html
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..policies.recompute import describe_policies
from ..policies.regather import describe_units
from ..trace.repeat import name_pattern
from .plan import Plan
from .reasons import Reason, implied_collectives, parameter_groups


def collapse(
    params: dict[str, str], shapes: dict[str, list[int]]
) -> list[tuple[str, str, str, int]]:
    """Group parameters whose FQN differs only in integer components and whose placement is
    equal: 'layers.{0..31}.attention.wq.weight'."""
    groups: OrderedDict[tuple, list[int]] = OrderedDict()
    for fqn, pl in params.items():
        parts = fqn.split(".")
        idx = [p for p in parts if p.isdigit()]
        key = (name_pattern(fqn), pl, tuple(shapes.get(fqn, ())))
        groups.setdefault(key, []).append(int(idx[0]) if idx else -1)
    rows = []
    for (pattern, pl, shape), ids in groups.items():
        ids = sorted(i for i in ids if i >= 0)
        if ids:
            rng = (
                f"{ids[0]}..{ids[-1]}"
                if ids == list(range(ids[0], ids[-1] + 1))
                else ",".join(map(str, ids))
            )
            name = pattern.replace("*", "{" + rng + "}", 1)
        else:
            name = pattern
        rows.append((name, "x".join(map(str, shape)), pl, len(ids) or 1))
    return rows


def describe(pl: str, names: Sequence[str]) -> str:
    """`S(0),R` on mesh dims (dp, tp) -> `dp:S(0), tp:R`."""
    parts = pl.split(",")
    return ", ".join(f"{n}:{p}" for n, p in zip(names, parts))


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def summary_line(label: str, plan: Plan) -> str:
    """One line: predicted step = compute + recompute + exposed communication, the
    recompute policies, which units keep their gathered parameters and which gather them
    again, and the predicted peak memory per rank with its parts."""
    p = plan.predicted
    comp, comm = p.get("compute_us", 0.0), p.get("exposed_comm_us", p.get("comm_us", 0.0))
    rec = p.get("recompute_us", 0.0)
    mem = p.get("peak_bytes_per_rank")
    mem_s = (
        ""
        if mem is None
        else (
            f" | peak memory/rank {gib(mem)} (params {gib(p['param_bytes_per_rank'])}, grads "
            f"{gib(p['grad_bytes_per_rank'])}, AdamW {gib(p['optim_bytes_per_rank'])}, "
            f"saved activations {gib(p['activation_bytes_per_rank'])}, backward working set "
            f"{gib(p.get('transient_bytes_per_rank', 0.0))}"
            + (f"; {p['peak_where']}" if p.get("peak_where") else "")
            + ")"
        )
    )
    rec_s = f" + recompute {rec / 1e3:9.2f} ms" if rec else ""
    policies = (
        f" | recompute {describe_policies(plan.recompute)}"
        if any(v != "none" for v in plan.recompute.values())
        else ""
    )
    gathers = f" | {regather_line(plan)}" if plan.regathered else ""
    return (
        f"{label:<14} step {(comp + rec + comm) / 1e3:9.2f} ms = compute {comp / 1e3:9.2f} ms"
        f"{rec_s} + exposed comm {comm / 1e3:9.2f} ms{policies}{gathers}{mem_s}"
    )


def mesh_search_html(search: Any) -> str:  # a mesh_search.MeshSearch
    """The mesh search's candidates as an HTML table, the chosen one in bold."""
    head = ["mesh", "step ms", "exposed comm ms", "memory/rank GiB", "fits", "proven gap", "plan s"]
    rows = []
    for i, r in enumerate(search.results):
        p = r.predicted
        cells = [
            r.mesh.label(),
            f"{r.step_us / 1e3:.2f}" if r.fits else "-",
            f"{p['exposed_comm_us'] / 1e3:.2f}" if r.fits else "-",
            f"{p['peak_bytes_per_rank'] / 2**30:.2f}" if r.fits else "-",
            "yes" if r.fits else f"no: {r.note}",
            "-" if r.gap is None else f"{r.gap:.2%}",
            f"{r.plan_s:.1f}",
        ]
        style = ' style="font-weight:bold"' if i == search.chosen else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    rows += [
        f"<tr><td>{html.escape(label)}</td><td colspan=6>not planned: {html.escape(why)}</td></tr>"
        for label, why in search.skipped
    ]
    return (
        f"<h2>mesh search</h2><p>{html.escape(search.verdict())}</p><table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def write_html(
    path: Path,
    plans: dict[str, Plan],
    names: Sequence[str],
    mesh_shape: Sequence[int],
    title: str,
    search: Any = None,  # a mesh_search.MeshSearch
    reasons: Mapping[str, Sequence[Reason]] | None = None,
) -> None:
    """One page: the mesh search's candidates if there was one, then per plan its summary
    line and a table of every parameter's placement per mesh dim, split dims coloured; with
    `reasons` (reasons.py, about the first plan) a table of why each group of the first
    plan is placed as it is."""
    colors = ["#e6f2ff", "#ffe0b3", "#c6f0c6", "#f0c6f0", "#fff3a0", "#d0d0ff"]

    def cell(pl_item: str) -> str:
        if pl_item == "R":
            return '<td class="r">R</td>'
        m = re.match(r"S\((-?\d+)\)", pl_item)
        if m:
            d = int(m.group(1))
            return f'<td style="background:{colors[(d + 1) % len(colors)]}">split dim {d}</td>'
        return f"<td>{html.escape(pl_item)}</td>"

    out = [
        f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;font-size:13px}"
        "table{border-collapse:collapse;margin:8px 0 24px}"
        "td,th{border:1px solid #bbb;padding:2px 6px;text-align:left}td.r{color:#999}"
        "h2{margin-top:28px}</style>",
        f"<h1>{html.escape(title)}</h1>",
        "<p>Each row is a parameter (layer by layer); each mesh-dim column says which tensor "
        "dim is split across that mesh dim (R = replicated).</p>",
    ]
    if search is not None:
        out.append(mesh_search_html(search))
    for i, (label, plan) in enumerate(plans.items()):
        out.append(f"<h2>{html.escape(label)}</h2><p>{html.escape(summary_line(label, plan))}</p>")
        if i == 0 and reasons is not None:
            out.append(_reasons_html(plan, reasons))
        out.append(
            "<table><tr><th>parameter</th><th>shape</th>"
            + "".join(f"<th>{html.escape(n)} ({s})</th>" for n, s in zip(names, mesh_shape))
            + "</tr>"
        )
        for fqn, pl in plan.params.items():
            shape = "x".join(map(str, plan.param_shapes.get(fqn, [])))
            out.append(
                f"<tr><td>{html.escape(fqn)}</td><td>{shape}</td>"
                + "".join(cell(x) for x in pl.split(","))
                + "</tr>"
            )
        out.append("</table>")
    path.write_text("\n".join(out))


def _reasons_html(plan: Plan, reasons: Mapping[str, Sequence[Reason]]) -> str:
    """Per parameter group: its placement, the collectives it implies, the top reasons."""
    rows = [
        "<h3>why each group is placed as it is</h3><table><tr><th>parameter group</th>"
        "<th>placement</th><th>collectives it implies</th><th>against the fastest other plan "
        "per other placement: predicted step, and this group's own redistributions</th></tr>"
    ]
    for group, fqns in parameter_groups(plan).items():
        why = "<br>".join(html.escape(str(r)) for r in reasons.get(group, ())) or (
            "every other plan places it the same way"
        )
        rows.append(
            f"<tr><td>{html.escape(group)}</td><td>{html.escape(plan.params[fqns[0]])}</td>"
            f"<td>{html.escape(implied_collectives(plan, fqns[0]))}</td><td>{why}</td></tr>"
        )
    return "\n".join([*rows, "</table>"])


def plan_summary(plan: Plan) -> str:
    """One line per distinct (parameter pattern, placement): repeated layers collapse."""
    groups: dict[tuple[str, str], int] = {}
    for fqn, placement in plan.params.items():
        pattern = name_pattern(fqn)
        groups[(pattern, placement)] = groups.get((pattern, placement), 0) + 1
    width = max((len(p) for p, _ in groups), default=0)
    dims = ",".join(f"{n}={s}" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape))
    lines = [f"plan on mesh ({dims}); placement per mesh dim:"]
    lines += [
        f"  {p.ljust(width)}  {pl}" + (f"  (x{n})" if n > 1 else "")
        for (p, pl), n in groups.items()
    ]
    pred = plan.predicted
    lines.append(
        f"  predicted: compute {pred.get('compute_us', 0) / 1e3:.2f} ms, communication "
        f"{pred.get('comm_us', 0) / 1e3:.2f} ms; parameters per rank "
        f"{pred.get('param_fraction', 1.0):.3f} of full"
    )
    if "in_flight_peak_bytes_per_rank" in pred:
        lines.append(
            "  peak memory per rank with the pipeline's microbatches in flight: "
            f"{pred['in_flight_peak_bytes_per_rank'] / 2**30:.3f} GiB (one microbatch: "
            f"{pred['peak_bytes_per_rank'] / 2**30:.3f} GiB)"
        )
    if plan.recompute:
        lines.append(
            f"  recompute: {describe_policies(plan.recompute)} "
            f"(+{pred.get('recompute_us', 0) / 1e3:.2f} ms)"
        )
    if plan.regathered:
        lines.append("  " + regather_line(plan))
    if "peak_bytes_per_rank" in pred:
        lines.append("  " + memory_line(pred))
    return "\n".join(lines)


def plan_table(plan: Plan) -> str:
    """Every parameter's placement per mesh dim and predicted communication, then the
    predicted step, the solver's facts and the stage timings."""
    names = plan.mesh_dim_names
    head = (
        ["parameter", "shape"] + [f"{n}({s})" for n, s in zip(names, plan.mesh_shape)] + ["comm ms"]
    )
    rows = [head]
    for fqn, pl in plan.params.items():
        parts = pl.split(",")
        comm = plan.param_comm_us.get(fqn)
        rows.append(
            [fqn, "x".join(map(str, plan.param_shapes.get(fqn, [])))]
            + parts
            + ["-" if comm is None else f"{comm / 1e3:.3f}"]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    p = plan.predicted
    lines.append("")
    lines.append(f"inputs: {plan.inputs}   outputs: {plan.outputs}")
    lines.append(
        f"predicted step: compute {p.get('compute_us', 0) / 1e3:.3f} ms, "
        f"communication {p.get('comm_us', 0) / 1e3:.3f} ms "
        f"(forward {p.get('fwd_comm_us', 0) / 1e3:.3f} ms, "
        f"backward {p.get('bwd_comm_us', 0) / 1e3:.3f} ms); "
        f"parameter memory per rank {p.get('param_fraction', 1.0):.4f} of full"
    )
    if plan.solver:
        s = plan.solver
        lines.append(
            f"solver: {s.get('status')} optimal={s.get('optimal')} "
            f"vars={s.get('num_vars')} rows={s.get('num_rows')}"
        )
    if plan.timings:
        lines.append("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in plan.timings.items()))
    return "\n".join(lines)


def regather_line(plan: Plan) -> str:
    """`gathered parameters: layers.0-6 gather again (2 of them from a kept sharded copy);
    root, layers.7 keep (+0.12 ms)`: which units the backward gathers again, those that keep
    a sharded copy and gather it themselves (report.backward_gathers), and the time the
    made-again gathers add."""
    made_again = plan.regathered
    gathers = plan.backward_gathers or made_again
    by_placement = [u for u, yes in gathers.items() if yes and not made_again.get(u)]
    line = f"gathered parameters: {describe_units(gathers)}"
    if by_placement:
        line += f" ({len(by_placement)} of them from a kept sharded copy)"
    us = plan.predicted.get("regather_us", 0.0)
    return line + (f" (+{us / 1e3:.2f} ms)" if us else "")


def memory_line(pred: dict) -> str:
    """`predicted peak per rank 1.23 GiB (where) = parameters ... + backward working set ...`
    from a plan's predictions (memory.py)."""
    parts = [
        ("parameters", "param_bytes_per_rank"),
        ("gradients", "grad_bytes_per_rank"),
        ("optimizer", "optim_bytes_per_rank"),
        ("saved activations", "activation_bytes_per_rank"),
        ("backward working set", "transient_bytes_per_rank"),
    ]
    gib = lambda k: pred.get(k, 0.0) / 2**30  # noqa: E731
    where = f" ({pred['peak_where']})" if pred.get("peak_where") else ""
    return f"predicted peak per rank {gib('peak_bytes_per_rank'):.3f} GiB{where} = " + " + ".join(
        f"{name} {gib(key):.3f}" for name, key in parts
    )
