"""Multi-rank numerics check for the planner: run with

    torchrun --standalone --nproc_per_node=4 tests/integration_tests/autoparallel_numerics.py \
        [models] [meshes] [bf16]

For each model and each mesh (dp4, tp4, dp2xtp2 — the same 4 ranks reshaped) it plans
(the model traced once, each mesh planned on `on_mesh` of that trace; `optimize_placement`
solves on rank 0 and broadcasts the plan as JSON), applies it,
initialises with `init_weights` and checks, against one process that builds the model on meta,
materialises it and calls the same `init_weights`:
  * initial parameters and buffers equal the single-process init bitwise;
  * then for `AP_STEPS` (5) AdamW steps, a new batch each, next to a single-process copy: the
    forward output on this rank's batch slice and every parameter gradient at every step
    (fp32, atol/rtol 1e-5), and the parameters after the last step.
With `bf16` the plan uses mixed precision (bf16 params/compute, fp32 gradient reduction) and
one step is compared against the fp32 reference at bf16 tolerance (gradients must be fp32).
Model `errors` checks that train-mode dropout, an infeasible plan and an uneven batch split
raise the same PlannerError on every rank.
`AP_COMPILE=1` runs the parallel module after `module.compile()` (tolerance 1e-4);
`AP_EXECUTOR=dtensor` runs the reference DTensor interpreter instead of the lowered graphs.
Model `attention` checks the planner's attention op on DTensors split by batch and by heads.
`AP_LLAMA_LAYERS=6` checks the full-depth debug model (default 2 layers, to keep CI short).
Models `hf_llama`, `hf_qwen2`, `hf_mistral`, `hf_gpt2`, `hf_bert` are tiny `transformers`
models with their own init (hf_models.py); `hf:<model_type>` is any other causal LM of
transformers, shrunk the same way.  `AP_VERBOSE=1` prints every step's errors.
Prints one line per check and `ALL OK` at the end; exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import os
import sys
import time

import hf_models
import torch
import torch.distributed as dist
import torch.nn.functional as F
from autoparallel_models import (
    Elementwise,
    GPT2Block,
    Indexing,
    Mixer,
    MLPStack,
    TiedLM,
    tiny_llama,
    tiny_moe,
)
from dtensor_reference import use_reference_executor
from rank_checks import check, run_checks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.autoparallel import AutoParallel, Plan
from torchtitan.distributed.init_check import every_value_initialised

TOL = 1e-5
MESHES = {"dp4": ((4,), ("dp",)), "tp4": ((4,), ("tp",)), "dp2tp2": ((2, 2), ("dp", "tp"))}


def models():
    b, s = 4, 16
    families = (
        {name: _hf_entry(name, b, s) for name in sys.argv[1].split(",") if name.startswith("hf:")}
        if len(sys.argv) > 1
        else {}
    )
    return {
        **families,
        "llama": (
            lambda: tiny_llama(
                n_layers=int(os.environ.get("AP_LLAMA_LAYERS", "2")), vocab=256, seq=s
            ),
            lambda g: (torch.randint(0, 256, (b, s), generator=g),),
            lambda g: torch.randint(0, 256, (b, s), generator=g),
            "ce",
        ),
        # aux-loss-free balancing: the expert biases' gradients are the load signal
        "moe_bias": (
            lambda: tiny_moe(load_balancing="bias", score_func="sigmoid", route_norm=True),
            lambda g: (torch.randint(0, 256, (b, s), generator=g),),
            lambda g: torch.randint(0, 256, (b, s), generator=g),
            "ce",
        ),
        "moe": (
            lambda: tiny_moe(),
            lambda g: (torch.randint(0, 256, (b, s), generator=g),),
            lambda g: torch.randint(0, 256, (b, s), generator=g),
            "ce",
        ),
        # 5 blocks: planned from a shallow trace of 3, applied to all 5 (repeat.py)
        "mlp": (
            lambda: MLPStack(n_layers=5),
            lambda g: (torch.randn(b, 8, 32, generator=g),),
            lambda g: torch.randn(b, 8, 32, generator=g),
            "mse",
        ),
        "gpt2": (
            lambda: GPT2Block(),
            lambda g: (torch.randint(0, 64, (b, s), generator=g),),
            lambda g: torch.randint(0, 64, (b, s), generator=g),
            "ce",
        ),
        "tied": (
            lambda: TiedLM(),
            lambda g: (torch.randint(0, 64, (b, s), generator=g),),
            lambda g: torch.randint(0, 64, (b, s), generator=g),
            "ce",
        ),
        "mixer": (
            lambda: Mixer(),
            lambda g: (torch.randn(b, 8, 32, generator=g),),
            lambda g: torch.randn(b, 8, 32, generator=g),
            "mse",
        ),
        "indexing": (
            lambda: Indexing(),
            lambda g: (torch.randn(b, 8, 32, generator=g),),
            lambda g: torch.randn(b, 8, 32, generator=g),
            "mse",
        ),
        "elementwise": (
            lambda: Elementwise(),
            lambda g: (torch.randn(b, 8, 32, generator=g),),
            lambda g: torch.randn(b, 8, 32, generator=g),
            "mse",
        ),
        # Hugging Face transformers models with their own init (hf_models.py)
        **{name: _hf_entry(name, b, s) for name in hf_models.NAMES},
    }


def _hf_entry(name, b, s):
    return (
        lambda: hf_models.build(name),
        lambda g: (torch.randint(0, hf_models.VOCAB, (b, s), generator=g),),
        lambda g: torch.randint(0, hf_models.VOCAB, (b, s), generator=g),
        "ce",
    )


def logits(out):
    """A Hugging Face model returns a ModelOutput; the others their logits."""
    return out.logits if hasattr(out, "logits") else out


def materialised(make_model):
    """The single-process reference made the way the trainer makes a model: built on meta,
    materialised with `to_empty`, then initialised by the caller (`init_weights`).  The
    parameters are swapped in place so tied ones stay one tensor, as they do in the parallel
    module (a plain `to_empty` from meta unties them; the init would then draw into two)."""
    with torch.device("meta"):
        model = make_model()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def loss_fn(kind, out, labels):
    if kind == "ce":
        return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
    return F.mse_loss(out, labels)


def local_slice(t: torch.Tensor, mesh, pl) -> torch.Tensor:
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, pl)
    idx = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return t[idx]


COMPILE = os.environ.get("AP_COMPILE") == "1"
STEPS = int(os.environ.get("AP_STEPS", "5"))
EXECUTOR = os.environ.get("AP_EXECUTOR", "lowered")  # "dtensor": the reference interpreter


def close(a, b, bf16):
    if not bf16:
        tol = 1e-4 if COMPILE else TOL  # inductor may reassociate float sums
        return torch.allclose(a, b, atol=tol, rtol=tol)
    # bf16 compute vs an fp32 reference: relative to the tensor's scale
    return (a.float() - b).abs().max().item() <= 3e-2 * max(b.abs().max().item(), 1e-6)


def mixed_recompute(blocks) -> dict[str, str]:
    """Block i of every repeated stack recomputes fully, selectively or not at all, in turn."""
    cycle = ("full", "selective", "none")
    return {f"{b.container}#{i}": cycle[i % 3] for b in blocks for i in range(len(b.keys))}


_checked: tuple[str, AutoParallel] | None = None  # the model being checked, its planner entered


def planner(model_name, make_model, specs, mesh, recompute) -> AutoParallel:
    """A planner for `model_name` on `mesh`, traced once for all the meshes it is checked
    on: each mesh plans on `on_mesh` of the first one's trace, as the mesh search does (the
    trace holds global shapes only)."""
    global _checked
    if _checked is None or _checked[0] != model_name:
        with torch.device("meta"):
            meta_model = make_model()
        bf16 = model_name.endswith("+bf16")
        autop = AutoParallel(
            meta_model,
            lambda: tuple(torch.zeros(s, dtype=d) for s, d in specs),
            mesh,
            cost_model="h100",
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else None,
            # recomputing blocks also keep (root, last unit) or gather again (the rest)
            reshard_after_forward="default" if recompute else True,
        )
        _checked = (model_name, autop.__enter__())
    return _checked[1].on_mesh(mesh)


def run_one(model_name, mesh_name, world, bf16=False):
    # "<model>+recompute": the model's repeated blocks recompute in the backward (full,
    # selective, none in turn); llama then has 4 layers (a stack needs 4 to be repeated)
    recompute = model_name.endswith("+recompute")
    # "<model>+ep": the routed experts split over the first mesh dim (expert parallelism)
    expert_parallel = model_name.endswith("+ep")
    # "<model>+replicated": no parameter memory bound, as the trainer's default when memory is
    # plentiful; on a data-parallel mesh the solver then replicates (DDP-like plan)
    replicated = model_name.endswith("+replicated")
    base = model_name.removesuffix("+recompute").removesuffix("+ep").removesuffix("+replicated")
    if recompute and base == "llama":
        os.environ.setdefault("AP_LLAMA_LAYERS", "4")
    make_model, make_inputs, make_labels, kind = models()[base]
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    batch_pin = tuple(Shard(0) if n == "dp" else Replicate() for n in names)

    # single-process reference (same seed on every rank)
    ref = materialised(make_model)
    torch.manual_seed(0)
    with every_value_initialised(ref):  # a model whose init skips a value is named, not compared
        ref.init_weights()
    g = torch.Generator().manual_seed(1)
    inputs, labels = make_inputs(g), make_labels(g)
    ref_out = logits(ref(*inputs))
    loss_fn(kind, ref_out, labels).backward()

    t0 = time.perf_counter()
    specs = [(x.shape, x.dtype) for x in inputs]
    model_name = model_name + ("+bf16" if bf16 else "")
    autop = planner(model_name, make_model, specs, mesh, recompute)
    if recompute:
        autop.set_recompute(mixed_recompute(autop.blocks))
    if not replicated:
        autop.add_parameter_memory_constraint()
    if expert_parallel:
        autop.add_expert_parallel_constraint(0)
    autop.add_input_constraints([batch_pin])
    autop.add_output_constraints([batch_pin])
    plan = autop.optimize_placement(broadcast=True)  # rank 0 solves, the others receive it
    plan = Plan.from_json(plan.to_json())  # and a JSON round trip must apply as well
    pm = autop.apply_placement(plan)
    if EXECUTOR == "dtensor":
        use_reference_executor(pm)
    plan_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        placed = {k: v for k, v in list(plan.params.items())[:6]}
        print(
            f"---- {model_name} on {mesh_name}: planned+applied in {plan_s:.1f}s "
            f"({ {k: round(v, 2) for k, v in plan.timings.items()} }); params {json.dumps(placed)}",
            flush=True,
        )

    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    names_ref = dict(ref.named_parameters())
    assert [n for n, _ in pm.named_parameters()] == list(names_ref), "FQNs differ"
    bad = [
        n
        for n, p in pm.named_parameters()
        if not torch.equal(p.full_tensor(), names_ref[n].detach())
    ]
    buffers_ref = dict(ref.named_buffers())
    bad += [
        n
        for n, b in pm.named_buffers()
        if not torch.equal(b.full_tensor() if isinstance(b, DTensor) else b, buffers_ref[n])
    ]
    check(f"{model_name}/{mesh_name} init bitwise", not bad, str(bad[:3]))

    if COMPILE:
        pm.compile()  # the same lowered graphs, compiled by inductor
        model_name += "+compile"
        compiles_before = graph_compiles()
    # several optimizer steps, a new batch each: a plan that kept anything from the first
    # call (a captured activation, a stale weight) fails from step 2 on
    # eps 1e-3: AdamW moves a parameter by lr * g / (|g| + eps), so a gradient entry far below
    # eps (zero in exact arithmetic, like a key bias under softmax, or tiny, as under HF's
    # std-0.02 init) turns its float noise into a step lr / eps times larger; 1e-3 keeps that
    # factor at 10 while gradients of 1e-2 and up still take full-size steps
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-3)
    worst_out = worst_grad = 0.0
    # bf16 against the fp32 reference: one step (AdamW turns bf16 gradient noise into
    # lr-sized differences, so later steps would compare two different trajectories)
    steps = 1 if bf16 else STEPS
    for step in range(1, steps + 1):
        if step > 1:
            inputs, labels = make_inputs(g), make_labels(g)
            ref_out = logits(ref(*inputs))
            loss_fn(kind, ref_out, labels).backward()
        out = logits(pm(*[local_slice(x, mesh, batch_pin) for x in inputs]))
        exp = local_slice(ref_out.detach(), mesh, batch_pin)
        err = (out.float() - exp).abs().max().item()
        worst_out = max(worst_out, err)
        check(
            f"{model_name}/{mesh_name} forward step {step}",
            close(out, exp, bf16),
            f"max err {err:.2e}",
            quiet=os.environ.get("AP_VERBOSE") != "1",
        )
        loss_fn(kind, out, local_slice(labels, mesh, batch_pin)).backward()
        for n, p in pm.named_parameters():
            gfull = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if gfull is None or names_ref[n].grad is None:  # unused by the forward: on both sides
                check(
                    f"{model_name}/{mesh_name} grad of {n} step {step}",
                    gfull is None and names_ref[n].grad is None,
                    "no gradient on one side only",
                )
                continue
            e = (gfull - names_ref[n].grad).abs().max().item()
            worst_grad = max(worst_grad, e)
            check(
                f"{model_name}/{mesh_name} grad of {n} step {step}",
                close(gfull, names_ref[n].grad, bf16) and gfull.dtype == torch.float32,
                f"max err {e:.2e} of {names_ref[n].grad.abs().max().item():.2e}",
                quiet=os.environ.get("AP_VERBOSE") != "1",
            )
        for model, o in ((ref, opt_ref), (pm, opt)):  # clipping and AdamW on both sides
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            o.step()
            o.zero_grad()
    check(f"{model_name}/{mesh_name} forward x{steps}", True, f"max err {worst_out:.2e}")
    # how many ranks ran graphs another rank lowered (execute/shared_lowering.py): the tests
    # require it where the ranks' programs are the same and none where they differ
    # (none lowered with AP_EXECUTOR=dtensor: the reference interpreter runs DTensors)
    loaded = torch.tensor([sum(lp.stats["loaded"] for lp in pm._ap_executor.lowered.values())])
    dist.all_reduce(loaded)
    check(f"{model_name}/{mesh_name} lowering", True, f"loaded by {int(loaded)} of {world} ranks")
    check(
        f"{model_name}/{mesh_name} grads x{steps}",
        True,
        f"max err {worst_grad:.2e} (every parameter, every step)",
    )
    if not bf16:
        bad = [
            n
            for n, p in pm.named_parameters()
            if not close(p.full_tensor(), names_ref[n].detach(), bf16)
        ]
        check(f"{model_name}/{mesh_name} params after {steps} steps", not bad, str(bad[:3]))
    if COMPILE:
        check_compiled_once(model_name, mesh_name, pm, graph_compiles() - compiles_before)
    if recompute:
        check_recomputes(model_name, mesh_name, pm, plan)
    if replicated:
        check_replicated(model_name, mesh_name, pm, plan)
    if base.startswith("moe"):
        check_expert_layout(model_name, mesh_name, pm, expert_parallel)


def graph_compiles() -> int:
    """Graphs inductor compiled for this process so far (not read from its cache), in it or
    in a child process compiling for it."""
    from torchtitan.autoparallel.execute.executor import InductorOnFirstCall

    return InductorOnFirstCall.generated


def check_compiled_once(model_name, mesh_name, pm, compiles: int) -> None:
    """Ranks whose lowered graphs are the same code compile them once on this machine (the
    others read them from inductor's cache: execute/shared_compile.py), not once per rank;
    none when the cache is warm.  On a data-parallel mesh that is every rank."""
    import hashlib

    (lp,) = pm._ap_executor.lowered.values()
    mine = [hashlib.sha256(g.gm.code.encode()).hexdigest() for g in (lp.fwd, lp.bwd)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    distinct = len({code for codes in everyone for code in codes})
    total = torch.tensor([compiles])
    dist.all_reduce(total)
    check(
        f"{model_name}/{mesh_name} graphs compiled on this machine: {total.item()} of "
        f"{distinct} distinct",
        total.item() <= distinct,
        f"ranks compiled {compiles} here",
    )


def check_replicated(model_name, mesh_name, pm, plan) -> None:
    """A DDP-like plan: every parameter whole on every rank, and its backward reduces the
    gradients with all-reduces only (in DDP-sized buckets, executor.py; eager graphs reduce
    a bucket in place, in_place.py), no reduce-scatter."""
    from torchtitan.autoparallel.execute.buckets import AR, RS

    whole = [k for k, v in plan.params.items() if set(v) == {"R"}]
    (lp,) = pm._ap_executor.lowered.values()
    bwd = [n for n in lp.partition.bwd.graph.nodes if n.op == "call_function"]
    n_ar = sum(n.target in (AR, torch.ops._c10d_functional.all_reduce_.default) for n in bwd)
    n_rs = sum(n.target is RS for n in bwd)
    check(
        f"{model_name}/{mesh_name} params replicated {len(whole)} of {len(plan.params)}, "
        f"backward all-reduces {n_ar}",
        len(whole) == len(plan.params) and n_ar >= 1 and n_rs == 0,
        f"not replicated: {[k for k in plan.params if k not in whole][:3]}; reduce-scatters {n_rs}",
    )


def check_expert_layout(model_name, mesh_name, pm, expert_parallel: bool) -> None:
    """With "+ep" the lowered graphs run every MoE layer's experts through the
    expert-parallel kernels (forward and backward), without it through the plain op."""
    (lp,) = pm._ap_executor.lowered.values()
    ops = [
        str(n.target)
        for gm in (lp.partition.fwd, lp.partition.bwd)
        for n in gm.graph.nodes
        if "routed_experts" in str(n.target)
    ]
    ep = sum("_ep" in op for op in ops)
    want = 2 * 2 if expert_parallel else 0  # 2 MoE layers, forward and backward each
    check(
        f"{model_name}/{mesh_name} expert-parallel kernels {ep} of {len(ops)}",
        ep == want and len(ops) == 4,
        str(ops),
    )


def check_recomputes(model_name, mesh_name, pm, plan) -> None:
    """The executor ran the plan's policies: a fully recomputed block keeps at most its output
    for the backward, a selective one its matmul/attention outputs and its output."""
    from lowered_graphs import backward_gathered_units

    from torchtitan.autoparallel.graph.nodes import param_side
    from torchtitan.autoparallel.policies.recompute import block_label, kept_by_selective

    runner = pm._ap_executor
    (lp,) = runner.lowered.values()
    part = lp.partition
    fwd_phs = [n for n in part.fwd.graph.nodes if n.op == "placeholder"]
    # kept gathered parameters are the re-gather decision's, not the policy's
    param_valued = param_side(
        part.fwd.graph.nodes, {n for n, f in zip(fwd_phs, part.fwd_names) if f is not None}
    )
    outs = next(n for n in part.fwd.graph.nodes if n.op == "output").args[0]
    kept: dict[str, list] = {}
    for n in outs[lp.n_out :]:
        if block_label(n) is not None and n not in param_valued:
            kept.setdefault(block_label(n), []).append(n)
    policies = {b: p for b, p in plan.recompute.items() if p != "none"}
    bad = [b for b, p in policies.items() if p == "full" and len(kept.get(b, [])) > 1]
    bad += [
        b
        for b, p in policies.items()
        if p == "selective" and sum(not kept_by_selective(n) for n in kept.get(b, [])) > 1
    ]
    check(
        f"{model_name}/{mesh_name} recomputes {len(policies)} blocks",
        runner.recompute == policies and policies and not bad,
        f"kept by {bad[:2]}: {[[n.name for n in kept.get(b, [])] for b in bad[:2]]}",
    )
    # the backward gathers again only the parameters of the units the plan says
    gathered = backward_gathered_units(part, runner.units)
    again = {u for u, yes in plan.regathered.items() if yes}
    check(
        f"{model_name}/{mesh_name} gathers again {len(again)} of {len(plan.regathered)} units",
        gathered <= again and bool(gathered or mesh_name == "tp4"),
        f"backward gathers of {sorted(gathered - again)} (kept); gathered again: {sorted(again)}",
    )


def check_attention_rules(mesh_name: str) -> None:
    """`titan.sdpa` (the planner's attention op) on DTensors split by batch and by heads, the
    rules the planner plans with: no redistribution, forward and gradients equal to one process."""
    from torch.distributed.tensor import distribute_tensor

    import torchtitan.autoparallel.ops.attention  # noqa: F401  (registers the op and its rules)

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    g = torch.Generator().manual_seed(2)
    q, k, v, grad = (torch.randn(4, 4, 16, 8, generator=g) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _lse = torch.ops.titan.sdpa(*ref_in, None, True, None)
    ref.backward(grad)
    splits = (
        [(Shard(1),), (Shard(0),)]
        if len(shape) == 1
        else [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(1))]
    )
    for pl in splits:
        ins = [distribute_tensor(t, mesh, pl).requires_grad_() for t in (q, k, v)]
        out, _lse = torch.ops.titan.sdpa(*ins, None, True, None)
        out.backward(distribute_tensor(grad, mesh, pl))
        tag = ",".join(str(p) for p in pl)
        same = out.placements == pl and all(t.grad.placements == pl for t in ins)
        check(f"attention/{mesh_name} {tag} stays split", same, str(out.placements))
        ok = close(out.full_tensor(), ref.detach(), False) and all(
            close(t.grad.full_tensor(), r.grad, False) for t, r in zip(ins, ref_in)
        )
        check(f"attention/{mesh_name} {tag} forward+grads", ok)


def raised_everywhere(fn) -> str:
    """Run `fn` on every rank; return the message of the PlannerError each rank must raise
    (the same on all of them)."""
    from torchtitan.autoparallel import PlannerError

    try:
        fn()
        msg = ""
    except PlannerError as e:
        msg = str(e)
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    return msg if all(m == msg and m for m in msgs) else f"differs per rank: {msgs}"


def check_errors(mesh_name: str) -> None:
    """Train-mode dropout, an infeasible plan solved on rank 0 and an uneven batch split: the
    same PlannerError on every rank, nobody left waiting."""
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pin = tuple(Shard(0) if n == "dp" else Replicate() for n in names)
    tokens = lambda b: lambda: torch.zeros(b, 16, dtype=torch.long)  # noqa: E731

    def plan(model, batch=4, infeasible=False):
        with AutoParallel(model, tokens(batch), mesh, cost_model="h100") as autop:
            autop.add_input_constraints([pin])
            if infeasible:  # every parameter replicated, yet one pinned sharded
                autop.add_parameter_memory_constraint(low=1.0, high=1.0)
                autop.add_parameter_constraint("tok.weight", tuple(Shard(0) for _ in names))
            autop.optimize_placement(broadcast=True)

    with torch.device("meta"):
        dropout, plain = TiedLM(dropout=0.1), TiedLM()
    msg = raised_everywhere(lambda: plan(dropout))
    check(
        f"errors/{mesh_name} dropout",
        "random op aten.native_dropout" in msg and "'blocks.0.4'" in msg,
        msg,
    )
    msg = raised_everywhere(lambda: plan(plain, infeasible=True))
    check(
        f"errors/{mesh_name} infeasible on every rank",
        "cannot all hold" in msg and "tok.weight" in msg,
        msg,
    )
    msg = raised_everywhere(lambda: plan(plain, batch=5))
    check(f"errors/{mesh_name} uneven batch", "cannot split evenly" in msg, msg)
    dropout.eval()
    plan(dropout)  # eval mode: no random op left
    check(f"errors/{mesh_name} dropout in eval mode plans", True)


def main():
    world = dist.get_world_size()
    sel_models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["llama", "mlp", "gpt2"]
    sel_meshes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MESHES)
    bf16 = len(sys.argv) > 3 and sys.argv[3] == "bf16"
    for mname in sel_models:
        for mesh_name in sel_meshes:
            if mname == "attention":
                check_attention_rules(mesh_name)
            elif mname == "errors":
                check_errors(mesh_name)
            else:
                run_one(mname, mesh_name, world, bf16)


if __name__ == "__main__":
    run_checks(main)
