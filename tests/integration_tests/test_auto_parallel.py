"""llama3_auto_parallel end to end on 4 CPU ranks: losses, checkpoint resume, hand-over.

Every run sees the same global batch (4) as the 1-rank llama3 reference, whose curve is
the golden file (test_loss_curves.py checks a fresh 1-rank run against it), so each mesh
must reproduce it within rtol 1e-4.  The dp2×tp2 run also saves checkpoints at steps 5
and 10; a run stopped at 5 and restarted must reproduce steps 6–10 bitwise, and the hand-
written llama3 dp2×tp2 must continue from the auto-parallel step-5 checkpoint within 1e-4.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from harness import REPO, run_training

from torchtitan.tools.loss_compare import assert_losses_close, preflight, read_golden

GOLDEN = read_golden(REPO / "tests/assets/losses/llama3_cpu_1rank.txt")
AUTO = ["--model.name", "llama3_auto_parallel"]
AP_SECTION = ["--job.custom_config_module", "torchtitan.experiments.auto_parallel.job_config"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
MESHES = {
    "dp4": ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "1"],
    "tp4": ["--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "4"],
    "dp2_tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"],
}


@pytest.fixture(scope="module")
def dp2_tp2_run(tmp_path_factory):
    """The uninterrupted auto-parallel dp2×tp2 run, checkpointing at 5 and 10."""
    folder = tmp_path_factory.mktemp("auto_dp2_tp2")
    return run_training(4, [*AUTO, *MESHES["dp2_tp2"], *CKPT], folder).check()


@pytest.mark.parametrize("mesh", ["dp4", "tp4"])
def test_auto_parallel_matches_1rank(mesh, train_on_ranks):
    run = train_on_ranks(4, [*AUTO, *MESHES[mesh]])
    assert "auto-parallel planning took" in run.output
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what=f"auto {mesh} vs 1 rank")


def test_auto_parallel_dp2_tp2_matches_1rank_and_learns(dp2_tp2_run):
    losses = dp2_tp2_run.losses()
    assert_losses_close(losses, GOLDEN, rtol=1e-4, what="auto dp2xtp2 vs 1 rank")
    assert losses[10] < losses[1]


def test_resume_is_bitwise_and_plan_is_reused(dp2_tp2_run, tmp_path, train_on_ranks):
    full = dp2_tp2_run.losses()
    shutil.copytree(dp2_tp2_run.dump_folder / "plans", tmp_path / "plans")
    args = [*AUTO, *MESHES["dp2_tp2"], *CKPT]
    first = train_on_ranks(4, [*args, "--training.stop_at_step", "5"])
    assert "reusing cached plan" in first.output
    resumed = train_on_ranks(4, args)
    assert "loaded checkpoint step-5" in resumed.output
    losses = resumed.losses()
    assert {s: losses[s] for s in range(6, 11)} == {s: full[s] for s in range(6, 11)}


def test_manual_llama3_continues_from_auto_checkpoint(dp2_tp2_run, tmp_path):
    shutil.copytree(
        dp2_tp2_run.dump_folder / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5"
    )
    manual = run_training(
        4, ["--model.name", "llama3", *MESHES["dp2_tp2"], *CKPT], tmp_path
    ).check()
    assert "loaded checkpoint step-5" in manual.output
    full = dp2_tp2_run.losses()
    losses = manual.losses()
    assert_losses_close(
        {s: losses[s] for s in range(6, 11)},
        {s: full[s] for s in range(6, 11)},
        rtol=1e-4,
        what="manual llama3 from auto checkpoint vs auto",
    )


COLLECTIVE_CALL = r"_c10d_functional\.{}(?:_out)?\.default\("
COMMS_KNOBS = [
    "--compile.bucket_all_gathers_fx",
    "all",
    "--compile.bucket_reduce_scatters_fx",
    "all",
    "--compile.reorder_for_compute_comm_overlap",
    "--compile.reorder_for_compute_comm_overlap_passes",
    "sink_waits_iterative",
]


def _collective_calls(output: str, op: str) -> int:
    """Calls of a functional collective in the inductor output code the ranks logged."""
    return len(re.findall(COLLECTIVE_CALL.format(op), output))


def _lowered_collectives(output: str, op: str) -> int:
    """The same count in the lowered graphs handed to inductor, as the ranks logged them
    (what inductor's output code holds without the knobs: 48 all-gathers on dp4)."""
    lines = re.findall(r"lowered graphs \(to compile\): collectives (.*)", output)
    return sum(int(n) for line in lines for n in re.findall(rf"(\d+) {op}", line))


def test_compiled_with_comms_knobs_has_fewer_collectives_and_same_loss(tmp_path):
    """Compile the auto-parallel dp2 module (FSDP-like: parameters split 2 ways; the two
    ranks' graphs are the same code, compiled by one rank, found in inductor's cache by the
    other) with the bucketing/reordering knobs: inductor's output code holds fewer
    all-gathers than the lowered graphs it was given, and the run still reproduces the
    1-rank curve (global batch 4 as there).

    TORCH_LOGS=output_code prints each rank's generated code (compiled, or read from the
    cache, which keys it by the knobs too), where the collectives are counted.
    """
    fsdp = [*AP_SECTION, "--autoparallel.max_parameter_fraction", "fsdp"]  # gathers to bucket
    dp2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
    args = [*AUTO, *dp2, *fsdp, "--compile.enable"]
    tuned = run_training(
        2,
        [*args, *COMMS_KNOBS, "--training.steps", "4"],
        tmp_path,
        env={"TORCH_LOGS": "output_code"},
    ).check()
    given = _lowered_collectives(tuned.output, "all_gather_into_tensor")
    compiled = _collective_calls(tuned.output, "all_gather_into_tensor")
    assert given > 0 and 0 < compiled < given, (compiled, given)
    assert "inductor comms settings" in tuned.output
    # 4 steps (compile dominates the cost): the LR schedule of a 4-step run differs from
    # the 10-step golden run from step 3 on, which first shows in step 4's loss.
    losses = tuned.losses()
    assert_losses_close(
        {s: losses[s] for s in (1, 2, 3)},
        {s: GOLDEN[s] for s in (1, 2, 3)},
        rtol=1e-4,
        what="compiled auto dp2 + knobs vs 1 rank",
    )


def test_a_compiled_2d_plan_runs_again_from_the_compile_cache(tmp_path):
    """The planned dp2×tp2 job compiled (model and loss), launched twice on one compile
    cache, collecting garbage every step: the second launch reads what the first compiled.
    The planner's graphs name their groups by role and are shared by the ranks; the loss,
    given the tensor-parallel logits, names this rank's groups (c10d's names, '3' on ranks
    0-1 and '4' on ranks 2-3), so each rank keeps its own (a rank that read another's
    failed: "Could not resolve the process group registered under the name 4").  Both
    launches reproduce the 1-rank curve (4 steps: see the test above)."""
    args = [*AUTO, *MESHES["dp2_tp2"], "--compile.enable", "--training.steps", "4"]
    args += ["--training.gc_freq", "1"]
    for launch in ("first", "second"):
        losses = run_training(4, args, tmp_path / launch).check().losses()
        assert_losses_close(
            {s: losses[s] for s in (1, 2, 3)},
            {s: GOLDEN[s] for s in (1, 2, 3)},
            rtol=1e-4,
            what=f"compiled auto dp2 x tp2, {launch} launch, vs 1 rank",
        )


def test_auto_dp4_issues_no_more_collectives_than_ddp(tmp_path):
    """One step after two warm-up steps, counted with torch.profiler's gloo events.  With
    memory to spare (the default budget: a rank's share of the RAM) the plan replicates the
    parameters, DDP-like: the step's only collectives are all-reduces, and its gradient
    buckets issue no more than DDP's (which issues fewer than FSDP2)."""
    ddp = ["--parallelism.data_parallel_replicate_degree", "4"]
    ddp += ["--parallelism.data_parallel_shard_degree", "1"]
    counts, outputs = {}, {}
    for label, name, mesh in (
        ("fsdp", "llama3", MESHES["dp4"]),
        ("ddp", "llama3", [*ddp, "--training.local_batch_size", "1"]),
        ("planned", "llama3_auto_parallel", MESHES["dp4"]),
    ):
        run = run_training(
            4,
            ["--model.name", name, *mesh, "--training.steps", "3"]
            + ["--metrics.count_collectives_step", "3"],
            tmp_path / label,
        ).check()
        counts[label] = int(re.search(r"step 3: (\d+) collectives", run.output).group(1))
        outputs[label] = run.output
    assert 0 < counts["planned"] <= counts["ddp"] < counts["fsdp"], counts
    # its gradients in DDP-sized buckets: the whole debug model's in one all-reduce
    assert re.search(r"step 3: \d+ collectives \(all_reduce \d+\)", outputs["planned"])
    assert "lowered graphs: collectives forward none, backward 1 all_reduce" in outputs["planned"]
    # reduced where its gradients were packed, as DDP reduces its bucket (no copy of it)
    assert "sums and 1 all-reduces written into an operand" in outputs["planned"]


def test_mesh_search_picks_a_mesh_matches_1rank_and_caches_every_candidate(train_on_ranks):
    """tp auto on 4 ranks: every split of the world is planned (tp 4, dp 2 x tp 2, dp 4) and
    cached, the global batch stays the 1-rank reference's 4, the losses match it, and the
    chosen mesh's plan is the search's own, applied without solving again (not even a
    lookup in the plan cache); the resolved config is logged next to the typed one."""
    run = train_on_ranks(
        4,
        [*AUTO, "--parallelism.tensor_parallel_degree", "auto", "--training.local_batch_size", "1"],
    )
    assert "mesh search (world 4, 3 candidates)" in run.output
    chosen = re.search(r"mesh search chose (.*); global batch 4, local batch (\d+)", run.output)
    assert chosen, run.output[-3000:]
    degrees = dict(
        (option, int(value)) for option, value in re.findall(r"(\w+_degree) (\d+)", chosen.group(1))
    )
    dp = degrees["data_parallel_replicate_degree"] * degrees["data_parallel_shard_degree"]
    assert dp * degrees["tensor_parallel_degree"] == 4 and int(chosen.group(2)) == 4 // dp
    assert len(list((run.dump_folder / "plans").glob("*.json"))) == 3
    assert "auto-parallel: applied the plan the mesh search made for this mesh" in run.output
    assert "reusing cached plan" not in run.output and "planning took" not in run.output
    assert re.search(
        r"resolved config: replicate 1 x shard \d x tp \d \(mesh search\), local batch \d, "
        r"global batch 4, grad accumulation 1 \(as typed: replicate 1 x shard -1 x tp auto, "
        r"local batch 1, global batch -1\)",
        run.output,
    )
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what="auto mesh vs 1 rank")


W1_PATTERN = "layers.*.feed_forward.w1.weight"
PLAN_FILE = "--autoparallel.plan_file"


def _other_full_split(placement: str) -> str:
    """A placement other than `placement` that also splits a 2-D weight 4 ways on (2, 2)."""
    return next(p for p in ("S(0),S(1)", "S(1),S(0)", "S(0),S(0)") if p != placement)


def test_a_pin_from_the_config_is_planned_and_trains_as_one_rank(dp2_tp2_run, train_on_ranks):
    (plan_file,) = (dp2_tp2_run.dump_folder / "plans").glob("*.json")
    name = "layers.0.feed_forward.w1.weight"
    pin = _other_full_split(json.loads(plan_file.read_text())["params"][name])
    run = train_on_ranks(
        4,
        [*AUTO, *MESHES["dp2_tp2"], *AP_SECTION, "--autoparallel.pin", f"{W1_PATTERN}={pin}"],
    )
    (pinned_file,) = (run.dump_folder / "plans").glob("*.json")
    params = json.loads(pinned_file.read_text())["params"]
    assert {params[n] for n in params if n.endswith("feed_forward.w1.weight")} == {pin}
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what=f"auto dp2xtp2 with w1 at {pin}")


def test_a_pin_that_cannot_apply_is_one_line_before_ranks_start():
    why = preflight(
        4,
        [
            *AUTO,
            *MESHES["dp2_tp2"],
            *AP_SECTION,
            "--autoparallel.pin",
            "layers.*.mlp.w1.weight=S(0),R",
        ],
    )
    assert why == (
        "--autoparallel.pin 'layers.*.mlp.w1.weight=S(0),R': no parameter matches "
        "'layers.*.mlp.w1.weight' (did you mean 'layers.0.feed_forward.w1.weight'?)"
    )


W2 = "feed_forward.w2.weight"


def test_an_edited_plan_file_trains_as_one_rank(dp2_tp2_run, tmp_path, train_on_ranks):
    """A run's cached plan with every block's w2 moved to another split: the trainer solves
    again around the file's parameter placements, keeps them all, and matches one rank."""
    (cached,) = (dp2_tp2_run.dump_folder / "plans").glob("*.json")
    plan = json.loads(cached.read_text())
    moved = _other_full_split(plan["params"][f"layers.0.{W2}"])
    w2s = [n for n in plan["params"] if n.endswith(W2)]
    plan["params"].update(dict.fromkeys(w2s, moved))
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    run = train_on_ranks(4, [*AUTO, *MESHES["dp2_tp2"], *AP_SECTION, PLAN_FILE, str(edited)])
    assert f"edited.json: {len(w2s)} parameter placement(s) edited" in run.output
    (solved,) = (run.dump_folder / "plans").glob("*.json")
    assert json.loads(solved.read_text())["params"] == plan["params"]
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what=f"auto dp2xtp2, plan file w2 {moved}")


def test_a_plan_file_for_another_mesh_is_one_line_before_ranks_start(dp2_tp2_run):
    (cached,) = (dp2_tp2_run.dump_folder / "plans").glob("*.json")
    why = preflight(4, [*AUTO, *MESHES["dp4"], *AP_SECTION, PLAN_FILE, str(cached)])
    assert why == (
        f"{PLAN_FILE} {str(cached)!r} does not fit this job: made for mesh [2, 2] "
        "['dp_shard', 'tp'], not [4] ['dp_shard']; plan again for it (scripts/plan.py, or a "
        "run without a plan file) or fix the file"
    )
