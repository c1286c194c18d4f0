"""Memory model check: the planner's predicted bytes per rank against measured live tensor bytes.

    .venv/bin/python benchmarks/memory_model.py [--meshes dp4,tp4,dp2tp2] [--seq-len 256]
        [--local-batch 2] [--layers 6] [--steps 3] [--measure-step 3] [--json out.json]
        [--recompute none,full,auto] [--reshard always,never,auto] [--budget-mib B]

On 4 CPU ranks (torchrun, gloo), for each mesh: plan the debug Llama 3 as the trainer does (fp32,
no activation checkpointing, parameter budget 1/world, logits vocabulary-sharded on `tp`), apply
the plan, train a few steps (forward, cross-entropy, backward, clipping, foreach AdamW,
zero_grad), and in one step after the first compare each rank's peak of live tensor bytes
(`LiveTensorBytes`) with `plan.predicted["peak_bytes_per_rank"]`: parameters + gradients + AdamW
state + saved activations (`torchtitan/autoparallel/cost/memory.py`).  Prints per mesh the predicted
terms next to the measured ones, where the peak happened and what was alive then, and the
verdict: within 1 +- 20% on every rank; the exit status is non-zero if any mesh misses.  Setup
and results: `benchmarks/memory_model.md`; `tests/integration_tests/test_memory_model.py` runs one
mesh through `launch`.  Each mesh runs every `--reshard` setting (which units gather their
parameters again in the backward, regather.py) with every `--recompute` setting; an `auto`
one plans under `--budget-mib`, default halfway between the peaks of the settings before it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # torchtitan, imported inside the functions that use it
    sys.path.insert(0, str(REPO))

MESHES = {"dp4": ((4,), ("dp",)), "tp4": ((4,), ("tp",)), "dp2tp2": ((2, 2), ("dp", "tp"))}
TOLERANCE = 0.10  # the requirement: measured peak within 10% of the prediction
STATIC_KINDS = ("param", "optimizer state", "buffer", "batch")  # registered before the step
MiB = 2**20


# measuring
def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real CPU storages behind `t`: a DTensor's local shard, a wrapper subclass's inner
    tensors; nothing for fake or meta tensors."""
    todo, out = [t], []
    while todo:
        x = todo.pop()
        if isinstance(x, DTensor):
            todo.append(x._local_tensor)
        elif is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            todo.extend(v for v in (getattr(x, n) for n in names) if isinstance(v, torch.Tensor))
        elif not (is_fake(x) or x.device.type == "meta"):
            out.append(x.untyped_storage())
    return out


class LiveTensorBytes(TorchDispatchMode):
    """Live tensor storage bytes on this process, by kind, and their peak (process RSS on CPU
    is mostly allocator caches and libraries; this counts what tensors hold).

    A storage is counted once, with its current `nbytes`, from the moment it is first seen (an
    op's output while the mode is active, or `add`) until it is freed (a weakref finalizer on
    the storage; PyTorch keeps a storage's Python object alive exactly as long as the storage).
    A storage gets the kind in `self.kind` when first seen (the caller sets it to the phase of
    the step) or the kind given to `add`.
    DTensor ops return NotImplemented so DTensor runs them and the mode sees its local ops;
    ops under a fake mode (DTensor's sharding propagation) are ignored.  Scratch buffers that
    live and die inside one kernel are not seen (the memory model does not count them either).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kind = "other"
        self.live: dict[int, list] = {}  # storage address -> [nbytes, kind]
        self.by_kind: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}
        self.peak_where = ""
        self.snapshots: dict[str, dict[str, int]] = {}
        self.op = "add"  # the op whose output is being registered
        self.peak_ops: list = []  # with MEMORY_MODEL_PEAK_OPS=1: top (kind:op, bytes) at the peak

    def add(self, t: Any, kind: str | None = None, where: str = "add") -> None:
        for x in pytree.tree_leaves(t):
            if isinstance(x, torch.Tensor):
                for st in _storages(x):
                    self._add_storage(st, kind or self.kind)
        self._update_peak(where)

    def _add_storage(self, st: torch.UntypedStorage, kind: str) -> None:
        key = st._cdata
        entry = self.live.get(key)
        nbytes = st.nbytes()
        if entry is None:
            entry = [0, kind, self.op]
            self.live[key] = entry
            weakref.finalize(st, self._freed, key, entry)
        if nbytes != entry[0]:  # new, or resized since last seen
            self.by_kind[entry[1]] += nbytes - entry[0]
            self.total += nbytes - entry[0]
            entry[0] = nbytes

    def _freed(self, key: int, entry: list) -> None:
        if self.live.get(key) is entry:
            del self.live[key]
            self.by_kind[entry[1]] -= entry[0]
            self.total -= entry[0]

    def _update_peak(self, where: str) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_kind = {k: v for k, v in self.by_kind.items() if v}
            self.peak_where = f"{self.kind}: {where}"
            if os.environ.get("MEMORY_MODEL_PEAK_OPS"):
                ops: dict = defaultdict(int)
                for nbytes, kind, op in self.live.values():
                    ops[f"{kind}:{op}"] += nbytes
                self.peak_ops = sorted(ops.items(), key=lambda kv: -kv[1])[:12]

    def snapshot(self, label: str) -> None:
        self.snapshots[label] = {**self.by_kind, "total": self.total}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is None:
            self.op = str(func)
            self.add(out, where=str(func))
            self.op = "add"
        return out


def _untracked_tensor_bytes(tracker: LiveTensorBytes) -> int:
    """Bytes of live CPU tensor storages the tracker does not know (a completeness check on the
    state registered at the start of the measured step: should be ~0)."""
    seen, total = set(tracker.live), 0
    for obj in gc.get_objects():
        try:  # some tensors have no storage to read (sparse, functorch wrappers)
            sts = _storages(obj) if isinstance(obj, torch.Tensor) else ()
        except Exception:
            continue
        for st in sts:
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total


# one configuration on this rank
def run_config(
    mesh_name: str,
    opts: argparse.Namespace,
    recompute: str = "none",
    budget: float | None = None,
    reshard: str = "always",
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan.autoparallel import AutoParallel
    from torchtitan.autoparallel.policies.recompute import describe_policies
    from torchtitan.autoparallel.policies.regather import describe_units
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3.args import llama3_configs
    from torchtitan.models.llama3.model import Transformer

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = math.prod(n for n, d in zip(shape, names) if d == "dp")
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    loss_par = "tp" in names and not opts.no_loss_parallel
    vocab = HuggingFaceTokenizer(str(REPO / "tests/assets/tokenizer")).vocab_size
    args = dataclasses.replace(
        llama3_configs["debugmodel"],
        vocab_size=vocab,
        max_seq_len=opts.seq_len,
        n_layers=opts.layers,
    )
    with torch.device("meta"):
        model = Transformer(args)
    global_batch, seq = opts.local_batch * dp, opts.seq_len
    batch_pin = tuple(Shard(0) if d == "dp" else Replicate() for d in names)
    out_pin = tuple(Shard(0) if d == "dp" else Shard(2) if loss_par else Replicate() for d in names)

    t0 = time.perf_counter()
    with AutoParallel(
        model,
        lambda: torch.randint(0, vocab, (global_batch, seq)),
        mesh,
        cost_model="cpu",
        recompute=recompute,
        reshard_after_forward=reshard,
    ) as autop:
        autop.add_parameter_memory_constraint()  # 1/world, as the trainer does
        if budget is not None:
            autop.add_memory_constraint(budget)
        autop.add_input_constraints([batch_pin])
        autop.add_output_constraints([out_pin])
        plan = autop.optimize_placement(broadcast=True)
        pm = autop.apply_placement(plan)
    plan_s = time.perf_counter() - t0
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        pm.init_weights()
    pm.train()
    params = list(pm.parameters())
    opt = torch.optim.AdamW(params, lr=8e-4, eps=1e-8, weight_decay=0.1, foreach=True)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        rows = data[dp_rank * opts.local_batch : (dp_rank + 1) * opts.local_batch]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def local_bytes(ts) -> int:
        return sum((t._local_tensor if isinstance(t, DTensor) else t).nbytes for t in ts)

    def optim_state() -> list[torch.Tensor]:
        return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]

    gc.disable()  # as the trainer: collected rarely, so reference cycles would show here
    losses, untracked = [], 0
    for step in range(1, opts.steps + 1):
        tokens, labels = batch(step)
        measured = step == opts.measure_step
        tracker = LiveTensorBytes()  # only entered (counting) in the measured step
        if measured:
            rec = tracker
            gc.collect()
            for kind, ts in zip(
                STATIC_KINDS, (params, optim_state(), list(pm.buffers()), [tokens, labels])
            ):
                tracker.add(ts, kind)
            tracker.snapshot("start")
            untracked = _untracked_tensor_bytes(tracker)
        with tracker if measured else contextlib.nullcontext():
            tracker.kind = "forward"
            with loss_parallel() if loss_par else contextlib.nullcontext():
                out = pm(tokens)  # this rank's logits (a local tensor)
                if loss_par:  # as the trainer's hook: vocabulary-sharded logits for loss_parallel
                    out = DTensor.from_local(out, mesh["tp"], [Shard(2)], run_check=False)
                loss = cross_entropy_loss(out, labels)
                tracker.snapshot("forward+loss")
                del out
                tracker.kind = "backward"
                loss.backward()
            if measured:  # the gradients' local shards, measured like the parameters' below
                grad_bytes = local_bytes(p.grad for p in params if p.grad is not None)
            tracker.kind = "clip"
            clip_grad_norm_(params, 1.0)
            tracker.kind = "optimizer step"
            opt.step()
            tracker.kind = "zero_grad"
            opt.zero_grad(set_to_none=True)
            tracker.snapshot("end")
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        del loss
    gc.enable()

    fb = rec.snapshots["forward+loss"]
    return {
        "mesh": mesh_name,
        "recompute": recompute,
        "reshard": reshard,
        "policies": describe_policies(plan.recompute) if plan.recompute else "none",
        "regathered": describe_units(plan.regathered or {}),
        "budget": budget,
        "rank": dist.get_rank(),
        "plan_s": plan_s,
        "losses": losses,
        "predicted": {k: v for k, v in plan.predicted.items() if k.endswith("bytes_per_rank")},
        "peak_where": plan.predicted.get("peak_where"),
        "params": dict(plan.params),
        "measured": {
            "param_bytes": local_bytes(params),
            "grad_bytes": grad_bytes,
            "optim_bytes": local_bytes(v for v in optim_state() if v.dim() > 0),  # not `step`
            "saved_at_boundary_bytes": fb["total"] - sum(fb.get(k, 0) for k in STATIC_KINDS),
            "peak_bytes": rec.peak,
            "peak_by_kind": rec.peak_by_kind,
            "peak_where": rec.peak_where,
            "peak_ops": rec.peak_ops,
            "snapshots": rec.snapshots,
            "left_after_step": rec.snapshots["end"]["total"] - rec.snapshots["start"]["total"],
            "untracked_at_start": untracked,
        },
    }


def auto_budget(opts: argparse.Namespace, peaks: dict[str, float]) -> float:
    """The budget of a run in which the solver chooses (recompute or reshard "auto"):
    `--budget-mib`, else halfway between the smallest and the largest predicted peak of the
    settings run before it on this mesh (e.g. none and full recomputation)."""
    if opts.budget_mib is not None:
        return opts.budget_mib * MiB
    if len(peaks) < 2:
        raise SystemExit("an auto setting needs --budget-mib, or two settings before it")
    return (min(peaks.values()) + max(peaks.values())) / 2


def settings(opts: argparse.Namespace) -> list[tuple[str, str]]:
    """(reshard after forward, recompute) of every run on one mesh, in order."""
    return [(r, c) for r in opts.reshard.split(",") for c in opts.recompute.split(",")]


def worker(opts: argparse.Namespace) -> None:
    import torch.distributed as dist

    from torchtitan.train import _exit  # flush, then os._exit

    dist.init_process_group("gloo")
    results = []
    setup = {
        k: getattr(opts, k) for k in ("seq_len", "local_batch", "layers", "steps", "measure_step")
    }
    try:
        for name in opts.meshes.split(","):
            peaks: dict[str, float] = {}  # this mesh's predicted peak per setting
            for reshard, recompute in settings(opts):
                t0 = time.perf_counter()
                auto = "auto" in (recompute, reshard)
                budget = auto_budget(opts, peaks) if auto else None
                res = run_config(name, opts, recompute, budget, reshard)
                peaks[f"{recompute}/{reshard}"] = res["predicted"]["peak_bytes_per_rank"]
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, res)
                if dist.get_rank() == 0:
                    wall = time.perf_counter() - t0
                    results.append(
                        {
                            "mesh": name,
                            "recompute": recompute,
                            "reshard": reshard,
                            "budget": budget,
                            "ranks": gathered,
                            "wall_s": wall,
                            "setup": setup,
                        }
                    )
                    print(
                        f"[memory_model] {name} {recompute} {reshard} done in {wall:.1f}s",
                        flush=True,
                    )
        if dist.get_rank() == 0:
            tmp = Path(opts.out + ".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            tmp.rename(opts.out)
    except Exception:
        traceback.print_exc()
        _exit(1)
    # gloo ranks can abort in interpreter teardown after all work is done: leave in
    # lockstep, flushed, without teardown (as torchtitan/train.py does)
    dist.barrier()
    _exit(0)


# launching and reporting
def launch(
    meshes: list[str],
    *,
    seq_len: int = 256,
    local_batch: int = 2,
    layers: int = 6,
    steps: int = 3,
    measure_step: int = 3,
    no_loss_parallel: bool = False,
    recompute: str = "none",
    reshard: str = "always",
    budget_mib: float | None = None,
    timeout: float = 900,
    workdir: str | Path,
):
    """Run the worker on 4 CPU ranks, files in `workdir`; returns (`loss_compare.Run`, results
    per mesh).

    The ranks exit through barrier + os._exit, so a non-zero exit is a real failure; on a
    timeout torchrun is stopped the way the integration harness does (`loss_compare._stop`).
    """
    from torchtitan.tools.loss_compare import Run, launch_and_wait

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "memory_model.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        str(Path(__file__).resolve()),
        "--worker",
        "--out",
        str(out),
        "--meshes",
        ",".join(meshes),
        "--seq-len",
        str(seq_len),
        "--local-batch",
        str(local_batch),
        "--layers",
        str(layers),
        "--steps",
        str(steps),
        "--measure-step",
        str(measure_step),
        "--recompute",
        recompute,
        "--reshard",
        reshard,
    ]
    if no_loss_parallel:
        cmd.append("--no-loss-parallel")
    if budget_mib is not None:
        cmd += ["--budget-mib", str(budget_mib)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    code, output = launch_and_wait(cmd, env, timeout, "memory_model")
    if code == 0 and not out.exists():
        code, output = 1, output + "\n[memory_model] no results written\n"
    results = json.loads(out.read_text()) if out.exists() else []
    return Run(code, output, workdir), results


def ratio(rank_result: dict) -> float:
    return rank_result["measured"]["peak_bytes"] / rank_result["predicted"]["peak_bytes_per_rank"]


def within(r: float, tol: float = TOLERANCE) -> bool:
    return abs(r - 1.0) <= tol


def under_budget(res: dict) -> bool:
    """Every rank's measured peak within the run's memory budget (True without one)."""
    b = res.get("budget")
    return b is None or all(r["measured"]["peak_bytes"] <= b for r in res["ranks"])


def passed(res: dict) -> bool:
    return all(within(ratio(r)) for r in res["ranks"]) and under_budget(res)


def format_result(res: dict) -> str:
    from torchtitan.autoparallel.trace.repeat import name_pattern

    ranks = res["ranks"]
    pred = ranks[0]["predicted"]
    peak = max(ranks, key=lambda r: r["measured"]["peak_bytes"])
    s = res["setup"]
    mesh_shape, mesh_names = MESHES[res["mesh"]]
    budget = res.get("budget")
    lines = [
        f"### {res['mesh']}, recompute {res.get('recompute', 'none')}, reshard after forward "
        f"{res.get('reshard', 'always')}: mesh "
        f"{'x'.join(map(str, mesh_shape))} ({','.join(mesh_names)}), "
        f"local batch {s['local_batch']}, seq {s['seq_len']}, {s['layers']} layers, "
        f"measured step {s['measure_step']} of {s['steps']}",
        "",
        f"recompute per block: {ranks[0].get('policies', 'none')}; gathered parameters: "
        f"{ranks[0].get('regathered', '-')}"
        + (
            f"; budget {budget / MiB:.2f} MiB, measured peak "
            f"{'under' if under_budget(res) else 'OVER'} it on every rank"
            if budget is not None
            else ""
        ),
        "",
        "| term | predicted MiB/rank | measured MiB (max over ranks) | measured/predicted |",
        "|---|---:|---:|---:|",
    ]
    for label, key, measured_key in (
        ("parameters", "param", "param"),
        ("gradients (after the backward)", "all_grad", "grad"),
        ("AdamW state", "optim", "optim"),
        ("saved activations at the fwd/bwd boundary", "saved_at_boundary", "saved_at_boundary"),
        ("at the predicted peak: reduced gradients", "grad", None),
        ("at the predicted peak: saved activations", "activation", None),
        ("at the predicted peak: backward working set", "transient", None),
        ("**peak**", "peak", "peak"),
    ):
        p = pred.get(f"{key}_bytes_per_rank", 0.0)
        if measured_key is None:  # the parts of the predicted peak
            lines.append(f"| {label} | {p / MiB:.2f} | - | - |")
            continue
        m = max(r["measured"][f"{measured_key}_bytes"] for r in ranks)
        lines.append(
            f"| {label} | {p / MiB:.2f} | {m / MiB:.2f} | {m / p if p else float('nan'):.2f} |"
        )
    groups: dict[str, set] = defaultdict(set)
    for fqn, pl in ranks[0]["params"].items():
        groups[pl].add(name_pattern(fqn))
    pm = peak["measured"]
    verdict = "WITHIN" if all(within(ratio(x)) for x in ranks) else "NOT within"
    verdict += f" {TOLERANCE:.0%}" + ("" if under_budget(res) else ", measured OVER the budget")
    lines += [
        "",
        "plan (parameter placements): "
        + "; ".join(f"{pl}: {', '.join(sorted(g))}" for pl, g in sorted(groups.items())),
        f"predicted peak: {ranks[0].get('peak_where')}; "
        f"measured peak on rank {peak['rank']} at [{pm['peak_where']}], live by kind (MiB): "
        + ", ".join(f"{k} {v / MiB:.2f}" for k, v in pm["peak_by_kind"].items()),
        f"tool checks (bytes, max over ranks): alive after the step beyond its start "
        f"{max(x['measured']['left_after_step'] for x in ranks)}; tensors alive at the start "
        f"the tracker does not know {max(x['measured']['untracked_at_start'] for x in ranks)}",
        f"**{res['mesh']} {res.get('recompute', 'none')} {res.get('reshard', 'always')}: "
        f"measured/predicted = "
        f"{ratio(peak):.2f} (per rank "
        f"{', '.join(f'{ratio(x):.2f}' for x in ranks)}) -> {verdict}**",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="dp4,tp4,dp2tp2")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--local-batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--measure-step", type=int, default=3)
    ap.add_argument(
        "--no-loss-parallel",
        action="store_true",
        help="logits replicated on tp (default: vocabulary-sharded, as the trainer)",
    )
    ap.add_argument(
        "--recompute",
        default="none",
        help="comma-separated recompute settings per mesh: none, selective, full, auto "
        "(auto: the solver chooses under --budget-mib, default halfway between the "
        "settings before)",
    )
    ap.add_argument(
        "--reshard",
        default="always",
        help="comma-separated reshard-after-forward settings, each run with every --recompute "
        "setting: always, never, default, auto (auto: the solver keeps or gathers again per "
        "unit under the budget)",
    )
    ap.add_argument("--budget-mib", type=float, help="memory budget per rank of the auto runs")
    ap.add_argument("--json", help="also write the raw per-rank results here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.measure_step < 2 or opts.measure_step > opts.steps:
        ap.error("--measure-step must be in [2, --steps] (the optimizer state exists after step 1)")
    if opts.worker:
        worker(opts)
        return 0  # not reached
    meshes = opts.meshes.split(",")
    unknown = [m for m in meshes if m not in MESHES]
    if unknown:
        ap.error(f"unknown mesh {unknown[0]}; choose from {', '.join(MESHES)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memory_model_") as tmp:
        run, results = launch(
            meshes,
            seq_len=opts.seq_len,
            local_batch=opts.local_batch,
            layers=opts.layers,
            steps=opts.steps,
            measure_step=opts.measure_step,
            no_loss_parallel=opts.no_loss_parallel,
            recompute=opts.recompute,
            reshard=opts.reshard,
            budget_mib=opts.budget_mib,
            timeout=opts.timeout,
            workdir=tmp,
        )
    if run.returncode != 0:
        print(run.output[-6000:], file=sys.stderr)
        print(f"worker failed (rc {run.returncode})", file=sys.stderr)
        return 2
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    ok = True
    for res in results:
        print(format_result(res) + "\n")
        ok &= passed(res)
    print(
        f"{len(results)} configurations in {time.perf_counter() - t0:.0f}s: "
        + ("all within" if ok else "NOT all within")
        + f" {TOLERANCE:.0%} of the prediction (and under their budgets)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
