#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU         ranks to start on this node (default: all visible GPUs; without GPUs,
#                4 CPU ranks on gloo)
#   NNODES       nodes in the job (default 1); every node runs this script with the same
#                options, NGPU and RDZV_ENDPOINT, and its own NODE_RANK
#   NODE_RANK    this node's index, 0..NNODES-1 (default 0)
#   RDZV_ENDPOINT host:port where the nodes meet (torchrun's c10d rendezvous; any node's
#                address, e.g. node0:29500); required when NNODES > 1
#   RDZV_ID      the job's rendezvous id, the same on every node (default torchtitan)
#   MAX_RESTARTS restart all ranks this many times after a failure; each restart resumes
#                from the newest intact checkpoint (default 0)
#   CONFIG_FILE  TOML config (default: the debug Llama 3; a --job.config_file option wins)
#   LOG_RANK     comma-separated ranks whose output is shown (default 0)
# Every argument is passed through as a config override, e.g.
#   ./run_train.sh --model.name llama3_auto_parallel --parallelism.tensor_parallel_degree 4
# The configuration is checked before any rank starts; a bad input or a failing rank is
# one `error:` line and exit code 2 (details under {dump_folder}/logs/).
# Relative paths among the options (and CONFIG_FILE) mean the directory this is run from;
# those in a TOML file mean the repository.
set -euo pipefail
user_cwd=$PWD
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
py=.venv/bin/python

if [[ -z "${NGPU:-}" ]]; then
  NGPU=$($py -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [[ "$NGPU" -gt 0 ]] || NGPU=4
fi
CONFIG_FILE=${CONFIG_FILE:-./torchtitan/models/llama3/train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}

# One string-hash seed for every rank: model code that iterates over a set of strings
# (transformers' Gemma 3 does) would otherwise trace a differently ordered graph per rank.
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}
# Each rank gets an equal share of the cores (ranks oversubscribing threads crawl).
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NGPU > 0 ? cores / NGPU : 1 ))}
nodes=(--nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}"
       --rdzv-id "${RDZV_ID:-torchtitan}" --max-restarts "${MAX_RESTARTS:-0}")
[[ -z "${RDZV_ENDPOINT:-}" ]] || nodes+=(--rdzv-endpoint "$RDZV_ENDPOINT")
exec $py -m torchtitan.launch --nproc "$NGPU" "${nodes[@]}" --log-ranks "$LOG_RANK" \
  --config-file "$CONFIG_FILE" --cwd "$user_cwd" -- "$@"
