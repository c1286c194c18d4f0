#!/usr/bin/env bash
# Run the whole test suite on CPU (unit tests, then multi-rank torchrun/gloo tests).
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/unit_tests -k config
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
# Compiled tests reuse inductor's cache across runs (a cold compile costs over a minute here).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
# the slowest tests are listed at the end, so the suite's time can be watched from any CI log
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${@:-tests}"
