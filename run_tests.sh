#!/usr/bin/env bash
# Run the whole test suite on CPU: the unit tests in two worker processes (pytest-xdist, one
# per core), then the multi-rank torchrun/gloo tests two at a time (a launch leaves a core
# idle a quarter to a third of its time: interpreter start-up, rendezvous, waits in collectives; a
# worker that runs dry takes queued tests from the other; three workers were slower: 1962 s
# against 1756 s for the multi-rank tests, the box being CPU-bound).  Extra arguments go to
# one plain pytest run instead, e.g.
#   ./run_tests.sh tests/unit_tests -k config
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh || exit 1
# Compiled tests reuse inductor's cache across runs (a cold compile costs over a minute here).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
# the slowest tests are listed at the end, so the suite's time can be watched from any CI log
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30)
if (($#)); then
  exec "${pytest[@]}" "$@"
fi
"${pytest[@]}" -n 2 -m "not slow" tests
unit=$?
"${pytest[@]}" -n 2 --dist worksteal -m slow tests
multi_rank=$?
echo "unit tests: exit $unit; multi-rank tests: exit $multi_rank"
# pytest's exit 5 (nothing collected) would mean a selection went wrong: a failure too
((unit == 0 && multi_rank == 0))
