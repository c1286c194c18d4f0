"""The MoE decoder: the planner against hand-written FSDP + expert parallelism, and the plan
for DeepSeek-V3 671B on a fake 256-rank H100 mesh.

    .venv/bin/python benchmarks/moe.py [--steps 8] [--rounds 2] [--skip-train]

Part 1, 4 CPU ranks (gloo), the debug flavor (seq 256, global batch 8), one interleaved run:
`deepseek_v3` (FSDP, with and without `--parallelism.expert_parallel_degree 4`) next to
`deepseek_v3_auto_parallel` (free, and with the experts split over 4 ranks).  Step 3's
collectives are counted with torch.profiler: calls per step, all-to-all calls and the
elements this rank sent in all-to-alls (fp32: 4 bytes each).

Part 2, one process: DeepSeek-V3 671B (flavor `671B`, attention as GQA) on a fake 256-rank
H100 mesh of 32 x 8 (`dp`, `ep`: 8 GPUs a node), seq 4096, one sequence per rank, bf16
parameters, full recompute, 80 GiB per rank.  The planner's own plan next to the layouts a
user would write, each priced by the same cost model: the experts split over the 8 GPUs of a
node (torchtitan's EP inside a node) or over the 32 nodes (DeepSeek's cross-node EP; their
16-way pipeline is not expressible here), the rest of each plan chosen by the solver.
Writes the tables into benchmarks/moe.md (between the markers) and prints them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import Config, markdown_table, measure, write_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MOE_TOML = REPO / "torchtitan/models/deepseek_v3/train_configs/debug_model.toml"
COMMON = ["--training.seq_len", "256", "--training.local_batch_size", "2"]
EP4 = ["--parallelism.expert_parallel_degree", "4"]


def train_rows(steps: int, rounds: int) -> str:
    configs = [
        Config("hand-written FSDP", ["--model.name", "deepseek_v3", *COMMON], 4, MOE_TOML),
        Config("auto", ["--model.name", "deepseek_v3_auto_parallel", *COMMON], 4, MOE_TOML),
        Config(
            "hand-written FSDP+EP4", ["--model.name", "deepseek_v3", *COMMON, *EP4], 4, MOE_TOML
        ),
        Config(
            "auto EP4", ["--model.name", "deepseek_v3_auto_parallel", *COMMON, *EP4], 4, MOE_TOML
        ),
    ]
    results = measure(
        configs, steps, rounds, skip_steps=3, extra_args=["--metrics.count_collectives_step", "3"]
    )
    lines = [
        markdown_table(results),
        "",
        "| run | collectives / step | all-to-alls / step | all-to-all MB sent / step (rank 0) |",
        "|---|---|---|---|",
    ]
    for r in results:
        mb = r.comm_elements.get("all_to_all", 0.0) * 4 / 1e6
        lines.append(
            f"| {r.config.name} | {r.collectives:.0f} | {r.comm_calls.get('all_to_all', 0):.0f} "
            f"| {mb:.2f} |"
        )
    lines += ["", "| pair | auto / hand-written tps | peak memory |", "|---|---|---|"]
    for manual, auto in ((results[0], results[1]), (results[2], results[3])):
        lines.append(
            f"| {auto.config.name} / {manual.config.name} | "
            f"{auto.median_tps / manual.median_tps:.2f}x | "
            f"{auto.max_peak_gib / manual.max_peak_gib:.2f}x |"
        )
    return "\n".join(lines)


def plan_rows() -> str:
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.autoparallel import AutoParallel
    from torchtitan.models.deepseek_v3.args import moe_configs
    from torchtitan.models.deepseek_v3.model import MoETransformer
    from torchtitan.torch_private import planning_mesh

    shape, names, seq = (32, 8), ("dp", "ep"), 4096
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=256)
    args = dataclasses.replace(moe_configs["671B"], max_seq_len=seq)
    with torch.device("meta"):
        model = MoETransformer(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = (Shard(0), Shard(0))
    rows = []
    t0 = time.perf_counter()
    with AutoParallel(
        model,
        lambda: torch.randint(0, args.vocab_size, (256, seq)),
        planning_mesh("cpu", shape, names),
        mp_policy=mp,
        cost_model="h100",
    ) as autop:
        for label, expert_dim in (
            ("auto (the planner's choice)", None),
            ("experts over the 8 GPUs of a node (EP 8)", "ep"),
            ("experts over the 32 nodes (EP 32)", "dp"),
        ):
            autop.clear_constraints()
            autop.set_recompute("full")
            autop.add_parameter_memory_constraint()
            autop.add_memory_constraint(80 * 2**30)
            autop.add_input_constraints([batch])
            autop.add_output_constraints([batch])
            if expert_dim is not None:
                autop.add_expert_parallel_constraint(expert_dim)
            plan = autop.optimize_placement()
            took = time.perf_counter() - t0 if expert_dim is None else None
            layouts = sorted(
                {
                    ",".join(d["ins"][3:])
                    for d in plan.nodes.values()
                    if d["op"] == "titan.routed_experts.default"
                }
            )
            p = plan.predicted
            rows.append(
                f"| {label} | {p['step_us'] / 1e3:.0f} | {p['exposed_comm_us'] / 1e3:.0f} | "
                f"{p['peak_bytes_per_rank'] / 2**30:.1f} | {'; '.join(layouts)} |"
                + (f" planned in {took:.1f} s |" if took is not None else " |")
            )
    head = [
        "| plan (DeepSeek-V3 671B, 32x8 H100, seq 4096, bf16, full AC, 80 GiB) | predicted "
        "step ms | exposed comm ms | peak GiB/rank | experts' w1, w2, w3 as the op takes them "
        "(dp, ep) | |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-train", action="store_true", help="part 2 only")
    args = parser.parse_args()
    parts = [] if args.skip_train else [train_rows(args.steps, args.rounds)]
    parts.append(plan_rows())
    table = "\n\n".join(parts)
    print(table)
    write_table(Path(__file__).with_suffix(".md"), table)


if __name__ == "__main__":
    main()
