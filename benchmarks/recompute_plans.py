"""Memory-aware plans at scale: the automatic plan (sharding, per-block recomputation and which
blocks gather their parameters again, chosen together under the memory budget) against
torchtitan's hand-written plans priced with no, full and selective activation checkpointing
(each with torchtitan's reshard-after-forward policies default, always and never).

    python benchmarks/recompute_plans.py [--configs 8B:8:24 70B:32,8:40 405B:64,8:80 ...]

A config is FLAVOR:MESH:GiB[:BATCH] (mesh dims dp or dp,tp; batch default: the dp size).
Each runs `scripts/plan.py` in its own process (fake process group, model on meta, H100
profile, seq 2048, bf16 mixed precision, `--recompute auto --reshard auto`) and prints one
markdown row: the automatic plan's predicted step, recomputation per block, the units that
gather again and keep, and peak memory per rank, the
best hand-written plan that fits the budget, and their ratio.  Every hand-written variant is
listed with its step and peak (those over the budget marked).  Table:
`benchmarks/planner.md`, section "Memory-aware plans".
"""

from __future__ import annotations

import argparse
import sys

from plan_script import run_plan_script

DEFAULT = ["8B:8:24", "70B:32,8:40", "405B:64,8:80", "405B:64,8:80:128"]


def run(config: str) -> str:
    parts = config.split(":")
    flavor, mesh, gib = parts[0], parts[1], float(parts[2])
    names = "dp" if "," not in mesh else "dp,tp"
    args = ["--flavor", flavor, "--mesh", mesh, "--mesh-names", names, "--device", "h100"]
    args += ["--memory-gib", str(gib), "--mixed-precision", "bf16", "--seq-len", "2048"]
    if len(parts) > 3:
        args += ["--batch", parts[3]]
    out = run_plan_script(args, timeout=1800)
    if "error" in out:
        return f"| {config} | error: {out['error']} |"
    from torchtitan.autoparallel.policies.recompute import describe_policies
    from torchtitan.autoparallel.policies.regather import describe_units

    summary, plan = out["summary"], out["plan"]
    pred = summary["predicted"]
    budget = gib * 2**30
    auto = pred["auto"]
    hand = {k: v for k, v in pred.items() if k != "auto"}
    fits = {k: v for k, v in hand.items() if v["peak_bytes_per_rank"] <= budget}
    best = min(fits, key=lambda k: fits[k]["step_us"]) if fits else None
    policies = plan.get("recompute") or {}
    rec = describe_policies(policies) if any(p != "none" for p in policies.values()) else "none"
    made_again = plan.get("regathered") or {}
    backward = plan.get("backward_gathers") or made_again
    gathers = describe_units(backward)
    by_placement = sum(1 for u, yes in backward.items() if yes and not made_again.get(u))
    if by_placement:
        gathers += f" ({by_placement} of them from a kept sharded copy)"
    ms = lambda p: f"{p['step_us'] / 1e3:.1f}"  # noqa: E731
    peak = lambda p: f"{p['peak_bytes_per_rank'] / 2**30:.1f}"  # noqa: E731
    others = "; ".join(
        f"{k} {ms(v)} ms / {peak(v)} GiB" + ("" if k in fits else " (over)")
        for k, v in hand.items()
    )
    ratio = f"{auto['step_us'] / fits[best]['step_us']:.3f}" if best else "-"
    return (
        f"| {flavor} | {mesh} | {summary['batch']} | {gib:g} | {ms(auto)} | {rec} | {gathers} | "
        f"{peak(auto)} | {best or 'none fits'}"
        + (f" {ms(fits[best])}" if best else "")
        + f" | **{ratio}** | {summary['plan_s']:.1f} | {others} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT)
    opts = ap.parse_args()
    print(
        "| model | mesh | batch | budget GiB | auto step ms | auto recompute "
        "| auto gathered parameters | auto peak GiB "
        "| best hand-written that fits, step ms | auto / best | plan s | every hand-written "
        "plan: step / peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config in opts.configs:
        print(run(config), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
