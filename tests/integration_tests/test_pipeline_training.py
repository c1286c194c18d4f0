"""Pipeline parallelism (`--parallelism.pipeline_parallel_degree`) for llama3 on CPU ranks,
hand-written and with each stage planned (llama3_auto_parallel): every parameter gradient
at every step equals one process's (pipeline_grads.py under each schedule,
planned_pipeline_grads.py on pp2 x dp2 and pp2 x tp2), every mesh and schedule reproduces
the 1-rank reference curve (global batch 4, rtol 1e-4), a run stopped at step 5 resumes
from its checkpoint bitwise, and bad pipeline settings are one line before any rank
starts."""

from __future__ import annotations

import shutil

import pytest
from harness import REPO, run_check_script, run_training

from torchtitan.tools.loss_compare import assert_losses_close, preflight, read_golden

GOLDEN = read_golden(REPO / "tests/assets/losses/llama3_cpu_1rank.txt")
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def _pp(
    pp: int,
    schedule: str,
    shard: int = 1,
    tp: int = 1,
    local_batch: int = 4,
    model: str = "llama3",
) -> list[str]:
    return [
        "--model.name",
        model,
        "--parallelism.pipeline_parallel_degree",
        str(pp),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--training.local_batch_size",
        str(local_batch),
    ]


AUTO = "llama3_auto_parallel"
PLANNED_MESHES = ["pp2dp2", "pp2tp2", "pp2dp2zbv"]
PP2_DP2 = _pp(2, "1F1B", shard=2, local_batch=2)
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]


def test_every_gradient_at_every_step_equals_one_process_under_each_schedule():
    script = REPO / "tests/integration_tests/pipeline_grads.py"
    res = run_check_script(script, 2, SCHEDULES, timeout=600)
    passed = {
        line.split(" rank ")[0] for line in res.stdout.splitlines() if line.startswith("PASS")
    }
    assert res.returncode == 0 and passed == {f"PASS {s}" for s in SCHEDULES}, (
        res.stdout[-3000:] + res.stderr[-3000:]
    )


@pytest.fixture(scope="module")
def pp2_dp2_run(tmp_path_factory):
    """pp 2 x FSDP 2 with 1F1B, checkpointing at steps 5 and 10."""
    return run_training(4, [*PP2_DP2, *CKPT], tmp_path_factory.mktemp("pp2_dp2")).check()


def test_pp2_dp2_matches_1rank(pp2_dp2_run):
    assert "pipeline: 1F1B, 2 stages of 3/3 blocks, 2 microbatches" in pp2_dp2_run.output
    assert_losses_close(pp2_dp2_run.losses(), GOLDEN, rtol=1e-4, what="pp2 x dp2 1F1B vs 1 rank")


@pytest.mark.parametrize(
    "nproc, args, stages",
    [
        (4, _pp(2, "Interleaved1F1B", tp=2), "4 stages of 1/2/2/1 blocks"),
        (4, _pp(4, "GPipe"), "4 stages of 1/2/2/1 blocks"),
    ],
    ids=["pp2_tp2_interleaved", "pp4_gpipe"],
)
def test_pipelined_meshes_and_schedules_match_1rank(nproc, args, stages, train_on_ranks):
    run = train_on_ranks(nproc, args)
    assert stages in run.output
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what=" ".join(args[2:]))


FULL_AC = ["--activation_checkpoint.mode", "full"]
EVERY_2ND_AC = ["--activation_checkpoint.mode", "selective"]
EVERY_2ND_AC += ["--activation_checkpoint.selective_ac_option", "2"]


@pytest.mark.parametrize(
    "args, stages, recompute",
    [
        (
            [*_pp(2, "1F1B", shard=2, local_batch=2, model=AUTO), *FULL_AC],
            "2 stages of 3/3 blocks",
            "recompute: layers#0-2 full",
        ),
        (_pp(2, "Interleaved1F1B", tp=2, model=AUTO), "4 stages of 1/2/2/1 blocks", None),
        (
            [*_pp(4, "GPipe", model=AUTO), *EVERY_2ND_AC],
            "4 stages of 1/2/2/1 blocks",
            "recompute: layers#0 full, layers#1 none",
        ),
    ],
    ids=["pp2_dp2_1f1b_full_ac", "pp2_tp2_interleaved", "pp4_gpipe_every_2nd_block_ac"],
)
def test_planned_stages_match_1rank(args, stages, recompute, train_on_ranks):
    """The planner plans each stage on the mesh's other dims (pp4: a mesh of one); a stage
    of fewer blocks than a stack the planner finds by itself still recomputes its blocks
    as asked (every 2nd: counted within the stage, as the hand-written path counts)."""
    run = train_on_ranks(4, args)
    assert stages in run.output
    if recompute is not None:
        assert recompute in run.output, run.output[-3000:]
    assert "cut by predicted time per microbatch" in run.output
    assert "auto-parallel planning of pipeline stage 0 (blocks 0-" in run.output
    assert "microbatches in flight) took" in run.output
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what="planned " + " ".join(args[2:]))


def test_a_searched_pipelined_mesh_and_schedule_match_1rank(train_on_ranks):
    """pp 2 with tp, the schedule and the microbatch size left to the mesh search (a global
    batch of 4): every pipelined candidate is planned stage by stage for each microbatch
    size that keeps both pipeline ranks busy, and priced with its schedule's bubble and
    sends; the chosen mesh, schedule and microbatch size train."""
    microbatch = ["--parallelism.pipeline_parallel_microbatch_size", "auto"]
    run = train_on_ranks(
        4, [*_pp(2, "auto", shard=-1, tp="auto", local_batch=1, model=AUTO), *microbatch]
    )
    for mesh, sizes in (("pp 2 x tp 2", (1, 2)), ("pp 2 x dp_shard 2", (1,))):
        for size in sizes:
            one = f"   {mesh}, 1F1B, microbatch {size}: 2 stages of 3/3 blocks"
            two = f"   {mesh}, Interleaved1F1B, microbatch {size}: 4 stages of 1/2/2/1 blocks"
            assert one in run.output and two in run.output, (mesh, size)
    assert "mesh search (world 4, 6 candidates)" in run.output
    chosen = run.output.split("mesh search (world 4, 6 candidates): ")[1]
    chosen = chosen.split(", predicted step")[0]
    assert chosen.startswith("pp 2 x ")
    _mesh, schedule, size = chosen.split(", ")
    local = 4 if chosen.startswith("pp 2 x tp 2") else 2
    microbatches = local // int(size.removeprefix("microbatch "))
    assert f"pipeline: {schedule}, " in run.output, chosen
    assert f"blocks, {microbatches} microbatches" in run.output, chosen
    assert_losses_close(run.losses(), GOLDEN, rtol=1e-4, what="searched pp 2 mesh")


@pytest.mark.parametrize(
    "meshes", [PLANNED_MESHES, ["pp2tp2", "compiled"]], ids=["eager", "compiled"]
)
def test_planned_stages_give_every_gradient_at_every_step_of_one_process(meshes, tmp_path):
    script = REPO / "tests/integration_tests/planned_pipeline_grads.py"
    res = run_check_script(script, 4, [str(tmp_path), *meshes], timeout=900)
    mode = "compiled" if "compiled" in meshes else "eager"
    passed = [line for line in res.stdout.splitlines() if line.startswith("PASS")]
    expected = {f"PASS {m} rank {r}" for m in meshes if m != "compiled" for r in range(4)}
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert {line.split(": ")[0] for line in passed} == expected, res.stdout[-3000:]
    assert all(line.endswith(mode) for line in passed), passed


def test_a_pipelined_run_resumes_bitwise(pp2_dp2_run, tmp_path):
    """From the uninterrupted run's step-5 checkpoint (stopping a run there is tested in
    test_checkpoint_resume.py), steps 6-10 are bitwise the uninterrupted run's."""
    step5 = pp2_dp2_run.dump_folder / "checkpoint" / "step-5"
    shutil.copytree(step5, tmp_path / "checkpoint" / "step-5")
    resumed = run_training(4, [*PP2_DP2, *CKPT], tmp_path).check()
    assert "loaded checkpoint step-5" in resumed.output
    full, losses = pp2_dp2_run.losses(), resumed.losses()
    assert {s: losses[s] for s in range(6, 11)} == {s: full[s] for s in range(6, 11)}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--parallelism.pipeline_parallel_schedule", "Zigzag"],
            "--parallelism.pipeline_parallel_schedule 'Zigzag': no such schedule in "
            "torch.distributed.pipelining; choose one of GPipe, 1F1B, Interleaved1F1B, "
            "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble",
        ),
        (
            ["--parallelism.pipeline_parallel_microbatch_size", "3"],
            "--parallelism.pipeline_parallel_microbatch_size 3: must divide the local batch size 4",
        ),
        (
            ["--parallelism.pipeline_parallel_layers_per_stage", "4"],
            "--parallelism.pipeline_parallel_layers_per_stage 4: must divide the 6 blocks of "
            "llama3 debugmodel",
        ),
        (
            ["--parallelism.pipeline_parallel_split_points", "layers.3"],
            "--parallelism.pipeline_parallel_split_points 'layers.3': give the positions of "
            "the blocks that start a stage as integers, comma-separated (e.g. 2,4)",
        ),
        (
            ["--model.name", "deepseek_v3"],
            "--parallelism.pipeline_parallel_degree 2: deepseek_v3 cannot be "
            "pipelined (its spec names no pipeline split); use llama3 or llama3_auto_parallel, "
            "or pipeline_parallel_degree 1",
        ),
        (
            ["--parallelism.pipeline_parallel_schedule", "auto"],
            "--parallelism.pipeline_parallel_schedule auto: the mesh search chooses it, and it "
            "runs when a degree is auto (e.g. --parallelism.pipeline_parallel_degree auto); "
            "give one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
            "ZBVZeroBubble",
        ),
        (
            ["--parallelism.pipeline_parallel_microbatch_size", "auto"],
            "--parallelism.pipeline_parallel_microbatch_size auto: the mesh search chooses "
            "it, and it runs when a degree is auto (e.g. --parallelism.pipeline_parallel_degree"
            " auto); give a number of sequences",
        ),
    ],
    ids=[
        "schedule",
        "microbatch",
        "layers",
        "split-points",
        "no-split",
        "schedule-auto",
        "microbatch-auto",
    ],
)
def test_bad_pipeline_settings_are_one_line_before_ranks_start(args, message):
    given = dict(zip(args[::2], args[1::2]))
    base = _pp(2, given.pop("--parallelism.pipeline_parallel_schedule", "1F1B"))
    if "--model.name" in given:
        base[1] = given.pop("--model.name")
    extra = [x for option, value in given.items() for x in (option, value)]
    assert preflight(2, [*base, *extra]) == message


def test_hand_written_zero_bubble_with_data_parallelism_is_refused():
    """Hand-written FSDP stages under a zero-bubble schedule train away from one rank's
    losses (torch 2.13); refused before any rank starts, the planned spec accepted."""
    args = _pp(2, "ZBVZeroBubble", shard=2, local_batch=2)
    assert preflight(4, args) == (
        "--parallelism.pipeline_parallel_schedule ZBVZeroBubble with data parallelism "
        "(degree 2): the FSDP stages' gradients differ from one process's under torch's "
        "zero-bubble weight step; use 1F1B or Interleaved1F1B, or --model.name "
        "llama3_auto_parallel (its stages are exact under it)"
    )
    assert preflight(4, _pp(2, "ZBVZeroBubble", shard=2, local_batch=2, model=AUTO)) is None
