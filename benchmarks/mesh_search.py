"""Mesh search benchmark: the mesh the planner chooses for a world size, against the mesh and
hand-written plan torchtitan's configs use for that model, under the same cost model.

    python benchmarks/mesh_search.py [--configs 8B:64 8B:64:fp32 70B:256 405B:512:bf16:256]

Each configuration (FLAVOR:WORLD[:PRECISION[:GiB per rank]], default bf16 and 80 GiB) runs
in its own process, on a fake process group (model on meta, H100 profile, seq 2048, global
batch = world: one sequence per rank of a pure data-parallel mesh):

* `scripts/plan.py --world W --mesh auto --no-baselines`: every (dp, tp) split the model
  allows is planned; "chosen" is the cheapest that fits, "search s" the wall time of the
  search (one trace, then strategies + program + solve per candidate), "proven" how much
  slower than the choice every other candidate's plans are proven to be (>= 0: certified
  best), "max gap" the largest gap a candidate's solve left.
* `scripts/plan.py --mesh <usual>`: torchtitan's usual mesh for the model (FSDP over the
  world for 8B; tp 8 inside FSDP for 70B and 405B) with its hand-written plan priced by
  pinning every parameter ("usual step"), and the ratio chosen / usual.

Prints a markdown table (paste into benchmarks/mesh_search.md).
"""

from __future__ import annotations

import argparse

from plan_script import run_plan_script

DEFAULT = ["8B:64", "8B:64:fp32", "70B:256", "405B:512:bf16:256"]
USUAL = {"8B": lambda w: ([w], "dp", "FSDP"), "70B": lambda w: ([w // 8, 8], "dp,tp", "FSDP+TP")}
USUAL["405B"] = USUAL["70B"]


def plan(flavor: str, mesh_args: list[str], precision: str, gib: float, batch: int, a) -> dict:
    args = ["--flavor", flavor, *mesh_args, "--device", "h100", "--batch", str(batch)]
    args += ["--seq-len", str(a.seq_len), "--memory-gib", str(gib)]
    args += ["--mixed-precision", "bf16" if precision == "bf16" else "none"]
    return run_plan_script([*args, "--time-limit", str(a.time_limit)], a.timeout)


def row(config: str, a) -> str:
    flavor, world, *rest = config.split(":")
    world = int(world)
    precision = rest[0] if rest else "bf16"
    gib = float(rest[1]) if len(rest) > 1 else 80.0
    auto = plan(
        flavor,
        ["--world", str(world), "--mesh", "auto", "--no-baselines"],
        precision,
        gib,
        world,
        a,
    )
    shape, names, label = USUAL[flavor](world)
    usual = plan(
        flavor,
        ["--mesh", ",".join(map(str, shape)), "--mesh-names", names],
        precision,
        gib,
        world,
        a,
    )
    head = f"| {flavor} | {world} | {precision} | {gib:g} |"
    if "error" in auto or "error" in usual:
        return head + f" error: {auto.get('error') or usual.get('error')} |||||||"
    s = auto["mesh_search"]
    best = s["results"][s["chosen"]]
    mesh = " x ".join(f"{n} {k}" for n, k in zip(best["mesh"]["names"], best["mesh"]["shape"]))
    step = best["predicted"]["step_us"] / 1e3
    hand = usual["summary"]["predicted"][label]
    fits = hand["peak_bytes_per_rank"] <= gib * 2**30
    usual_s = f"{label} {'x'.join(map(str, shape))}: {hand['step_us'] / 1e3:.1f}" + (
        "" if fits else f" (needs {hand['peak_bytes_per_rank'] / 2**30:.0f} GiB)"
    )
    gaps = [r["gap"] for r in s["results"] if r["gap"] is not None]
    margin = s["proven_margin"]
    return (
        f"{head} {len(s['results'])} | {mesh} | {step:.1f} | {usual_s} | "
        f"{step / (hand['step_us'] / 1e3):.3f} | **{s['search_s']:.1f}** | "
        f"{'-' if margin is None else f'{margin:.2%}'} | {max(gaps, default=0):.2%} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", default=DEFAULT)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args()
    print(
        "| model | world | precision | GiB/rank | candidates | chosen mesh | chosen step ms "
        "| usual mesh + hand-written plan, step ms | chosen / usual | search s | proven "
        "| max gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config in a.configs:
        print(row(config, a), flush=True)


if __name__ == "__main__":
    main()
