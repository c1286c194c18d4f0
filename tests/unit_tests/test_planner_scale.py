"""Planner at scale: the dry-run script, clustering exactness, cost-model sanity.

One process, fake process group (re-created per test with the world size the test needs).
Llama3 8B/70B are traced with `n_layers=2` of the real flavor: clustering shares one set of
solver variables across repeated layers, so depth does not change which placements win (the
32/80-layer traces only make the test slower).  With 2 layers everything fits in memory
replicated, so the parameter budget is set to 1/world to stand in for the memory pressure of
the full-depth model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import plan as plan_script
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from torchtitan.autoparallel import AutoParallel
from torchtitan.models.llama3.args import llama3_configs
from torchtitan.models.llama3.model import Transformer

REPO = Path(__file__).resolve().parents[2]


def _llama(flavor: str, **over):
    args = dataclasses.replace(llama3_configs[flavor], **over)
    with torch.device("meta"):
        return Transformer(args), args


def _solve(
    model,
    args,
    mesh_shape,
    names,
    batch,
    seq,
    device="h100",
    share=True,
    param_high=None,
    with_planner=False,
):
    world = 1
    for s in mesh_shape:
        world *= s
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pin = tuple(Shard(0) if d == 0 else Replicate() for d in range(len(mesh_shape)))
    with AutoParallel(
        model,
        lambda: torch.randint(0, args.vocab_size, (batch, seq)),
        mesh,
        cost_model=device,
        share_repeated=share,
    ) as autop:
        autop.add_parameter_memory_constraint(high=param_high)
        autop.add_input_constraints([pin])
        autop.add_output_constraints([pin])
        plan = autop.optimize_placement()
    return (plan, autop) if with_planner else plan


# ------------------------------------------------------------------ scripts/plan.py
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--mesh", "8,0"], "positive"),
        (["--mesh", "8,8", "--mesh-names", "dp"], "1 name(s) for a 2-D mesh"),
        (["--flavor", "9B"], "unknown flavor"),
        (["--device", "tpu"], "unknown device"),
        (["--mesh", "a,b"], "integers"),
        (["--mesh", "auto"], "--mesh auto needs --world N"),
        (["--mesh", "auto", "--world", "8", "--mesh-names", "a"], "drop --mesh-names"),
        (["--mesh", "8", "--world", "8"], "--world goes with --mesh auto"),
        (["--mesh", "auto", "--world", "7", "--batch", "8"], "no (dp, tp) split of world 7"),
        (["--proof-limit", "0"], "--proof-limit must be positive, got 0.0"),
        (["--time-limit", "nan"], "--time-limit must be positive, got nan"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be positive, got 0"),
        (["--mesh", "8,8", "--nodes", "4"], "--mesh 8,8 has 64 ranks, but --nodes 4 x"),
        (["--mesh", "auto", "--world", "8", "--nodes", "2"], "--world 8 is not --nodes 2 x"),
        (["--mesh", "2,2", "--pp", "2"], "--pp goes with --mesh auto --world N"),
        (
            ["--mesh", "auto", "--world", "4", "--pp", "2", "--microbatch-size", "0"],
            "--microbatch-size must be a positive number or auto, got 0",
        ),
        (
            [
                "--mesh",
                "auto",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--flavor",
                "debugmodel",
                "--batch",
                "3",
            ],
            "no (dp, tp) split of world 4",
        ),
    ],
)
def test_plan_script_bad_input(argv, needle, capsys):
    assert plan_script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_plan_script_small_mesh(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "plan.py"),
        "--flavor",
        "debugmodel",
        "--layers",
        "2",
        "--vocab",
        "512",
        "--mesh",
        "2,2",
        "--mesh-names",
        "dp,tp",
        "--device",
        "h100",
        "--batch",
        "4",
        "--seq-len",
        "32",
        "--out-dir",
        str(tmp_path),
    ]
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "layers.{0..1}.attention.wq.weight" in out  # repeated layers collapsed
    for label in ("auto", "FSDP", "FSDP+TP"):
        assert any(
            line.startswith(label + " ") and "exposed comm" in line and "memory/rank" in line
            for line in out.splitlines()
        ), out
    assert "auto / best hand-written" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh_dim_names"] == ["dp", "tp"] and plan["predicted"]["peak_bytes_per_rank"] > 0
    base = json.loads((tmp_path / "baselines.json").read_text())
    assert base["FSDP+TP"]["params"]["layers.0.attention.wo.weight"] == "S(0),S(1)"
    assert base["FSDP"]["params"]["layers.0.attention.wo.weight"] == "S(0),R"
    html = (tmp_path / "plan.html").read_text()
    assert "split dim" in html and "layers.1.feed_forward.w2.weight" in html
    # the automatic plan is never predicted slower than a hand-written one (it could pick it)
    auto = plan["predicted"]["step_us"]
    assert auto <= min(b["predicted"]["step_us"] for b in base.values()) * 1.001


def test_plan_script_pipelined_search(tmp_path):
    """--pp 2 --world 4 --microbatch-size auto: both pipelined meshes planned stage by stage
    for every microbatch size that keeps both pipeline ranks busy (pp 2 x dp_shard 2: a
    local batch of 2, size 1; pp 2 x tp 2: a local batch of 4, sizes 1 and 2), priced with
    the schedule's bubble and sends; the page shows the chosen pipeline's stage plans."""
    cmd = [sys.executable, str(REPO / "scripts" / "plan.py"), "--flavor", "debugmodel"]
    cmd += ["--layers", "4", "--vocab", "512", "--mesh", "auto", "--world", "4", "--pp", "2"]
    cmd += ["--seq-len", "32", "--device", "h100", "--out-dir", str(tmp_path)]
    cmd += ["--microbatch-size", "auto"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for mesh, microbatches in [
        ("pp 2 x tp 2, 1F1B, microbatch 1", 4),
        ("pp 2 x tp 2, 1F1B, microbatch 2", 2),
        ("pp 2 x dp_shard 2, 1F1B, microbatch 1", 2),
    ]:
        expected = f"   {mesh}: 2 stages of 2/2 blocks, {microbatches} microbatches; bubble"
        assert expected in r.stdout, r.stdout
    assert "mesh search (world 4, 3 candidates): pp 2 x " in r.stdout
    search = json.loads((tmp_path / "mesh_search.json").read_text())
    assert {res["schedule"] for res in search["results"]} == {"1F1B"}
    assert sorted(res["microbatch_size"] for res in search["results"]) == [1, 1, 2]
    assert all(res["predicted"]["bubble_us"] > 0 for res in search["results"])
    html = (tmp_path / "plan.html").read_text()
    assert "<h2>stage 0 (2 blocks)</h2>" in html and "<h2>stage 1 (2 blocks)</h2>" in html


def test_plan_script_mesh_auto(tmp_path):
    """--world 4 --mesh auto: every (dp, tp) split the debug model allows is planned, the
    table says which won and why the rest lost, the files carry it, and the chosen mesh's
    plan is reported as for a given mesh."""
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "plan.py"),
        *("--flavor", "debugmodel", "--layers", "2", "--vocab", "512", "--seq-len", "32"),
        *("--world", "4", "--mesh", "auto", "--device", "h100", "--no-baselines"),
        *("--out-dir", str(tmp_path)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    search = json.loads((tmp_path / "mesh_search.json").read_text())
    meshes = {tuple(zip(c["mesh"]["names"], c["mesh"]["shape"])) for c in search["results"]}
    assert meshes == {(("tp", 4),), (("dp", 2), ("tp", 2)), (("dp", 4),)}
    steps = [c["predicted"]["step_us"] for c in search["results"]]
    best = search["results"][search["chosen"]]
    assert best["predicted"]["step_us"] == min(steps) and search["search_s"] > 0
    label = " x ".join(f"{n} {k}" for n, k in zip(best["mesh"]["names"], best["mesh"]["shape"]))
    assert f"mesh search (world 4, 3 candidates): {label}, predicted step" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh_shape"] == best["mesh"]["shape"]
    assert plan["predicted"]["step_us"] == pytest.approx(best["predicted"]["step_us"])
    html = (tmp_path / "plan.html").read_text()
    assert "<h2>mesh search</h2>" in html and html.count("<tr") >= 4


# ------------------------------------------------------------------ clustering is exact
@pytest.mark.parametrize("layers", [2, 4])
def test_clustered_equals_unclustered(layers, fake_world):
    """Sharing variables between repeated layers loses nothing on a model whose layers are
    identical: same objective (within 0.1%) with and without clustering.  With 2 layers the
    whole graph is traced and identical nodes share variables (cluster.py); with 4 the plan
    comes from a shallow trace of layers 0, 1, 3 with layer 1 weighted twice (repeat.py)."""
    over = dict(dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, n_layers=layers, max_seq_len=32)
    with fake_world(4):
        model, args = _llama("debugmodel", **over)
        a = _solve(model, args, (2, 2), ("dp", "tp"), 4, 32, share=True, param_high=None)
        model, args = _llama("debugmodel", **over)
        b = _solve(model, args, (2, 2), ("dp", "tp"), 4, 32, share=False, param_high=None)
    assert a.solver["num_vars"] < b.solver["num_vars"]
    assert bool(a.blocks) == (layers >= 4) and not b.blocks
    oa, ob = a.solver["objective"], b.solver["objective"]
    assert abs(oa - ob) <= 1e-3 * abs(ob), (oa, ob)


# ------------------------------------------------------------------ cost-model sanity (H100)
LINEAR_COL = ("wq", "wk", "wv", "w1", "w3")


def _leaf(fqn):
    return fqn.split(".")[-2]


def test_llama3_8b_on_8_ranks_is_fsdp(fake_world):
    """Llama3-8B (n_layers=2 of the 8B flavor, see module docstring), 8 H100s in one node,
    1-D mesh, FSDP-level parameter memory: every parameter sharded on the only mesh dim and
    every linear consumes its weight gathered (no TP-style activation communication), because
    parameter gathers hide behind compute while TP collectives sit on the critical path."""
    with fake_world(8):
        model, args = _llama("8B", n_layers=2, max_seq_len=8192)
        plan = _solve(model, args, (8,), ("dp",), 8, 8192, param_high=None)
    for fqn, pl in plan.params.items():
        assert pl.startswith("S("), (fqn, pl)
    p = plan.predicted
    activation_comm = p["comm_us"] - p["overlappable_comm_us"]
    assert activation_comm <= 0.01 * p["compute_us"], p


def _matmul_weights(autop, plan) -> dict[str, str]:
    """FQN -> the placement of the weight operand ([in, out] after the transpose) of the
    forward matmul that reads the parameter: the layout the matmul computes with.  It may
    differ from the stored placement; the solver prices the change like a gather."""
    tg, out = autop.tg, {}
    for fqn, node in tg.params.items():
        while True:  # through the transpose (and any cast or view) to the matmul
            user = next(u for u in node.users if u in tg.forward_nodes)
            ins = [a for a in user.all_input_nodes if a.op != "get_attr"]
            if len(ins) > 1:
                out[fqn] = plan.nodes[user.name]["ins"][ins.index(node)]
                break
            node = user
    return out


@pytest.mark.parametrize("seq", [2048, 8192])
def test_llama3_70b_on_dp_tp8_uses_tp_inside_fsdp(seq, fake_world):
    """Llama3-70B (n_layers=2 of the 70B flavor), mesh (dp=4 nodes, tp=8 GPUs per node), FSDP-
    level parameter memory, one sequence per dp rank.  Both lengths: every layer matrix is stored
    split on tp (tensor parallel inside the node) and on dp, the MLP is Megatron (w1/w3 split by
    output on tp, w2 by input), attention runs head-parallel on tp.  Gathering a 70B layer over
    InfiniBand every step is slower than TP's activation collectives over NVLink.

    At 2048 tokens the attention projections are Megatron's too (wq/wk/wv by output, wo by
    input, the normalised activations gathered once for all three).  At 8192 tokens per rank
    activation collectives cost 4x more while weight gathers (hidden behind compute) do not,
    and the solver moves wo (and the small GQA wk/wv) to token-parallel compute with the weight
    gathered, reaching head-split through all-to-alls (Ulysses-style); see benchmarks/planner.md."""
    with fake_world(32):
        model, args = _llama("70B", n_layers=2, max_seq_len=seq)
        plan, autop = _solve(
            model, args, (4, 8), ("dp", "tp"), 4, seq, param_high=None, with_planner=True
        )
    used = _matmul_weights(autop, plan)  # column-parallel: S(1) on tp; row-parallel: S(0)
    for fqn, pl in plan.params.items():
        if "layers." not in fqn or fqn.endswith("norm.weight"):
            continue
        dp, tp = pl.split(",")
        assert tp.startswith("S(") and dp.startswith("S("), (fqn, pl)
        tp_used = used[fqn].split(",")[1]
        if _leaf(fqn) in ("w1", "w3") or (seq == 2048 and _leaf(fqn) in ("wq", "wk", "wv")):
            assert tp_used == "S(1)", (fqn, used[fqn])
        if _leaf(fqn) == "w2" or (seq == 2048 and _leaf(fqn) == "wo"):
            assert tp_used == "S(0)", (fqn, used[fqn])
    attention = [d for d in plan.nodes.values() if d["op"] == "titan.sdpa.default"]
    assert len(attention) == 2
    for d in attention:  # q, k, v: [batch, heads, seq, head_dim], heads split on tp
        assert [pl.split(",")[1] for pl in d["ins"]] == ["S(1)"] * 3, d


def _saved_plan(path, mesh, names, params, step_us):
    from torchtitan.autoparallel.plan.plan import Plan

    plan = Plan(
        mesh_shape=mesh,
        mesh_dim_names=names,
        params=params,
        grads={},
        buffers={},
        inputs=[],
        outputs=[],
        nodes={},
        predicted={"step_us": step_us, "peak_bytes_per_rank": 2.0**31},
    )
    plan.save(path)
    return str(path)


def test_plan_diff_names_the_parameters_placed_apart_and_both_costs(tmp_path, capsys):
    a = _saved_plan(
        tmp_path / "a.json",
        [4],
        ["dp"],
        {"layers.0.w.weight": "S(0)", "layers.1.w.weight": "S(0)", "norm.weight": "R"},
        1500.0,
    )
    b = _saved_plan(
        tmp_path / "b.json",
        [2, 2],
        ["dp", "tp"],
        {"layers.0.w.weight": "S(0),S(1)", "layers.1.w.weight": "S(0),S(1)", "norm.weight": "R,R"},
        1250.0,
    )
    assert plan_script.main(["--diff", a, b]) == 0
    out = capsys.readouterr().out
    assert "mesh: a.json dp=4 | b.json dp=2 x tp=2" in out
    assert "predicted step ms" in out and "1.500" in out and "1.250" in out
    assert "peak memory GiB/rank" in out and "2.000" in out
    assert "2 of 2 parameter patterns placed apart:" in out
    assert "layers.*.w.weight\n    a.json: dp:S(0)\n    b.json: dp:S(0), tp:S(1)" in out
    assert plan_script.main(["--diff", a, a]) == 0
    assert "every parameter is placed alike (2 patterns)" in capsys.readouterr().out


def test_plan_diff_of_a_missing_or_foreign_file_is_one_line(tmp_path, capsys):
    a = _saved_plan(tmp_path / "a.json", [4], ["dp"], {"w": "S(0)"}, 1.0)
    assert plan_script.main(["--diff", a, str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --diff: no plan file '{tmp_path}/nope.json'"
    (tmp_path / "x.json").write_text("{}")
    assert plan_script.main(["--diff", a, str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.startswith("error: plan format version 1")
