#!/usr/bin/env bash
# Create ./.venv with the pinned CPU torch and the project's dependencies, once.
# Idempotent: returns at once when the venv is already complete.  Sourced by
# run_train.sh and run_tests.sh so a fresh clone needs no other set-up.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.torchtitan-installed"
if [[ -f "$stamp" && "$stamp" -nt "$root/pyproject.toml" ]]; then
  exit 0
fi
echo "bootstrap: creating $venv (pinned torch==2.13.0, then the project)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
"$venv/bin/pip" install -q --disable-pip-version-check -e "$root[dev]"
touch "$stamp"
