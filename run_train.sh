#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU         ranks to start (default: all visible GPUs; without GPUs, 4 CPU ranks on gloo)
#   CONFIG_FILE  TOML config (default: the debug Llama 3; a --job.config_file option wins)
#   LOG_RANK     comma-separated ranks whose output is shown (default 0)
# Every argument is passed through as a config override, e.g.
#   ./run_train.sh --model.name llama3_auto_parallel --parallelism.tensor_parallel_degree 4
# The configuration is checked before any rank starts; a bad input or a failing rank is
# one `error:` line and exit code 2 (details under {dump_folder}/logs/).
set -euo pipefail
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
exec $py -m torchtitan.launch --nproc "$NGPU" --log-ranks "$LOG_RANK" \
  --config-file "$CONFIG_FILE" -- "$@"
