#!/usr/bin/env bash
# One prepared GPU check, no network, under 8 minutes: the debug Llama 3 on one GPU (a mesh of
# one) with the hand-written spec and with the planner, eager and compiled; prints tps, memory
# and loss per step and each run's collectives.  Needs a Python whose torch sees CUDA:
#   PYTHON=/path/to/python scripts/gpu_check.sh      (default: .venv/bin/python, no install)
# Logs go to outputs/gpu_check/<run>/train.log; the summary is outputs/gpu_check/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: $py has no CUDA-enabled torch; set PYTHON to one that has" >&2
  exit 2
fi
out=outputs/gpu_check
mkdir -p "$out"
export TORCHINDUCTOR_CACHE_DIR=$PWD/$out/inductor HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
config=./torchtitan/models/llama3/train_configs/debug_model.toml
summary=$out/summary.txt
$py -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$summary"
for run in "llama3" "llama3_auto_parallel" "llama3 --compile.enable" "llama3_auto_parallel --compile.enable"; do
  name=$(echo "$run" | tr ' .' '__' | tr -s '_')
  mkdir -p "$out/$name"
  echo "== $run" | tee -a "$summary"
  # shellcheck disable=SC2086
  timeout 110 $py -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m torchtitan.train --job.config_file "$config" --model.name $run \
    --training.steps 20 --training.seq_len 512 --training.local_batch_size 8 \
    --metrics.log_freq 1 --metrics.count_collectives_step 3 --metrics.disable_color_printing \
    --job.dump_folder "$out/$name" > "$out/$name/train.log" 2>&1
  rc=$?
  grep -E "step: |collectives|error" "$out/$name/train.log" | tee -a "$summary"
  echo "exit $rc" | tee -a "$summary"
done
