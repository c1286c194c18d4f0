"""Dry-run the planner on a Llama3 flavor and a fake mesh, in one process, with no accelerator.

    python scripts/plan.py --flavor 8B --mesh 8,8 --mesh-names dp,tp --device h100 \
        --batch 8 --seq-len 2048 [--mixed-precision bf16] [--memory-gib 80] [--out-dir plan_out]
    python scripts/plan.py --flavor 8B --world 64 --mesh auto ...   # choose the mesh too
    python scripts/plan.py --flavor 70B --mesh auto --nodes 8 --gpus-per-node 8  # node shape

The model is built on meta and traced under a fake process group (nothing is allocated).
Prints the stage timings as they finish, the plan per parameter group (repeated layers
collapsed), the predicted step time (compute / exposed communication) and memory per rank,
and the same figures for torchtitan's hand-written plans on that mesh, priced by the same cost
model: every parameter is pinned to the hand-written placement and the solver prices (and
chooses) the rest of the graph; each is priced without activation checkpointing, with full AC
and with selective AC (`+ SAC`: matmul and attention outputs kept), each with torchtitan's
three reshard-after-forward policies: default (every block but the last gathers its
parameters again in the backward), `reshard always` and `no reshard` (every block keeps them).  The
automatic plan chooses its own recomputation per block (`--recompute auto`) and which
blocks gather again (`--reshard auto`) under the memory budget.
Writes `plan.json` and `plan.html` (which tensor dim is split on which mesh dim, parameter by
parameter, layer by layer, and per parameter group why: the collectives its placement
implies and what the hand-written plans and `--explain`'s alternatives that place it
otherwise predict) into `--out-dir`.

`--mesh auto` with `--world N` first plans every (dp, tp) split of the world that the model
allows (tp divides heads, kv-heads, dim, SwiGLU width, vocabulary and sequence; tp within a
node of the device profile; dp divides the batch, default: N sequences), prints the table
of candidates and writes it to `mesh_search.json` and the HTML page, then reports the
chosen mesh as above.  The trainer's `--parallelism.tensor_parallel_degree auto` runs the
same search.

`--diff A.json B.json` plans nothing: it prints two saved plans side by side (meshes, the
predicted step, compute, communication and peak memory, and every parameter pattern whose
placements differ), e.g. two meshes, two precisions, or a plan before and after an edit.

`--explain PATTERN` also solves the plan again for every placement the parameters the glob
names (all of one shape) could take, each pinned in turn, and prints what each would do to
the predicted step, communication and memory, or which constraints forbid it.

`--gpus-per-node` (default 8) is the node size: a mesh dim whose groups stay inside one node
(ranks are numbered node after node, the last mesh dim fastest) is priced with the device's
intra-node link, any other with its inter-node link; the mesh search keeps tp inside a node.
`--nodes N` sets the world to N x gpus-per-node.  The trainer takes the node size from the
launch (torchrun's LOCAL_WORLD_SIZE).

Bad input prints one `error: ...` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import resource
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

# the hand-written baselines: which linear layers torchtitan's Megatron TP plan splits how
DEVICES = ("cpu", "a100", "h100", "h200")
HBM_GIB = {"cpu": 24.0, "a100": 80.0, "h100": 80.0, "h200": 141.0}  # default memory budget


class BadInput(Exception):
    pass


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", default="8B", help="llama3 flavor: debugmodel, 8B, 70B, 405B")
    ap.add_argument("--mesh", default="8,8", help="mesh shape, e.g. 8 or 8,8; auto: search")
    ap.add_argument("--world", type=int, default=None, help="world size (with --mesh auto)")
    ap.add_argument("--mesh-names", default=None, help="comma-separated names (default dp,tp)")
    ap.add_argument("--device", default="h100", help="cost profile: " + "|".join(DEVICES))
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="ranks per node: a mesh dim whose groups stay inside a node is priced with the "
        "device's intra-node link, any other with its inter-node link",
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes in the job: the world is nodes x gpus-per-node (checked against --mesh, "
        "or the --world of --mesh auto)",
    )
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: dp size)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="override n_layers (faster tracing)")
    ap.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="per-rank memory budget in GiB (params+grads+AdamW+activations); "
        "default: the device's memory (h100 80, h200 141, a100 80, cpu 24)",
    )
    ap.add_argument(
        "--mixed-precision",
        choices=("none", "bf16"),
        default="none",
        help="bf16: parameters gathered and computed in bf16, gradients reduced in "
        "fp32 (torchtitan's FSDP2 default); none: everything fp32",
    )
    ap.add_argument(
        "--param-fraction",
        type=float,
        default=None,
        help="additionally bound parameter memory to this fraction of all parameters",
    )
    ap.add_argument(
        "--recompute",
        choices=("none", "selective", "full", "auto"),
        default="auto",
        help="activation recomputation of the automatic plan: one policy for every block, or "
        "auto (the solver chooses per block under the memory budget); hand-written plans "
        "are priced with none, full and selective",
    )
    ap.add_argument(
        "--reshard",
        choices=("always", "never", "default", "auto"),
        default="auto",
        help="which units of the automatic plan gather their parameters again in the "
        "backward: all, none, torchtitan's default (all but the root and the last block), "
        "or auto (the solver decides per unit under the memory budget); hand-written plans "
        "are priced with default, always and never",
    )
    ap.add_argument(
        "--pp",
        default="1",
        help="pipeline degree (with --mesh auto): 1, a number, or auto (the trainer's mesh "
        "search with pipeline stages: each candidate's stages planned on its other dims, the "
        "schedule's bubble, sends and microbatches in flight priced)",
    )
    ap.add_argument(
        "--schedule",
        default="1F1B",
        help="pipeline schedule (torch.distributed.pipelining's name), or auto: 1F1B or "
        "Interleaved1F1B, whichever the search prices faster",
    )
    ap.add_argument(
        "--microbatch-size",
        default="1",
        help="sequences per microbatch, or auto (with --pp: the search tries every size that "
        "gives at least as many microbatches as pipeline ranks)",
    )
    ap.add_argument(
        "--hand-written-pipeline",
        default=None,
        metavar="PP,DP,TP",
        help="with --pp: also price this hand-written configuration (FSDP x Megatron TP "
        "placements pinned in every stage, full activation checkpointing, the --schedule "
        "given or Interleaved1F1B), e.g. torchtitan's published 405B run: 8,8,8",
    )
    ap.add_argument("--no-baselines", action="store_true", help="skip the hand-written plans")
    ap.add_argument(
        "--explain",
        default=None,
        metavar="PATTERN",
        help="why the parameters this glob names (one shape) are placed as they are: the plan "
        "solved again with each placement they could take pinned",
    )
    ap.add_argument("--time-limit", type=float, default=300.0, help="solver time limit (s)")
    ap.add_argument(
        "--proof-limit",
        type=float,
        default=15.0,
        help="seconds to search for a cheaper plan once one near the bound is found",
    )
    ap.add_argument("--out-dir", default="plan_out")
    ap.add_argument("--apply", action="store_true", help="also time apply_placement (fake mesh)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument(
        "--diff",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="compare two saved plans (meshes, predicted costs, parameters placed apart) "
        "and plan nothing",
    )
    return ap.parse_args(argv)


def validate(a):
    from torchtitan.models.llama3.args import llama3_configs

    if a.flavor not in llama3_configs:
        raise BadInput(f"unknown flavor '{a.flavor}'; known: {', '.join(llama3_configs)}")
    if a.device.lower() not in DEVICES:
        raise BadInput(f"unknown device '{a.device}'; known: {', '.join(DEVICES)}")
    for opt in ("batch", "seq_len", "layers", "vocab", "time_limit", "proof_limit"):
        v = getattr(a, opt)
        if v is not None and not v > 0:
            raise BadInput(f"--{opt.replace('_', '-')} must be positive, got {v}")
    if a.memory_gib is not None and a.memory_gib <= 0:
        raise BadInput(f"--memory-gib must be positive, got {a.memory_gib}")
    if a.param_fraction is not None and not (0 < a.param_fraction <= 1):
        raise BadInput(f"--param-fraction must be in (0, 1], got {a.param_fraction}")
    if a.gpus_per_node <= 0:
        raise BadInput(f"--gpus-per-node must be positive, got {a.gpus_per_node}")
    if a.nodes is not None:
        if a.nodes <= 0:
            raise BadInput(f"--nodes must be positive, got {a.nodes}")
        nodes_world = a.nodes * a.gpus_per_node
        if a.mesh == "auto" and a.world is None:
            a.world = nodes_world
        elif a.mesh == "auto" and a.world != nodes_world:
            raise BadInput(
                f"--world {a.world} is not --nodes {a.nodes} x --gpus-per-node "
                f"{a.gpus_per_node} = {nodes_world}; give one or the other"
            )
    if a.mesh == "auto":
        if a.world is None or a.world <= 0:
            raise BadInput("--mesh auto needs --world N (a positive number of ranks)")
        if a.mesh_names is not None:
            raise BadInput("--mesh auto names its dims itself (dp, tp); drop --mesh-names")
        return "auto", ("dp", "tp")
    if a.world is not None:
        raise BadInput("--world goes with --mesh auto; a given mesh is its own world")
    try:
        shape = tuple(int(x) for x in a.mesh.split(","))
    except ValueError:
        raise BadInput(f"--mesh must be comma-separated integers or auto, got '{a.mesh}'") from None
    if not shape or any(s <= 0 for s in shape):
        raise BadInput(f"--mesh sizes must be positive, got {a.mesh}")
    if a.nodes is not None and math.prod(shape) != a.nodes * a.gpus_per_node:
        raise BadInput(
            f"--mesh {a.mesh} has {math.prod(shape)} ranks, but --nodes {a.nodes} x "
            f"--gpus-per-node {a.gpus_per_node} = {a.nodes * a.gpus_per_node}"
        )
    if a.mesh_names is None:
        names = (
            ("dp", "tp")[: len(shape)]
            if len(shape) <= 2
            else tuple(f"d{i}" for i in range(len(shape)))
        )
    else:
        names = tuple(x.strip() for x in a.mesh_names.split(","))
        if len(names) != len(shape):
            raise BadInput(
                f"--mesh-names has {len(names)} name(s) for a {len(shape)}-D mesh {a.mesh}"
            )
        if len(set(names)) != len(names) or not all(names):
            raise BadInput(f"--mesh-names must be distinct and non-empty, got '{a.mesh_names}'")
    return shape, names


def cost_model_for(a):
    """The device profile with the job's node size."""
    from torchtitan.autoparallel.cost.model import CostModel

    return CostModel.for_device(a.device, gpus_per_node=a.gpus_per_node)


def mesh_candidates(world: int, args, batch: int, a):
    """(dp, tp) meshes of `world` for `--mesh auto`, and [(label, why not)] for the rest:
    the trainer's rules (mesh_choice.candidate_degrees) on this script's dim names."""
    from torchtitan.autoparallel.mesh_search import MeshCandidate
    from torchtitan.config.job_config import Parallelism
    from torchtitan.experiments.auto_parallel.mesh_choice import candidate_degrees

    cost_model = cost_model_for(a)
    keep, skipped = candidate_degrees(
        Parallelism(tensor_parallel_degree="auto", disable_loss_parallel=True),
        world,
        batch,
        args.tensor_parallel_sizes(),
        a.seq_len,
        cost_model.gpus_per_node if cost_model.tp_within_node else None,
    )

    def mesh(d):
        dims = [(n, s) for n, s in (("dp", d["dp_shard"]), ("tp", d["tp"])) if s > 1]
        return MeshCandidate(*zip(*(dims or [("dp", 1)])))

    if not keep:
        why = "; ".join(f"{mesh(d).label()}: {r}" for d, r in skipped)
        raise BadInput(f"--mesh auto: no (dp, tp) split of world {world} suits {a.flavor} ({why})")
    return [mesh(d) for d in keep], [(mesh(d).label(), r) for d, r in skipped]


# ---------------------------------------------------------------------------- main
def run(a) -> int:
    from torchtitan.autoparallel.plan.display import collapse, describe, summary_line, write_html
    from torchtitan.autoparallel.plan.reasons import group_reasons
    from torchtitan.models.llama3.baseline_plans import dp_dim, fsdp_plan, fsdp_tp_plan, tp_dim

    shape, names = validate(a)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.autoparallel import AutoParallel
    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.torch_private import planning_mesh

    if a.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    over = {"max_seq_len": a.seq_len}
    if a.vocab:
        over["vocab_size"] = a.vocab
    if a.layers:
        over["n_layers"] = a.layers
    args = dataclasses.replace(llama3_configs[a.flavor], **over)
    budget_gib = a.memory_gib if a.memory_gib is not None else HBM_GIB[a.device.lower()]
    search = None
    if shape == "auto":
        world = a.world
        batch = a.batch if a.batch is not None else world
        candidates, skipped = mesh_candidates(world, args, batch, a)
        shape, names = candidates[0].shape, candidates[0].names  # the search's first mesh
    else:
        world = math.prod(shape)
        dp_size = shape[dp_dim(names)] if dp_dim(names) is not None else 1
        batch = a.batch if a.batch is not None else dp_size
        if batch % dp_size:
            raise BadInput(f"--batch {batch} is not divisible by the dp size {dp_size}")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t_all = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    vocab = args.vocab_size
    _progress(
        f"{a.flavor} ({args.n_layers} layers) on "
        + (f"world {world} (mesh auto)" if a.mesh == "auto" else f"mesh {dict(zip(names, shape))}")
        + f", batch {batch} x seq {a.seq_len}, device {a.device}, budget {budget_gib:g} "
        "GiB/rank: tracing ..."
    )
    plans = OrderedDict()
    mp_policy = None
    if a.mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def constrain(autop, names, param_pins=None, recompute=None, reshard=None):
        dp = dp_dim(names)
        pin = tuple(Shard(0) if d == dp else Replicate() for d in range(len(names)))
        autop.clear_constraints()
        autop.set_recompute(recompute or a.recompute)
        autop.set_reshard_after_forward(reshard or a.reshard)
        autop.add_input_constraints([pin])
        autop.add_output_constraints([pin])
        if param_pins is None:
            autop.add_parameter_memory_constraint(high=a.param_fraction or 1.0)
            autop.add_memory_constraint(int(budget_gib * 2**30))
        else:
            for fqn, pl in param_pins.items():
                autop.add_parameter_constraint(fqn, pl)

    with AutoParallel(
        model,
        lambda: torch.randint(0, vocab, (batch, a.seq_len)),
        planning_mesh("cpu", shape, names),
        mp_policy=mp_policy,
        cost_model=cost_model_for(a),
        solver_time_limit=a.time_limit,
        solver_proof_limit=a.proof_limit,
    ) as root:
        if a.mesh == "auto":
            from torchtitan.autoparallel.mesh_search import search_meshes

            _progress(f"  trace {root.timings['trace']:.2f}s; planning every mesh ...")
            t = time.perf_counter()
            search = search_meshes(
                root,
                candidates,
                lambda sub, cand: constrain(sub, cand.names),
                tie_break=lambda cand: cand.size("tp"),
                skipped=skipped,
            )
            search_s = time.perf_counter() - t
            print(f"\n{search.verdict()} in {search_s:.1f}s\n{search.table()}")
            shape, names = search.best.mesh.shape, search.best.mesh.names
        autop = root.on_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names))
        autop.timings["trace"] = root.timings["trace"]
        _progress(
            f"  trace {autop.timings['trace']:.2f}s ({len(autop.tg.gm.graph.nodes)} nodes); "
            f"{autop.cost_model.node_layout(shape, names)}; strategies ..."
        )
        autop.prepare()
        _progress(
            f"  strategies {autop.timings['strategies']:.2f}s, prune+cluster "
            f"{autop.timings.get('prune+cluster', 0.0):.2f}s; solving the automatic plan ..."
        )

        constrain(autop, names)
        plans["auto"] = autop.optimize_placement()
        plan_s = time.perf_counter() - t_all
        _progress(
            f"  build {autop.timings['build']:.2f}s, solve {autop.timings['solve']:.2f}s; "
            f"automatic plan after {plan_s:.2f}s"
        )
        explained, alternatives = None, {}
        if a.explain:
            explained, alternatives = explain(
                a.explain, autop, plans["auto"], lambda: constrain(autop, names)
            )
        if not a.no_baselines:
            pshapes = autop.param_shapes()
            baselines = []
            if dp_dim(names) is not None:
                baselines.append(("FSDP", fsdp_plan(pshapes, names)))
            if len(shape) >= 2 and tp_dim(names) is not None:
                baselines.append(("FSDP+TP", fsdp_tp_plan(pshapes, names)))
            # torchtitan's reshard after forward policies
            reshards = (("default", ""), ("always", " reshard always"), ("never", " no reshard"))
            for label, pins in baselines:
                variants = (("none", ""), ("full", " + full AC"), ("selective", " + SAC"))
                # activation checkpointing needs a stack of repeated blocks to apply to
                for (policy, suffix), (reshard, rs) in itertools.product(
                    variants if autop.blocks else variants[:1], reshards
                ):
                    _progress(f"  pricing hand-written {label}{suffix}{rs} ...")
                    constrain(autop, names, pins, policy, reshard)
                    plans[label + suffix + rs] = autop.optimize_placement()
                    _progress(
                        f"  build {autop.timings['build']:.2f}s, solve "
                        f"{autop.timings['solve']:.2f}s"
                    )
        if a.apply:
            _progress("  apply_placement ...")
            try:
                autop.apply_placement(plans["auto"])
                if "trace_full" in autop.timings:  # the plan came from a shallow trace
                    plans["auto"].timings["trace_full"] = autop.timings["trace_full"]
                _progress(
                    f"  apply {autop.timings['apply']:.2f}s (after tracing the whole model "
                    f"{autop.timings.get('trace_full', 0.0):.2f}s)"
                )
            except Exception as e:  # timing only; the plan itself is still reported
                _progress(
                    f"  apply failed: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}"
                )
    total = time.perf_counter() - t_all

    auto = plans["auto"]
    print(
        f"\n== plan for llama3 {a.flavor} ({args.n_layers} layers) on mesh "
        f"{' x '.join(f'{n}={s}' for n, s in zip(names, shape))}, device {a.device}, "
        f"batch {batch} x seq {a.seq_len}"
    )
    rows = collapse(auto.params, auto.param_shapes)
    w = max(len(r[0]) for r in rows)
    ws = max(len(r[1]) for r in rows)
    print(f"{'parameter group':<{w}}  {'shape':<{ws}}  placement")
    for name, shp, pl, _n in rows:
        print(f"{name:<{w}}  {shp:<{ws}}  {describe(pl, names)}")
    print(f"inputs {auto.inputs}  outputs {auto.outputs}")
    print()
    for label, plan in plans.items():
        print(summary_line(label, plan))
    if len(plans) > 1:
        budget = budget_gib * 2**30
        fitting = [
            (k, v)
            for k, v in plans.items()
            if k != "auto" and v.predicted["peak_bytes_per_rank"] <= budget
        ]
        if fitting:
            best_label, best = min(fitting, key=lambda kv: kv[1].predicted["step_us"])
            ratio = auto.predicted["step_us"] / best.predicted["step_us"]
            print(
                f"auto / best hand-written that fits {budget_gib:g} GiB ({best_label}) "
                f"predicted step: {ratio:.3f}"
            )
        else:
            print(f"no hand-written plan fits {budget_gib:g} GiB per rank")
    if explained is not None:
        print(explained)
    t = auto.timings
    print(
        "timings: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in t.items())
        + f"; plan {plan_s:.2f}s, total {total:.2f}s; "
        + f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )
    s = auto.solver
    gap = s.get("gap")
    print(
        f"solver: {s.get('status')}, proven gap {'-' if gap is None else f'{gap:.2%}'}, "
        f"optimal={s.get('optimal')} vars={s.get('num_vars')} rows={s.get('num_rows')}"
    )

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    auto.save(out / "plan.json")
    (out / "baselines.json").write_text(
        json.dumps(
            {
                k: {"params": v.params, "predicted": v.predicted}
                for k, v in plans.items()
                if k != "auto"
            },
            indent=1,
        )
    )
    write_html(
        out / "plan.html",
        plans,
        names,
        shape,
        f"llama3 {a.flavor} on {'x'.join(map(str, shape))} ({','.join(names)}), {a.device}",
        search=search,
        reasons=group_reasons(
            auto, {**{k: v for k, v in plans.items() if k != "auto"}, **alternatives}
        ),
    )
    written = ["plan.json", "baselines.json", "plan.html", "summary.json"]
    if search is not None:
        (out / "mesh_search.json").write_text(
            json.dumps({**json.loads(search.to_json()), "search_s": search_s}, indent=1)
        )
        written.append("mesh_search.json")
    summary = {
        "flavor": a.flavor,
        "layers": args.n_layers,
        "mesh": list(shape),
        "names": list(names),
        "device": a.device,
        "batch": batch,
        "seq_len": a.seq_len,
        "timings": dict(auto.timings),
        "plan_s": plan_s,
        "total_s": total,
        "solver": auto.solver,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "predicted": {k: v.predicted for k, v in plans.items()},
        "params": {k: v.params for k, v in plans.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("wrote " + ", ".join(str(out / name) for name in written))
    return 0


def explain(pattern: str, autop, auto, constrain) -> tuple[str, dict]:
    """`--explain PATTERN`: the table of what each placement of those parameters would do,
    and each solved alternative's plan by label ("PATTERN at PLACEMENT")."""
    from torchtitan.autoparallel.plan.explain import (
        explain_placements,
        explanation_table,
        matching_parameters,
    )

    params = matching_parameters(pattern, autop.param_shapes())
    chosen = auto.params[params[0]]
    _progress(f"  explaining {pattern}: {len(params)} parameter(s), one solve per placement ...")
    alternatives = explain_placements(autop, params, constrain)
    shape = tuple(autop.param_shapes()[params[0]])
    text = (
        f"\n== why {pattern} ({len(params)} parameter(s) of shape {shape}) is {chosen}: "
        "the plan solved again with each placement pinned\n"
        + explanation_table(chosen, alternatives)
    )
    solved = {f"{pattern} at {x.placement}": x.plan for x in alternatives if x.plan is not None}
    return text, solved


def _pipeline_job(a, batch: int, pp: str, tp: str, schedule: str, microbatch: str, ac: str):
    """The trainer's job config for this dry run (planner spec, cost model, budget)."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.manager import ConfigError

    budget = a.memory_gib if a.memory_gib is not None else HBM_GIB[a.device.lower()]
    argv = {
        "--job.custom_config_module": "torchtitan.experiments.auto_parallel.job_config",
        "--model.name": "llama3_auto_parallel",
        "--model.flavor": a.flavor,
        "--training.seq_len": a.seq_len,
        "--training.local_batch_size": 1,
        "--training.global_batch_size": batch,
        "--training.mixed_precision_param": "bfloat16"
        if a.mixed_precision == "bf16"
        else "float32",
        "--parallelism.pipeline_parallel_degree": pp,
        "--parallelism.pipeline_parallel_schedule": schedule,
        "--parallelism.pipeline_parallel_microbatch_size": microbatch,
        "--parallelism.tensor_parallel_degree": tp,
        "--parallelism.data_parallel_shard_degree": -1,
        "--parallelism.fsdp_reshard_after_forward": a.reshard,
        "--activation_checkpoint.mode": ac,
        "--autoparallel.cost_model": a.device,
        "--autoparallel.memory_budget_gib": budget,
        "--autoparallel.solver_time_limit_seconds": a.time_limit,
        "--autoparallel.solver_proof_limit_seconds": a.proof_limit,
    }
    flat = [str(x) for kv in argv.items() for x in kv]
    try:
        return ConfigManager().parse_args(
            [*flat, "--parallelism.disable_loss_parallel", "--autoparallel.no_plan_cache"]
        )
    except ConfigError as e:
        raise BadInput(str(e)) from None


def run_pipelined(a) -> int:
    """`--pp N|auto`: the trainer's mesh search with pipeline stages (mesh_choice.py), in
    one process on a fake world; with `--hand-written-pipeline`, that configuration priced
    the same way next to it."""
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.autoparallel.mesh_search import choose
    from torchtitan.autoparallel.plan.display import write_html
    from torchtitan.config.resolve import pipeline_options
    from torchtitan.errors import UserInputError
    from torchtitan.experiments.auto_parallel.mesh_choice import search_job_meshes
    from torchtitan.experiments.auto_parallel.pipeline_search import plan_pipelined
    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.baseline_plans import fsdp_tp_plan
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.protocols.train_spec import get_train_spec

    validate(a)
    if a.mesh != "auto":
        raise BadInput("--pp goes with --mesh auto --world N (the search lays out the mesh)")
    if a.microbatch_size != "auto" and not (a.microbatch_size.isdigit() and int(a.microbatch_size)):
        raise BadInput(
            f"--microbatch-size must be a positive number or auto, got {a.microbatch_size}"
        )
    world, batch = a.world, a.batch if a.batch is not None else a.world
    os.environ["LOCAL_WORLD_SIZE"] = str(a.gpus_per_node)  # the cost model's node size
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    over = {"max_seq_len": a.seq_len, **({"vocab_size": a.vocab} if a.vocab else {})}
    if a.layers:
        over["n_layers"] = a.layers
    args = dataclasses.replace(llama3_configs[a.flavor], **over)
    with torch.device("meta"):
        model = Transformer(args)
    spec = get_train_spec("llama3_auto_parallel")
    job = _pipeline_job(a, batch, a.pp, "auto", a.schedule, a.microbatch_size, a.recompute)
    _progress(
        f"{a.flavor} ({args.n_layers} layers) on world {world}, pp {a.pp}, schedule "
        f"{a.schedule}, batch {batch} x seq {a.seq_len}, device {a.device}: searching ..."
    )
    t0 = time.perf_counter()
    stage_plans: dict = {}  # each pipelined candidate's stage plans, kept for the page
    try:
        options = pipeline_options(spec, args, job)
        search, degrees, _ = search_job_meshes(
            model, args, job, world, batch, args.vocab_size, options, stage_plans
        )
    except UserInputError as e:
        raise BadInput(str(e)) from None
    search_s = time.perf_counter() - t0
    print(f"{search.verdict()}\n{search.table()}\nsearch time {search_s:.1f}s")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mesh_search.json").write_text(search.to_json())
    best = search.best
    # the chosen pipeline's plan per kind of stage, or the chosen mesh's one plan
    plans = stage_plans[best.label()] if best.schedule else {"auto": search.plan}
    first = next(iter(plans.values()))
    assert first is not None  # the search keeps the chosen candidate's plans
    write_html(
        out / "plan.html",
        plans,
        first.mesh_dim_names,
        first.mesh_shape,
        f"llama3 {a.flavor} on world {world}: {best.label()}"
        + (f"; {best.detail}" if best.detail else ""),
        search=search,
    )
    print(f"wrote {out / 'mesh_search.json'}, {out / 'plan.html'}")
    if a.hand_written_pipeline:
        try:
            pp, dp, tp = (int(x) for x in a.hand_written_pipeline.split(","))
        except ValueError:
            raise BadInput(
                f"--hand-written-pipeline {a.hand_written_pipeline!r}: give PP,DP,TP"
            ) from None
        schedule = a.schedule if a.schedule != "auto" else "Interleaved1F1B"
        microbatch = a.microbatch_size if a.microbatch_size != "auto" else "1"
        hand = _pipeline_job(a, batch, str(pp), str(tp), schedule, microbatch, "full")
        cand = {"pp": pp, "dp_replicate": 1, "dp_shard": dp, "tp": tp}
        if pp * dp * tp != world:
            raise BadInput(
                f"--hand-written-pipeline {pp},{dp},{tp}: makes {pp * dp * tp} ranks, not {world}"
            )
        planned, unsplit = plan_pipelined(
            model,
            pipeline_options(spec, args, hand),
            [cand],
            hand,
            batch,
            args.vocab_size,
            pins=fsdp_tp_plan,
        )
        if unsplit:
            raise BadInput(f"--hand-written-pipeline: {unsplit[0][1]}")
        priced = choose(planned)
        print(f"hand-written FSDP {dp} x TP {tp} x PP {pp}, {schedule}, full AC:\n{priced.table()}")
        (out / "hand_written_pipeline.json").write_text(priced.to_json())
    return 0


def diff(paths: list[str]) -> int:
    """`--diff A B`: print what differs between two saved plans."""
    from pathlib import Path

    from torchtitan.autoparallel.plan.diff import plan_diff
    from torchtitan.autoparallel.plan.plan import Plan

    plans = []
    for path in paths:
        if not Path(path).is_file():
            raise BadInput(f"--diff: no plan file {path!r}")
        plans.append(Plan.load(path))  # a file that is not a plan: PlannerError, one line
    print(plan_diff(plans[0], plans[1], labels=(Path(paths[0]).name, Path(paths[1]).name)))
    return 0


def main(argv=None) -> int:
    try:
        a = parse_args(argv)
        if a.diff:
            return diff(a.diff)
        if a.pp != "1":
            return run_pipelined(a)
        return run(a)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # planner errors (infeasible budget, ...) are user-facing too
        from torchtitan.autoparallel.errors import PlannerError

        if isinstance(e, PlannerError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
