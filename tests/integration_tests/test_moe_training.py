"""The MoE specs end to end on 4 CPU ranks: hand-written FSDP + EP (+ TP) and the planner.

Every run sees the same global batch (4 sequences of 64 tokens) as a 1-rank `deepseek_v3`
run, so each must reproduce its losses within rtol 1e-4.  The planner's run with the
experts split over 2 ranks also checkpoints at step 5; stopped there and restarted it must
reproduce steps 6-10 bitwise, and resumed on 2 ranks (resharded) within rtol 1e-4.
"""

from __future__ import annotations

import json
import shutil

import pytest
from harness import REPO, run_training

from torchtitan.tools.loss_compare import assert_losses_close

MOE_TOML = REPO / "torchtitan/models/deepseek_v3/train_configs/debug_model.toml"
AUTO = ["--model.name", "deepseek_v3_auto_parallel"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def _batch(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(4 // dp)]


def _ep(n: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(n)]


def _tp(n: int) -> list[str]:
    return ["--parallelism.tensor_parallel_degree", str(n)]


BIAS = ["--model.flavor", "debugmodel_bias"]  # aux-loss-free balancing: the bias is state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_1rank")
    return run_training(1, _batch(1), folder, config_file=MOE_TOML).check().losses()


@pytest.fixture(scope="module")
def bias_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_bias_1rank")
    return run_training(1, [*BIAS, *_batch(1)], folder, config_file=MOE_TOML).check().losses()


@pytest.mark.parametrize("ep,tp", [(4, 1), (2, 2)])
def test_hand_written_moe_matches_1rank(ep, tp, reference, tmp_path):
    args = [*_batch(4 // tp), *_ep(ep), *_tp(tp)]
    run = run_training(4, args, tmp_path, config_file=MOE_TOML).check()
    assert f"applied expert parallelism over {ep} ranks" in run.output
    what = f"deepseek_v3 ep{ep} tp{tp} vs 1 rank"
    assert_losses_close(run.losses(), reference, rtol=1e-4, what=what)


def test_auto_moe_with_expert_parallelism_matches_1rank_and_resumes_bitwise(reference, tmp_path):
    args = [*AUTO, *_batch(4), *_ep(2), *CKPT]
    full = run_training(4, args, tmp_path / "full", config_file=MOE_TOML).check()
    (plan_file,) = (full.dump_folder / "plans").glob("*.json")
    plan = json.loads(plan_file.read_text())
    experts = [d for n, d in plan["nodes"].items() if d["op"].startswith("titan.routed_experts")]
    assert experts and all(d["ins"][-1].split(",")[1] == "S(0)" for d in experts)  # w3 on ep
    losses = full.losses()
    assert_losses_close(
        losses, reference, rtol=1e-4, what="deepseek_v3_auto_parallel ep2 vs 1 rank"
    )
    assert losses[10] < losses[1]
    # resumed from the run's step-5 checkpoint (stopping a run there is tested in
    # test_checkpoint_resume.py)
    folder = tmp_path / "resumed"
    shutil.copytree(full.dump_folder / "checkpoint" / "step-5", folder / "checkpoint" / "step-5")
    resumed = run_training(4, args, folder, config_file=MOE_TOML).check()
    assert "loaded checkpoint step-5" in resumed.output
    again = resumed.losses()
    assert {s: again[s] for s in range(6, 11)} == {s: losses[s] for s in range(6, 11)}
    # the experts' checkpoint from 4 ranks (dp_shard 4, experts on ep 2) continues on 2
    # (dp_shard 2, ep 2): the expert weights are resharded along with everything else
    two = tmp_path / "two_ranks"
    (two / "checkpoint").mkdir(parents=True)
    shutil.copytree(folder / "checkpoint" / "step-5", two / "checkpoint" / "step-5")
    moved = run_training(2, [*AUTO, *_batch(2), *_ep(2), *CKPT], two, config_file=MOE_TOML)
    assert "loaded checkpoint step-5" in moved.check().output
    assert_losses_close(
        moved.losses(),
        {s: reference[s] for s in range(6, 11)},
        rtol=1e-4,
        what="deepseek_v3_auto_parallel resumed from 4 ranks on 2",
    )
