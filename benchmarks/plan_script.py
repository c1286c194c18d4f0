"""Run `scripts/plan.py` in its own process (so peak RSS is per run) and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_plan_script(args: list[str], timeout: float) -> dict:
    """{file stem: parsed JSON} of every JSON file the run wrote (summary, plan,
    baselines, mesh_search), or {"error": its last stderr line} when it failed."""
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "plan.py"), *args, "--out-dir", d],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        if r.returncode != 0:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
        return {p.stem: json.loads(p.read_text()) for p in Path(d).glob("*.json")}
