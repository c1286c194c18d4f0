#!/usr/bin/env bash
# Train on several nodes under SLURM: one launcher per node (run_train.sh), meeting at a
# c10d rendezvous on the job's first node.  Submit from the repository root:
#
#   sbatch --nodes 2 scripts/multinode_slurm.sh --model.name llama3_auto_parallel \
#       --checkpoint.enable
#
# Every argument is a config override, as for run_train.sh.  The environment may set
# NGPU (ranks per node; default: the node's GPUs), CONFIG_FILE, MAX_RESTARTS (default 1
# here: a failed rank restarts the job once from the newest intact checkpoint, which needs
# --checkpoint.enable) and RDZV_PORT (default 29500).  SLURM sends SIGTERM 120 s before the
# time limit (--signal below): with --checkpoint.enable every rank finishes its step, a
# checkpoint is written and the job ends with exit code 0; submitting it again resumes.
# The dump folder must be on a filesystem every node sees (checkpoints, plans, error
# reports); each node's rank output is under {dump_folder}/logs/node<N>/.
#
#SBATCH --job-name=torchtitan
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=TERM@120
#SBATCH --output=slurm-%j.out
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NNODES=$SLURM_NNODES
export RDZV_ENDPOINT="$head_node:${RDZV_PORT:-29500}"
export RDZV_ID=$SLURM_JOB_ID
export MAX_RESTARTS=${MAX_RESTARTS:-1}

# One task per node; each gets its node index from SLURM.
srun --kill-on-bad-exit=1 bash -c 'NODE_RANK=$SLURM_NODEID exec ./run_train.sh "$@"' \
  run_train "$@"
