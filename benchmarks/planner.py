"""Planner benchmark: wall time per stage, peak RSS, and predicted step of the automatic plan
relative to the best hand-written torchtitan plan (FSDP, FSDP+TP) under the same cost model.

    python benchmarks/planner.py [--configs 8B:8 8B:8,8 70B:32,8 405B:64,8 405B:64,8:256] \
        [--layers N]

Each configuration runs `scripts/plan.py --apply` in its own process (fake process group, model
on meta, H100 profile, global batch = dp size, seq 2048, bf16 mixed precision, 80 GiB per rank
unless the config says otherwise, solver time limit 20 s), so peak RSS is per configuration.
Prints a markdown table (paste into benchmarks/planner.md):

* "plan s" is the wall time from building the model on meta to the automatic plan: trace (a
  shallow copy: first, second and last layer), strategies, prune+cluster, build, solve.
* "apply s" builds the runnable module: trace the whole model, map the plan onto it, wrap.
* "gap" is the solver's proven distance to optimal (0.1% is the target; a time-limited
  branch and bound reports what it proved).
* a hand-written plan marked "(needs N GiB)" does not fit the memory budget per rank (it is
  priced with its parameters pinned, without the budget); the automatic plan always fits it.
"""

from __future__ import annotations

import argparse
import sys

from plan_script import run_plan_script

# FLAVOR:MESH[:GiB per rank]; the last row gives 405B a budget the hand-written plan fits in
DEFAULT = ["8B:8", "8B:8,8", "70B:32,8", "405B:64,8", "405B:64,8:256"]
BUDGET_GIB = 80.0


def run_one(flavor: str, mesh: str, budget: float, a) -> dict:
    shape = [int(x) for x in mesh.split(",")]
    args = [
        "--flavor",
        flavor,
        "--mesh",
        mesh,
        "--mesh-names",
        "dp" if len(shape) == 1 else "dp,tp",
    ]
    args += ["--device", "h100", "--batch", str(shape[0]), "--seq-len", str(a.seq_len)]
    args += ["--mixed-precision", "bf16", "--memory-gib", str(budget)]
    args += ["--time-limit", str(a.time_limit), "--apply"]
    if a.layers:
        args += ["--layers", str(a.layers)]
    out = run_plan_script(args, a.timeout)
    if "error" in out:
        return {"flavor": flavor, "mesh": mesh, "error": out["error"]}
    return {**out["summary"], "budget_gib": budget}


def row(s: dict) -> str:
    if "error" in s:
        return f"| {s['flavor']} | {s['mesh']} | error: {s['error']} |"
    t = s["timings"]
    pred = s["predicted"]
    auto = pred["auto"]["step_us"]
    hand = {k: v["step_us"] for k, v in pred.items() if k != "auto"}
    best_k = min(hand, key=hand.get)
    over = pred[best_k]["peak_bytes_per_rank"] > s["budget_gib"] * 2**30
    gap = s["solver"].get("gap")
    mesh = "x".join(map(str, s["mesh"]))
    cells = [f"{s['flavor']} ({s['layers']} layers)", mesh, f"{s['budget_gib']:g}"]
    cells += [
        f"{t.get(k, 0):.1f}" for k in ("trace", "strategies", "prune+cluster", "build", "solve")
    ]
    cells += [
        f"**{s['plan_s']:.1f}**",
        "-" if gap is None else f"{gap:.2%}",
        f"{t.get('trace_full', 0) + t.get('apply', 0):.1f}",
        f"{s['total_s']:.1f}",
        f"{s['peak_rss_gib']:.2f}",
        f"{auto / 1e3:.1f}",
        f"{best_k} {hand[best_k] / 1e3:.1f}"
        + (f" (needs {pred[best_k]['peak_bytes_per_rank'] / 2**30:.0f} GiB)" if over else ""),
        f"{auto / hand[best_k]:.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=DEFAULT, help="FLAVOR:MESH, e.g. 70B:32,8")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="override the flavor's depth")
    ap.add_argument(
        "--time-limit", type=float, default=20.0, help="solver time limit per solve (s)"
    )
    ap.add_argument("--timeout", type=int, default=1800)
    a = ap.parse_args()
    print(
        "| model | mesh | GiB/rank | trace s | strategies s | prune+cluster s | build s | "
        "solve s | plan s | gap | "
        "apply s (full trace) | total s (incl. baselines) | peak RSS GiB | auto step ms | "
        "best hand-written ms | auto/hand |"
    )
    print("|" + "---|" * 16)
    for cfg in a.configs:
        flavor, mesh, *budget = cfg.split(":")
        print(row(run_one(flavor, mesh, float(budget[0]) if budget else BUDGET_GIB, a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
