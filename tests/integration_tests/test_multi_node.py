"""Two "nodes" on one machine: two launchers (`python -m torchtitan.launch`, what
`run_train.sh` runs with NNODES/NODE_RANK/RDZV_ENDPOINT) of 2 CPU ranks each meet at a c10d
rendezvous on 127.0.0.1 and train as one 4-rank job."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from harness import (
    error_lines,
    launch_nodes,
    launch_one,
    launcher_env,
    run_launcher,
)

from torchtitan.tools.local_processes import free_port
from torchtitan.tools.loss_compare import REPO, assert_losses_close, deterministic_args

ARGS = ["--training.steps", "4", "--training.seq_len", "64", *deterministic_args(seed=7)]


def tb_losses(dump: Path) -> dict[int, float]:
    from torchtitan.tools.loss_compare import read_tb_losses

    return read_tb_losses(dump / "tb")


@pytest.mark.parametrize("spec", ["llama3", "llama3_auto_parallel"])
def test_two_nodes_of_two_ranks_train_as_one_node_of_four(spec, tmp_path):
    args = [*ARGS, "--model.name", spec]
    one = launch_one(tmp_path / "one", args)
    assert one.returncode == 0, one.stderr[-3000:]
    nodes = launch_nodes(tmp_path / "two", args)
    for proc in nodes:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_close(tb_losses(tmp_path / "two"), tb_losses(tmp_path / "one"), rtol=1e-6)
    assert len(tb_losses(tmp_path / "one")) == 4
    if spec == "llama3_auto_parallel":  # the planner priced the link each dim really uses
        assert "nodes of 4 ranks: dp_shard intra-node" in one.stderr
        assert any("nodes of 2 ranks: dp_shard inter-node" in p.stderr for p in nodes)
    # each node keeps its own ranks' output and torchrun's log; lines name global ranks
    logs = tmp_path / "two" / "logs"
    for r in range(2):
        assert (logs / f"node{r}" / "launcher.log").is_file()
        assert len(list((logs / f"node{r}" / "ranks").rglob("stderr.log"))) == 2
    shown = {ln.split("]")[0] for p in nodes for ln in p.stderr.splitlines() if ln[:5] == "[rank"}
    # local rank 0 of each node is shown (LOG_RANK), as its global rank: two different ones
    assert len(shown) == 2 and shown <= {"[rank0", "[rank1", "[rank2", "[rank3"}, shown


def test_a_rank_failing_on_the_other_node_is_one_line_on_every_node(tmp_path):
    args = [
        *ARGS,
        "--experimental.custom_import",
        "failing_specs",
        "--model.name",
        "fails_on_rank3",
    ]
    nodes = launch_nodes(tmp_path, args)
    expected = (
        f"error: rank 3 failed: RuntimeError: boom on rank 3 "
        f"(traceback: {tmp_path / 'logs' / 'error_rank3.log'})"
    )
    for proc in nodes:
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert error_lines(proc) == [expected]
        assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "node, line",
    [
        (["--nnodes", "2"], "NNODES 2 needs RDZV_ENDPOINT (--rdzv-endpoint host:port)"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
            "NODE_RANK (--node-rank) 2 is not in 0..1 for NNODES 2",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "node0"],
            "RDZV_ENDPOINT (--rdzv-endpoint) 'node0' is not host:port",
        ),
    ],
)
def test_a_bad_node_setting_is_one_line_before_any_rank_starts(node, line, tmp_path):
    proc = run_launcher(tmp_path, 2, node, ARGS, timeout=120)
    assert proc.returncode == 2
    (error,) = error_lines(proc)
    assert error.startswith("error: " + line), error
    assert not (tmp_path / "logs").exists()


FAKE_SRUN = """#!/usr/bin/env bash
# srun's part here: one task per node of the allocation, each with its SLURM_NODEID; as
# with --kill-on-bad-exit, the first task to fail ends the others
[[ "$1" == --kill-on-bad-exit=1 ]] && shift
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
for _ in "${pids[@]}"; do
  wait -n && continue
  rc=$?; kill "${pids[@]}" 2>/dev/null; wait; exit $rc
done
"""


def test_the_slurm_script_starts_one_launcher_per_node(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # the allocation's first node
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = launcher_env(
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        NGPU="2",
        RDZV_PORT=str(free_port()),
    )
    proc = subprocess.run(
        [
            "bash",
            "scripts/multinode_slurm.sh",
            "--job.dump_folder",
            str(tmp_path / "dump"),
            "--checkpoint.enable",  # the script restarts a failed job once by default
            *ARGS,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(tb_losses(tmp_path / "dump")) == 4
    for r in range(2):
        log = (tmp_path / "dump" / "logs" / f"node{r}" / "launcher.log").read_text()
        assert "4242" in log  # the rendezvous id is the SLURM job's
