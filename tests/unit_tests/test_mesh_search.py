"""Mesh search: candidate meshes (factorisations, what the model and machine allow), one
plan per candidate from a single trace, the cheapest that fits chosen and certified.

One process, fake process group of 8 ranks, small MLPs built on meta.  Which mesh wins
comes from the cost model (big weights and a slow inter-node link: tensor parallelism; small
weights and many tokens: pure FSDP); every search is checked against solving each candidate
from scratch with a fresh `AutoParallel`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import DEVICES, AutoParallel, CostModel, LinkSpec, Plan, PlannerError
from torchtitan.autoparallel.mesh_search import (
    CandidateResult,
    MeshCandidate,
    MeshSearch,
    factorisations,
    proven_gap,
    search_meshes,
)
from torchtitan.config.job_config import Parallelism
from torchtitan.experiments.auto_parallel.mesh_choice import candidate_degrees
from torchtitan.torch_private import planning_mesh

WORLD = 8
FAKE_WORLD_SIZE = WORLD
pytestmark = pytest.mark.usefixtures("module_fake_world")

# H100 compute and NVLink inside a node of 4; a slow (5 GB/s) link between nodes
SLOW_INTER = CostModel.for_device("h100", inter=LinkSpec(20.0, 5.0), gpus_per_node=4)


def test_for_device_takes_link_overrides():
    assert SLOW_INTER.inter == LinkSpec(20.0, 5.0) and SLOW_INTER.intra.bw_gbps == 450.0
    assert SLOW_INTER.device == DEVICES["h100"] and SLOW_INTER.gpus_per_node == 4


DP8 = MeshCandidate(("dp_shard",), (8,))
DP4_TP2 = MeshCandidate(("dp_shard", "tp"), (4, 2))
DP2_TP4 = MeshCandidate(("dp_shard", "tp"), (2, 4))
TP8 = MeshCandidate(("tp",), (8,))


class MLP(nn.Module):
    """Residual Linear-GELU-Linear blocks on (batch, seq, dim)."""

    def __init__(self, dim: int, hidden: int, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, dim, bias=False)
            )
            for _ in range(n_layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def meta_mlp(dim, hidden):
    with torch.device("meta"):
        return MLP(dim, hidden)


def batch_pins(names):
    """The trainer's pins: the batch split over every data dim, whole on tp."""
    return [Replicate() if name == "tp" else Shard(0) for name in names]


def constrain_with(memory_gib=None):
    def constrain(autop, cand):
        autop.add_parameter_memory_constraint(low=None, high=None)
        if memory_gib is not None:
            autop.add_memory_constraint(memory_gib * 2**30)
        autop.add_input_constraints([batch_pins(cand.names)])
        autop.add_output_constraints([batch_pins(cand.names)])

    return constrain


def search(model, shape, candidates, cost_model, constrain=None, **kwargs) -> MeshSearch:
    first = candidates[0]
    mesh = planning_mesh("cpu", first.shape, first.names)
    with AutoParallel(model, lambda: torch.randn(*shape), mesh, cost_model=cost_model) as autop:
        return search_meshes(autop, candidates, constrain or constrain_with(), **kwargs)


def solve_alone(model, shape, cand, cost_model) -> float:
    """Predicted step of `cand` planned from scratch (fresh trace, a real device mesh)."""
    mesh = init_device_mesh("cpu", cand.shape, mesh_dim_names=cand.names)
    with AutoParallel(model, lambda: torch.randn(*shape), mesh, cost_model=cost_model) as autop:
        constrain_with()(autop, cand)
        return autop.optimize_placement().predicted["step_us"]


def assert_matches_independent_solves(result, model, shape, cost_model):
    alone = [solve_alone(model, shape, r.mesh, cost_model) for r in result.results]
    for r, step in zip(result.results, alone):  # one trace, many meshes == a trace each
        assert r.step_us == pytest.approx(step, rel=1e-6), r.mesh
    assert alone.index(min(alone)) == result.chosen
    assert result.best.step_us == pytest.approx(min(alone), rel=1e-6)


# ------------------------------------------------------------------ factorisations
def test_factorisations_of_the_open_dims():
    dims = [("dp_replicate", 1), ("dp_shard", None), ("tp", None)]
    assert factorisations(8, dims) == [
        {"dp_replicate": 1, "dp_shard": 1, "tp": 8},
        {"dp_replicate": 1, "dp_shard": 2, "tp": 4},
        {"dp_replicate": 1, "dp_shard": 4, "tp": 2},
        {"dp_replicate": 1, "dp_shard": 8, "tp": 1},
    ]
    # a fixed size that does not divide the world: nothing
    assert factorisations(8, [("dp_replicate", 3), ("dp_shard", None), ("tp", None)]) == []
    # fixed sizes take their share first
    assert factorisations(8, [("dp_replicate", 2), ("dp_shard", None), ("tp", None)]) == [
        {"dp_replicate": 2, "dp_shard": 1, "tp": 4},
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 4, "tp": 1},
    ]
    # three open dims of world 4: every ordered triple multiplying to 4
    assert factorisations(4, [("dp_replicate", None), ("dp_shard", None), ("tp", None)]) == [
        {"dp_replicate": 1, "dp_shard": 1, "tp": 4},
        {"dp_replicate": 1, "dp_shard": 2, "tp": 2},
        {"dp_replicate": 1, "dp_shard": 4, "tp": 1},
        {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 2, "tp": 1},
        {"dp_replicate": 4, "dp_shard": 1, "tp": 1},
    ]
    assert factorisations(4, [("dp_shard", None), ("tp", None)]) == [
        {"dp_shard": 1, "tp": 4},
        {"dp_shard": 2, "tp": 2},
        {"dp_shard": 4, "tp": 1},
    ]
    # nothing open: the fixed sizes, if they make the world
    assert factorisations(4, [("dp_shard", 2), ("tp", 2)]) == [{"dp_shard": 2, "tp": 2}]
    assert factorisations(8, [("dp_shard", 2), ("tp", 2)]) == []


# ------------------------------------------------------------------ search on a fake world
def test_big_weights_and_a_slow_inter_node_link_choose_tensor_parallelism():
    model, shape = meta_mlp(2048, 8192), (8, 16, 2048)  # 128 tokens, 64M parameters
    cands = [DP8, DP4_TP2, DP2_TP4]
    # the trainer's tie-break (fewer tp ranks) only settles ties: tp 4 still wins
    result = search(model, shape, cands, SLOW_INTER, tie_break=lambda c: c.size("tp"))
    assert result.best.mesh == DP2_TP4
    assert [r.fits for r in result.results] == [True, True, True]
    steps = {r.mesh: r.step_us for r in result.results}
    assert steps[DP8] > 2 * steps[DP2_TP4]  # clearly, not by a hair
    assert steps[DP8] > steps[DP4_TP2] > steps[DP2_TP4]
    assert_matches_independent_solves(result, model, shape, SLOW_INTER)
    assert result.world == WORLD
    assert result.proven_margin is not None and result.proven_margin >= 0
    assert result.verdict().startswith(
        "mesh search (world 8, 3 candidates): dp_shard 2 x tp 4, predicted step "
        f"{steps[DP2_TP4] / 1e3:.2f} ms (proven best: every other mesh's plans are at least "
    )


def test_small_weights_and_many_tokens_choose_pure_fsdp():
    model, shape = meta_mlp(64, 128), (64, 512, 64)  # 32k tokens, 16k parameters
    cost = CostModel.for_device("h100", gpus_per_node=4)
    cands = [DP8, DP4_TP2, DP2_TP4, TP8]
    result = search(model, shape, cands, cost)
    assert result.best.mesh == DP8
    steps = [r.step_us for r in result.results]
    assert all(s > 1.05 * steps[0] for s in steps[1:]), steps
    assert_matches_independent_solves(result, model, shape, cost)


def test_equal_steps_are_settled_by_the_tie_break():
    # a 1-D replicate mesh and a 1-D shard mesh of 8 get the same program: equal steps
    model, shape = meta_mlp(64, 128), (8, 16, 64)
    replicate8 = MeshCandidate(("dp_replicate",), (8,))
    cands = [replicate8, DP8, DP4_TP2]
    first = search(model, shape, cands, "h100")
    steps = [r.step_us for r in first.results]
    assert steps[0] == pytest.approx(steps[1], rel=1e-9) and steps[2] > steps[0] * (1 + 1e-4)
    assert first.best.mesh == replicate8  # no tie-break: the first listed of the tied
    fewest_replicas = search(
        model, shape, cands, "h100", tie_break=lambda c: c.size("dp_replicate")
    )
    assert fewest_replicas.best.mesh == DP8 and fewest_replicas.chosen == 1
    assert search(model, shape, cands[::-1], "h100").best.mesh == DP8
    # the key ranks the tied candidates only: preferring most tp does not pick the slower tp 2
    most_tp = search(model, shape, cands, "h100", tie_break=lambda c: -c.size("tp"))
    assert most_tp.best.mesh == replicate8


def test_meshes_of_one_shape_share_their_strategies_and_solve_as_alone():
    """The strategies of a mesh whose shape an earlier candidate had are the memo's (no op
    queried again) and equal a fresh build's; the search's steps equal solving each alone."""
    model, shape = meta_mlp(64, 128), (8, 16, 64)
    dp4_rep2 = MeshCandidate(("dp_shard", "dp_replicate"), (4, 2))
    mesh = planning_mesh("cpu", DP4_TP2.shape, DP4_TP2.names)
    with AutoParallel(model, lambda: torch.randn(*shape), mesh, cost_model="h100") as autop:
        result = search_meshes(autop, [DP4_TP2, dp4_rep2], constrain_with())
        again = autop.on_mesh(planning_mesh("cpu", (4, 2), dp4_rep2.names))
        again.prepare()
        assert again._strategies().table.memo_misses == 0
    with AutoParallel(model, lambda: torch.randn(*shape), mesh, cost_model="h100") as fresh:
        fresh.prepare()
        alone = fresh._strategies().table
        assert alone.memo_misses > 0
    shared = again._strategies().table
    assert [ns.strategies for ns in shared.nodes.values()] == [
        ns.strategies for ns in alone.nodes.values()
    ]
    assert_matches_independent_solves(result, model, shape, "h100")


def test_candidates_solved_side_by_side_give_the_plans_of_one_process():
    """Three distinct programs solved in three forked children at once: the same results
    and the same plans as solving them one after another in this process."""
    model, shape = meta_mlp(64, 128), (8, 16, 64)
    cands = [DP8, DP4_TP2, DP2_TP4]
    apart = search(model, shape, cands, "h100", workers=3)
    here = search(model, shape, cands, "h100", workers=1)
    for a, b in zip(apart.results, here.results):
        assert (a.predicted, a.objective, a.gap, a.note) == (
            b.predicted,
            b.objective,
            b.gap,
            b.note,
        )
    assert apart.chosen == here.chosen
    assert apart.plan is not None and here.plan is not None
    untimed = [dataclasses.replace(p, timings={}).to_json() for p in (apart.plan, here.plan)]
    assert untimed[0] == untimed[1]


def test_candidate_whose_batch_cannot_split_is_reported_and_the_rest_compete():
    model, shape = meta_mlp(64, 128), (4, 16, 64)  # a batch of 4 on 8 data ranks
    result = search(model, shape, [DP8, DP4_TP2], "h100")
    assert [r.fits for r in result.results] == [False, True]
    assert result.results[0].note == (
        "input 0 dim 0 has size 4, which the 8 ranks of mesh dim(s) dp_shard cannot split "
        "evenly; use a size divisible by 8"
    )
    assert result.results[0].step_us == math.inf and result.results[0].predicted == {}
    assert result.best.mesh == DP4_TP2


LEAST = re.compile(r"the least memory any plan needs under the other constraints is ([\d.]+) GiB")


def test_memory_budget_rules_out_meshes_and_the_rest_compete():
    model, shape = meta_mlp(2048, 8192), (64, 256, 2048)
    cands = [DP8, DP4_TP2, DP2_TP4]
    free = search(model, shape, cands, SLOW_INTER)
    assert free.best.mesh == DP2_TP4

    # a budget no plan meets: every candidate is ruled out, each naming the least memory
    # its plans need (the more tp, the more of the residual stream each rank holds)
    with pytest.raises(PlannerError) as err:
        search(model, shape, cands, SLOW_INTER, constrain=constrain_with(0.01))
    message = str(err.value)
    assert message.startswith("mesh search: no candidate mesh has a plan (dp_shard 8: ")
    for cand in cands:
        assert f"{cand.label()}: constraints cannot all hold" in message
    least = dict(zip(cands, map(float, LEAST.findall(message)), strict=True))
    assert least[DP8] < least[DP4_TP2] < least[DP2_TP4]

    budget = (least[DP4_TP2] + least[DP2_TP4]) / 2  # dp 4 x tp 2 has a plan; tp 4 none
    tight = search(model, shape, cands, SLOW_INTER, constrain=constrain_with(budget))
    fits = {r.mesh: r.fits for r in tight.results}
    assert fits == {DP8: True, DP4_TP2: True, DP2_TP4: False}
    for r in tight.results[:2]:  # the plans chosen fit, and a budget never makes one faster
        assert r.predicted["peak_bytes_per_rank"] <= budget * 2**30 * (1 + 1e-6)
        assert r.step_us >= free.results[cands.index(r.mesh)].step_us * (1 - 1e-6)
    bad = tight.results[2]
    assert bad.note.startswith(f"constraints cannot all hold: memory budget {budget:.4g} GiB")
    assert "\n" not in bad.note and bad.step_us == math.inf and bad.lower_bound == math.inf
    best = min(tight.results[:2], key=lambda r: r.step_us)
    assert tight.best.mesh == best.mesh

    rows = tight.table().splitlines()
    assert rows[0].split() == (
        ["mesh", "step", "ms", "exposed", "comm", "ms", "memory/rank", "GiB", "fits", "plan", "s"]
    )
    assert len(rows) == 4
    chosen = tight.chosen
    assert [row.startswith("*") for row in rows[1:]] == [i == chosen for i in range(3)]
    assert rows[1 + chosen].startswith(f"*  {best.mesh.label()}  ")
    assert rows[3].startswith("   dp_shard 2 x tp 4  -") and f"no: {bad.note}" in rows[3]

    # the JSON the trainer broadcasts keeps infeasible candidates and their notes
    again = MeshSearch.from_json(tight.to_json())
    assert again.chosen == tight.chosen and again.best.mesh == best.mesh
    assert [r.note for r in again.results] == [r.note for r in tight.results]
    assert [r.fits for r in again.results] == [True, True, False]


def test_no_candidates_is_an_error():
    model = meta_mlp(8, 16)
    mesh = planning_mesh("cpu", (8,), ("dp_shard",))
    with AutoParallel(model, lambda: torch.randn(8, 8), mesh) as autop:
        with pytest.raises(PlannerError, match=r"^mesh search: no candidate mesh$"):
            search_meshes(autop, [], constrain_with())


def test_plan_cache_makes_the_same_choice(tmp_path):
    model, shape = meta_mlp(64, 128), (64, 512, 64)
    cost = CostModel.for_device("h100", gpus_per_node=4)
    cands = [DP8, DP4_TP2]
    first = search(model, shape, cands, cost, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2  # one plan per candidate
    again = search(model, shape, cands, cost, cache_dir=tmp_path)
    assert again.chosen == first.chosen and again.best.mesh == DP8
    assert [r.predicted for r in again.results] == [r.predicted for r in first.results]


def test_the_chosen_plan_comes_back_and_applies_from_the_same_trace():
    """The search returns the chosen mesh's plan (also through the JSON a trainer
    broadcasts): applied on the real mesh from the search's own trace, with no solve."""
    model, shape = meta_mlp(64, 128), (64, 512, 64)
    cost = CostModel.for_device("h100", gpus_per_node=4)
    mesh = planning_mesh("cpu", DP8.shape, DP8.names)
    with AutoParallel(model, lambda: torch.randn(*shape), mesh, cost_model=cost) as root:
        result = search_meshes(root, [DP8, DP4_TP2], constrain_with())
        assert result.best.mesh == DP8 and result.plan is not None
        assert result.plan.predicted == result.best.predicted
        assert (result.plan.mesh_shape, result.plan.mesh_dim_names) == ([8], ["dp_shard"])
        again = MeshSearch.from_json(result.to_json())
        assert again.plan == result.plan
        real = root.on_mesh(init_device_mesh("cpu", DP8.shape, mesh_dim_names=DP8.names))
        assert isinstance(real.apply_placement(again.plan), nn.Module)
        assert "solve" not in real.timings


# ------------------------------------------------------------------ MeshSearch by hand
def _result(cand, step_us, gap, note=""):
    predicted = (
        {} if note else {"step_us": step_us, "exposed_comm_us": 100.0, "peak_bytes_per_rank": 2**30}
    )
    objective = None if note else step_us  # no placement changes: no tie-breaks
    return CandidateResult(
        cand, predicted=predicted, gap=gap, objective=objective, note=note, plan_s=0.5
    )


def test_json_round_trip_keeps_the_search():
    search_ = MeshSearch(
        8,
        [
            _result(DP8, 1500.0, 0.0),
            _result(DP4_TP2, 1000.0, 0.01),
            _result(TP8, 0.0, None, note="constraints cannot all hold: memory budget"),
        ],
        chosen=1,
        skipped=[("dp_shard 2 x tp 4", "tp 4 does not divide n_heads 6")],
    )
    again = MeshSearch.from_json(search_.to_json())
    assert again.world == 8 and again.chosen == 1
    assert [r.mesh for r in again.results] == [DP8, DP4_TP2, TP8]
    assert all(isinstance(r.mesh.shape, tuple) for r in again.results)
    assert [r.note for r in again.results] == ["", "", "constraints cannot all hold: memory budget"]
    assert [r.step_us for r in again.results] == [1500.0, 1000.0, math.inf]
    assert [r.gap for r in again.results] == [0.0, 0.01, None]
    assert again.skipped == [("dp_shard 2 x tp 4", "tp 4 does not divide n_heads 6")]
    assert again.best.mesh == DP4_TP2 and again.proven_margin == pytest.approx(0.5)
    assert again.table() == search_.table()


def test_verdict_and_table():
    proven = MeshSearch(8, [_result(DP8, 1500.0, 0.0), _result(DP4_TP2, 1000.0, 0.0)], chosen=1)
    assert proven.proven_margin == pytest.approx(0.5)
    assert proven.verdict() == (
        "mesh search (world 8, 2 candidates): dp_shard 4 x tp 2, predicted step 1.00 ms "
        "(proven best: every other mesh's plans are at least 50.00% slower)"
    )
    # margin exactly 0 (the other mesh's bound equals the chosen step) is still proven
    even = MeshSearch(8, [_result(DP8, 1250.0, 0.2), _result(DP4_TP2, 1000.0, 0.0)], chosen=1)
    assert even.proven_margin == pytest.approx(0.0, abs=1e-12)
    assert "(proven best: every other mesh's plans are at least" in even.verdict()
    # a loose gap on the other mesh leaves room for a cheaper plan there
    loose = MeshSearch(8, [_result(DP8, 1100.0, 0.2), _result(DP4_TP2, 1000.0, 0.0)], chosen=1)
    assert loose.proven_margin == pytest.approx(-0.12)
    assert loose.verdict().endswith("(best found; the solver's gaps leave 12.00% for another mesh)")
    # no proven gap: nothing is certified
    unknown = MeshSearch(8, [_result(DP8, 5000.0, None), _result(DP4_TP2, 1000.0, 0.0)], chosen=1)
    assert unknown.proven_margin == pytest.approx(-1.0)
    # a solve that proved no bound (HiGHS' infinite gap) counts as no proven gap
    plan = Plan([8], ["dp"], {}, {}, {}, [], [], {}, solver={"gap": math.inf})
    assert proven_gap(plan) is None
    assert proven_gap(Plan([8], ["dp"], {}, {}, {}, [], [], {}, solver={"gap": 0.02})) == 0.02
    # a tie (two meshes with the same plan cost) is named, and the rest still certified
    tie = MeshSearch(
        8,
        [_result(DP8, 1000.0, 0.0), _result(DP4_TP2, 1500.0, 0.0), _result(TP8, 1000.0, 0.0)],
        chosen=0,
    )
    assert tie.tied == [2] and tie.proven_margin == pytest.approx(0.5)
    assert tie.verdict().endswith(
        "(tied with tp 8; proven best: every other mesh's plans are at least 50.00% slower)"
    )
    only = MeshSearch(8, [_result(DP8, 1000.0, 0.0)], chosen=0)
    assert only.proven_margin is None and only.verdict().endswith("(the only candidate)")
    # every other mesh has no plan: nothing to beat, said in words (not "inf%"), and the
    # JSON stays standard (no Infinity)
    alone = MeshSearch(8, [_result(DP8, 1000.0, 0.0), _result(TP8, 0, None, "no")], chosen=0)
    assert alone.verdict().endswith("(the only one with a plan)")
    assert "Infinity" not in alone.to_json()
    assert MeshSearch.from_json(alone.to_json()).best.mesh == DP8

    search_ = MeshSearch(
        8,
        [_result(DP8, 1500.0, 0.0), _result(DP4_TP2, 1000.0, 0.0), _result(TP8, 0, None, "no")],
        chosen=1,
        skipped=[("tp 8", "tp 8 spans nodes of 4")],
    )
    rows = search_.table().splitlines()
    assert len(rows) == 5
    assert [row[:1] for row in rows[1:4]] == [" ", "*", " "]
    assert rows[1].split() == ["dp_shard", "8", "1.50", "0.10", "1.00", "yes", "0.5"]
    assert rows[2].split() == (
        ["*", "dp_shard", "4", "x", "tp", "2", "1.00", "0.10", "1.00", "yes", "0.5"]
    )
    assert rows[3].split()[:5] == ["tp", "8", "-", "-", "-"] and "no: no" in rows[3]
    assert rows[4] == "   tp 8: not planned, tp 8 spans nodes of 4"


# ------------------------------------------------------------------ candidate_degrees
def _sizes(**kw):
    return {"n_heads": 8, "dim": 64, "vocab_size": 64, **kw}


def test_candidates_tp_must_divide_heads_and_sequence():
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 8, 8, _sizes(n_heads=6), 64, None
    )
    assert keep == [
        {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2},
        {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 1},
    ]
    assert skipped == [
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 8}, "tp 8 does not divide n_heads 6"),
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 4}, "tp 4 does not divide n_heads 6"),
    ]
    _, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 8, 8, _sizes(), 12, None
    )
    assert [why for _, why in skipped] == ["tp 8 does not divide training.seq_len 12"]


def test_candidates_tp_stays_within_a_node():
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 8, 8, _sizes(), 64, 2
    )
    assert [d["tp"] for d in keep] == [2, 1]
    assert skipped == [
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 8}, "tp 8 spans nodes of 2"),
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 4}, "tp 4 spans nodes of 2"),
    ]


def test_candidates_dp_must_divide_the_global_batch():
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 8, 4, _sizes(), 64, None
    )
    assert keep == [
        {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 8},
        {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 4},
        {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2},
    ]
    assert skipped == [
        (
            {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 1},
            "dp 8 does not divide the global batch 4",
        )
    ]
    # replicate and shard together make the data-parallel degree
    every_degree = Parallelism(data_parallel_replicate_degree="auto", tensor_parallel_degree="auto")
    keep, skipped = candidate_degrees(every_degree, 4, 2, _sizes(), 64, None)
    assert keep == [
        {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 4},
        {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2},
        {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 2},
    ]
    assert skipped == [
        (d, "dp 4 does not divide the global batch 2")
        for d in (
            {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1},
            {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1},
            {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "tp": 1},
        )
    ]


def test_candidates_vocab_counts_only_with_loss_parallelism():
    sizes = _sizes(vocab_size=1001)  # odd: only tp 1 divides it
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto"), 4, 4, sizes, 64, None
    )
    assert keep == [
        {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    ]  # tp 1: no split vocabulary
    assert [why for _, why in skipped] == [
        "tp 4 does not divide vocab_size 1001",
        "tp 2 does not divide vocab_size 1001",
    ]
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto", disable_loss_parallel=True),
        4,
        4,
        sizes,
        64,
        None,
    )
    assert [d["tp"] for d in keep] == [4, 2, 1] and skipped == []


def test_the_node_size_says_which_dims_cross_nodes_and_changes_the_choice():
    one_node = CostModel.for_device("h100", inter=LinkSpec(20.0, 5.0), gpus_per_node=8)
    assert SLOW_INTER.within_node((2, 4)) == [False, True]  # dp 2 of nodes of 4: inter
    assert SLOW_INTER.within_node((4, 2)) == [False, True]
    assert SLOW_INTER.within_node((2, 2)) == [True, True]  # a block of 4 ranks: one node
    assert SLOW_INTER.within_node((8,)) == [False]
    assert SLOW_INTER.within_node((3,)) == [False]  # 3 ranks straddle nodes of 4
    assert one_node.within_node((2, 4)) == [True, True]
    assert SLOW_INTER.mesh_links((2, 4)) == [SLOW_INTER.inter, SLOW_INTER.intra]
    assert SLOW_INTER.node_layout((2, 4), ("dp_shard", "tp")) == (
        "nodes of 4 ranks: dp_shard inter-node, tp intra-node"
    )
    # the model that takes tp 4 across two nodes of 4 keeps to FSDP inside one node of 8
    model, shape = meta_mlp(2048, 8192), (8, 16, 2048)
    cands = [DP8, DP4_TP2, DP2_TP4]
    result = search(model, shape, cands, one_node, tie_break=lambda c: c.size("tp"))
    assert result.best.mesh != DP2_TP4, result.table()
    assert_matches_independent_solves(result, model, shape, one_node)


def test_the_job_cost_model_takes_the_node_size_from_the_launch(monkeypatch):
    from torchtitan.experiments.auto_parallel.parallelize import job_cost_model

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job_cost_model("h100").gpus_per_node == 2
    assert job_cost_model("auto").device == DEVICES["cpu"]  # no GPU here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert job_cost_model("a100").gpus_per_node == 8


def test_candidates_include_every_pipeline_degree_when_pp_is_auto():
    keep, skipped = candidate_degrees(
        Parallelism(pipeline_parallel_degree="auto"), 4, 4, _sizes(), 64, None
    )
    assert keep == [
        {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1},
        {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1},
        {"pp": 4, "dp_replicate": 1, "dp_shard": 1, "tp": 1},
    ]
    assert skipped == []
