"""A plan is data: what the solver chose, in a readable and serialisable form.

`Plan.params[fqn]` is the parameter's placement (text form, one entry per mesh dim, e.g.
`"S(0),R"`); `Plan.nodes[name]` holds, for every forward/backward graph node, the placements
its tensor inputs are redistributed to and its output placements.  `apply_placement` needs only
this (plus the traced graph, which is checked against `graph_fingerprint`), so a plan saved
with `save()` can be loaded with `Plan.load()` and applied later.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.fx as fx

from ..errors import PlannerError
from ..policies.recompute import describe_policies
from ..policies.regather import describe_units
from ..trace.repeat import name_pattern


@dataclass
class Plan:
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    params: dict[str, str]
    grads: dict[str, str]
    buffers: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    nodes: dict[str, dict]  # name -> {"op": str, "ins": [str], "out": [str]}
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    param_comm_us: dict[str, float] = field(default_factory=dict)  # predicted, per parameter
    predicted: dict[str, float] = field(default_factory=dict)  # compute_us, comm_us, ...
    solver: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    graph_fingerprint: str = ""
    # planned on a shallow trace (repeat.py): the repeated stacks, and nodes carry block labels
    blocks: list[dict] = field(default_factory=list)
    # block of the whole model ("layers#3") -> activation recompute policy (recompute.py)
    recompute: dict[str, str] = field(default_factory=dict)
    # FSDP unit of the whole model ("layers.3", "" the root) -> whether the backward gathers
    # its parameters again (else it keeps what the forward gathered; regather.py).  None: a
    # plan made before this was a choice (the runner's reshard-after-forward policy decides)
    regathered: dict[str, bool] | None = None
    # unit -> whether the backward all-gathers its parameters at all: made again as above, or
    # a kept sharded copy the backward redistributes itself (report.backward_gathers)
    backward_gathers: dict[str, bool] | None = None
    version: int = 1

    # ---------------- serialisation ----------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
            return cls(**data)
        except (TypeError, json.JSONDecodeError) as e:
            raise PlannerError(f"not a plan: {e}") from None

    def check_applicable(
        self,
        param_shapes: dict[str, tuple[int, ...]],
        mesh_shape: list[int],
        mesh_dim_names: list[str],
    ) -> None:
        """Raise `PlannerError` unless this plan fits these parameters and this mesh: same
        mesh, every parameter placed, every placement readable and leaving no shard
        empty (what a plan read from a file must pass before it is applied)."""
        from ..errors import ConstraintError
        from ..graph.placements import is_valid, parse

        if list(self.mesh_shape) != list(mesh_shape) or list(self.mesh_dim_names) != list(
            mesh_dim_names
        ):
            raise PlannerError(
                f"made for mesh {self.mesh_shape} {self.mesh_dim_names}, "
                f"not {list(mesh_shape)} {list(mesh_dim_names)}"
            )
        missing = sorted(set(param_shapes) - set(self.params))
        if missing or not self.nodes:
            raise PlannerError(f"places no {missing[0] if missing else 'graph node'}")
        try:
            for fqn, text in self.params.items():
                if fqn not in param_shapes:
                    raise PlannerError(f"places unknown parameter {fqn}")
                pl = parse(text)
                if len(pl) != len(mesh_shape) or not is_valid(param_shapes[fqn], pl, mesh_shape):
                    raise PlannerError(
                        f"impossible placement {text!r} for {fqn} {list(param_shapes[fqn])}"
                    )
            for name, entry in self.nodes.items():
                for text in [*entry.get("ins", []), *entry.get("out", [])]:
                    if text and text != "-":  # "-": not a tensor
                        parse(text)
        except (ConstraintError, AttributeError, TypeError) as e:
            raise PlannerError(f"unreadable placement: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    # ---------------- display ----------------
    def summary(self) -> str:
        """One line per distinct (parameter pattern, placement): repeated layers collapse."""
        groups: dict[tuple[str, str], int] = {}
        for fqn, placement in self.params.items():
            pattern = name_pattern(fqn)
            groups[(pattern, placement)] = groups.get((pattern, placement), 0) + 1
        width = max((len(p) for p, _ in groups), default=0)
        dims = ",".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        lines = [f"plan on mesh ({dims}); placement per mesh dim:"]
        lines += [
            f"  {p.ljust(width)}  {pl}" + (f"  (x{n})" if n > 1 else "")
            for (p, pl), n in groups.items()
        ]
        pred = self.predicted
        lines.append(
            f"  predicted: compute {pred.get('compute_us', 0) / 1e3:.2f} ms, communication "
            f"{pred.get('comm_us', 0) / 1e3:.2f} ms; parameters per rank "
            f"{pred.get('param_fraction', 1.0):.3f} of full"
        )
        if self.recompute:
            lines.append(
                f"  recompute: {describe_policies(self.recompute)} "
                f"(+{pred.get('recompute_us', 0) / 1e3:.2f} ms)"
            )
        if self.regathered is not None:
            lines.append("  " + regather_line(self))
        if "peak_bytes_per_rank" in pred:
            lines.append("  " + memory_line(pred))
        return "\n".join(lines)

    def table(self) -> str:
        names = self.mesh_dim_names
        head = (
            ["parameter", "shape"]
            + [f"{n}({s})" for n, s in zip(names, self.mesh_shape)]
            + ["comm ms"]
        )
        rows = [head]
        for fqn, pl in self.params.items():
            parts = pl.split(",")
            comm = self.param_comm_us.get(fqn)
            rows.append(
                [fqn, "x".join(map(str, self.param_shapes.get(fqn, [])))]
                + parts
                + ["-" if comm is None else f"{comm / 1e3:.3f}"]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        p = self.predicted
        lines.append("")
        lines.append(f"inputs: {self.inputs}   outputs: {self.outputs}")
        lines.append(
            f"predicted step: compute {p.get('compute_us', 0) / 1e3:.3f} ms, "
            f"communication {p.get('comm_us', 0) / 1e3:.3f} ms "
            f"(forward {p.get('fwd_comm_us', 0) / 1e3:.3f} ms, "
            f"backward {p.get('bwd_comm_us', 0) / 1e3:.3f} ms); "
            f"parameter memory per rank {p.get('param_fraction', 1.0):.4f} of full"
        )
        if self.solver:
            s = self.solver
            lines.append(
                f"solver: {s.get('status')} optimal={s.get('optimal')} "
                f"vars={s.get('num_vars')} rows={s.get('num_rows')}"
            )
        if self.timings:
            lines.append("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def regather_line(plan: "Plan") -> str:
    """`gathered parameters: layers.0-6 gather again (2 of them from a kept sharded copy);
    root, layers.7 keep (+0.12 ms)`: which units the backward gathers again, those that keep
    a sharded copy and gather it themselves (report.backward_gathers), and the time the
    made-again gathers add."""
    made_again = plan.regathered or {}
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


def graph_fingerprint(gm: fx.GraphModule) -> str:
    h = hashlib.sha1()
    for n in gm.graph.nodes:
        h.update(f"{n.name}:{n.op}:{n.target}".encode())
    return h.hexdigest()[:16]
