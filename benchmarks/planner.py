"""Planner benchmark: wall time per stage, peak RSS, and predicted step of the automatic plan
relative to the best hand-written torchtitan plan (FSDP, FSDP+TP) under the same cost model.

    python benchmarks/planner.py [--quick] [--configs 8B:8 8B:8,8 70B:32,8 405B:64,8]

Each configuration runs `scripts/plan.py --apply` in its own process (fake process group, model
on meta, H100 profile, global batch = dp size, seq 8192), so peak RSS is per configuration.
Prints a markdown table (paste into benchmarks/planner.md).  `--quick` uses 2 layers of each
flavor (clustering makes the program size independent of depth; tracing is not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["8B:8", "8B:8,8", "70B:32,8", "405B:64,8"]


def run_one(flavor: str, mesh: str, seq: int, layers: int | None, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        shape = [int(x) for x in mesh.split(",")]
        names = "dp" if len(shape) == 1 else "dp,tp"
        cmd = [sys.executable, str(REPO / "scripts" / "plan.py"), "--flavor", flavor, "--mesh", mesh,
               "--mesh-names", names, "--device", "h100", "--batch", str(shape[0]),
               "--seq-len", str(seq), "--apply", "--out-dir", d]
        if layers:
            cmd += ["--layers", str(layers)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        if r.returncode != 0:
            return {"flavor": flavor, "mesh": mesh, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
        return json.loads((Path(d) / "summary.json").read_text())


def row(s: dict) -> str:
    if "error" in s:
        return f"| {s['flavor']} | {s['mesh']} | error: {s['error']} |"
    t = s["timings"]
    pred = s["predicted"]
    auto = pred["auto"]["step_us"]
    hand = {k: v["step_us"] for k, v in pred.items() if k != "auto"}
    best_k = min(hand, key=hand.get)
    mesh = "x".join(map(str, s["mesh"]))
    return (f"| {s['flavor']} ({s['layers']} layers) | {mesh} | {t.get('trace', 0):.1f} | "
            f"{t.get('strategies', 0):.1f} | {t.get('prune+cluster', 0):.1f} | {t.get('build', 0):.1f} | "
            f"{t.get('solve', 0):.1f} | {t.get('apply', 0):.1f} | {s['total_s']:.1f} | {s['peak_rss_gib']:.2f} | "
            f"{auto / 1e3:.1f} | {best_k} {hand[best_k] / 1e3:.1f} | {auto / hand[best_k]:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=DEFAULT, help="FLAVOR:MESH, e.g. 70B:32,8")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="2 layers per flavor")
    ap.add_argument("--timeout", type=int, default=1800)
    a = ap.parse_args()
    print("| model | mesh | trace s | strategies s | prune+cluster s | build s | solve s | apply s | "
          "total s (incl. baselines) | peak RSS GiB | auto step ms | best hand-written ms | auto/hand |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg in a.configs:
        flavor, mesh = cfg.split(":")
        s = run_one(flavor, mesh, a.seq_len, 2 if a.quick else None, a.timeout)
        print(row(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
