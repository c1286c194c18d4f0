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

# the plan format this planner writes and reads (2: every plan records which units gather
# their parameters again; an older plan is refused, not guessed at)
PLAN_VERSION = 2


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
    # its parameters again (else it keeps what the forward gathered; regather.py)
    regathered: dict[str, bool] = field(default_factory=dict)
    # unit -> whether the backward all-gathers its parameters at all: made again as above, or
    # a kept sharded copy the backward redistributes itself (report.backward_gathers)
    backward_gathers: dict[str, bool] = field(default_factory=dict)
    version: int = PLAN_VERSION

    # ---------------- serialisation ----------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlannerError(f"not a plan: {e}") from None
        version = data.get("version", 1) if isinstance(data, dict) else None
        if version != PLAN_VERSION:
            raise PlannerError(
                f"plan format version {version}, and this planner reads version "
                f"{PLAN_VERSION} only: plan again"
            )
        try:
            return cls(**data)
        except TypeError as e:
            raise PlannerError(f"not a plan: {e}") from None

    def check_applicable(
        self,
        param_shapes: dict[str, tuple[int, ...]],
        mesh_shape: list[int],
        mesh_dim_names: list[str],
    ) -> None:
        """Raise `PlannerError` unless this plan fits these parameters and this mesh: same
        mesh, every parameter placed and of the shape it was planned for, every placement
        readable and leaving no shard empty (what a plan read from a file must pass
        before it is applied)."""
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
                made_for = self.param_shapes.get(fqn)
                if made_for is not None and tuple(made_for) != tuple(param_shapes[fqn]):
                    raise PlannerError(
                        f"made for {fqn} of shape {list(made_for)}, not {list(param_shapes[fqn])}"
                    )
                pl = parse(text)
                if len(pl) != len(mesh_shape) or not is_valid(param_shapes[fqn], pl, mesh_shape):
                    raise PlannerError(
                        f"impossible placement {text!r} for {fqn} {list(param_shapes[fqn])}"
                    )
            for entry in self.nodes.values():
                for text in [*entry.get("ins", []), *entry.get("out", [])]:
                    if text and text != "-":  # "-": not a tensor
                        parse(text)
        except (ConstraintError, AttributeError, TypeError) as e:
            raise PlannerError(f"unreadable placement: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())


def graph_fingerprint(gm: fx.GraphModule) -> str:
    h = hashlib.sha1()
    for n in gm.graph.nodes:
        h.update(f"{n.name}:{n.op}:{n.target}".encode())
    return h.hexdigest()[:16]
