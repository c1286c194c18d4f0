"""`plan/explain.py` (`scripts/plan.py --explain`): each alternative placement of the
explained parameters is the plan solved again with it pinned — its numbers equal a fresh
solve with that pin — and an alternative the constraints forbid names them.  One process,
fake process group of 4 ranks, a two-layer SwiGLU MLP on a (dp 2, tp 2) mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import AutoParallel, ConstraintError
from torchtitan.autoparallel.graph import placements as P
from torchtitan.autoparallel.plan.explain import (
    explain_placements,
    explanation_table,
    matching_parameters,
)

FAKE_WORLD_SIZE = 4
pytestmark = pytest.mark.usefixtures("module_fake_world")
BATCH = (Shard(0), Replicate())


class SwiGLU(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _planner() -> AutoParallel:
    with torch.device("meta"):
        model = SwiGLU()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return AutoParallel(model, lambda: torch.randn(8, 16, 32), mesh, cost_model="h100")


def _constrain(autop: AutoParallel, high: float | None = None) -> None:
    autop.clear_constraints()
    autop.add_parameter_memory_constraint(high=high)
    autop.add_input_constraints([BATCH])
    autop.add_output_constraints([BATCH])


def test_each_alternative_is_the_plan_solved_again_with_it_pinned():
    with _planner() as autop:
        _constrain(autop)
        chosen_plan = autop.optimize_placement()
        chosen = chosen_plan.params["w2.weight"]
        rows = explain_placements(autop, ["w2.weight"], lambda: _constrain(autop))
    by = {r.placement: r for r in rows}
    assert set(by) == {P.fmt(pl) for pl in P.all_placements((32, 64), (2, 2))}
    assert by[chosen].plan.predicted["step_us"] == pytest.approx(
        chosen_plan.predicted["step_us"], rel=1e-3
    )
    other = next(r for r in rows if r.placement != chosen and r.plan is not None)
    with _planner() as fresh:  # a fresh solve with that pin gives the same numbers
        _constrain(fresh)
        fresh.add_parameter_constraint("w2.weight", P.parse(other.placement))
        pinned = fresh.optimize_placement()
    assert pinned.params["w2.weight"] == other.placement
    for key in ("step_us", "peak_bytes_per_rank"):
        assert other.plan.predicted[key] == pytest.approx(pinned.predicted[key], rel=1e-3)
    assert all(
        r.plan.predicted["step_us"] >= chosen_plan.predicted["step_us"] * (1 - 2e-3)
        for r in rows
        if r.plan is not None
    )
    table = explanation_table(chosen, rows).splitlines()
    assert table[1].split()[:3] == [
        chosen,
        f"{by[chosen].plan.predicted['step_us'] / 1e3:.3f}",
        "chosen",
    ]


def test_an_alternative_the_budget_forbids_names_the_constraints():
    with _planner() as autop:  # 1/4 of the parameters per rank: all of w2 is too much
        rows = explain_placements(autop, ["w2.weight"], lambda: _constrain(autop, high=0.25))
    forbidden = {r.placement: r.infeasible for r in rows if r.plan is None}
    assert "R,R" in forbidden
    assert forbidden["R,R"] == (
        "constraints cannot all hold: parameter memory budget low=None high=0.25; "
        "parameter 'w2.weight' pinned to R,R"
    )
    chosen = next(r.placement for r in rows if r.plan is not None)
    assert "R,R          not possible: constraints cannot all hold" in explanation_table(
        chosen, rows
    )


def test_a_pattern_naming_nothing_or_several_shapes_is_refused():
    shapes = {"w1.weight": (64, 32), "w3.weight": (64, 32), "w2.weight": (32, 64)}
    assert matching_parameters("w[13].weight", shapes) == ["w1.weight", "w3.weight"]
    with pytest.raises(ConstraintError, match="no parameter matches it"):
        matching_parameters("w4.weight", shapes)
    with pytest.raises(ConstraintError, match="parameters of different shapes"):
        matching_parameters("w*.weight", shapes)


def test_the_html_page_gives_each_group_its_collectives_and_top_reasons(tmp_path):
    from torchtitan.autoparallel.plan.display import write_html
    from torchtitan.autoparallel.plan.reasons import group_reasons, implied_collectives

    with _planner() as autop:
        _constrain(autop, high=1.0)  # no parameter budget: every placement possible
        chosen = autop.optimize_placement()
        rows = explain_placements(autop, ["w2.weight"], lambda: _constrain(autop, high=1.0))
    others = {f"w2 at {r.placement}": r.plan for r in rows if r.plan is not None}
    reasons = group_reasons(chosen, others, top=2)
    assert set(reasons) == {"w2.weight 32x64"}  # only w2 is placed otherwise elsewhere
    beaten_most = sorted(
        (p for p in others.values() if p.params["w2.weight"] != chosen.params["w2.weight"]),
        key=lambda p: -p.predicted["step_us"],  # the placements the choice beats most
    )[:2]
    got = reasons["w2.weight 32x64"]
    assert [r.step_us[1] for r in got] == [p.predicted["step_us"] for p in beaten_most]
    assert [r.placement for r in got] == [p.params["w2.weight"] for p in beaten_most]
    assert got[0].group_comm_us == (
        chosen.param_comm_us["w2.weight"],
        beaten_most[0].param_comm_us["w2.weight"],
    )
    fsdp_like = P.fmt((Shard(0), Replicate()))
    fsdp_plan = others[f"w2 at {fsdp_like}"]
    assert implied_collectives(fsdp_plan, "w2.weight") == (
        "dp: all-gather, gradient reduce-scatter; tp: used whole"
    )
    write_html(tmp_path / "plan.html", {"auto": chosen}, ["dp", "tp"], [2, 2], "t", None, reasons)
    page = (tmp_path / "plan.html").read_text()
    assert "why each group is placed as it is" in page
    assert f"vs w2 at {got[0].placement}: step" in page
    assert page.count("every other plan places it the same way") == 2  # w1, w3
