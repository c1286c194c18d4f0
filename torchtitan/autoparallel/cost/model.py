"""Stage 3: the cost model — compute time per strategy and redistribution time per edge.

Everything is in microseconds.  All constants live in dataclasses a user can override:

* `DeviceSpec`: peak FLOP/s per dtype, memory bandwidth, efficiency, kernel launch floor.
  Compute time of an op is a roofline, `max(flops / peak, bytes / bandwidth)` on the *local*
  (per-rank) shapes, plus the launch floor.  View ops cost nothing.
* `LinkSpec`: alpha-beta link (latency in us, bandwidth in GB/s) for one mesh dimension.
* `CostModel`: a device and one link per mesh dim (by default derived from `gpus_per_node`,
  the ranks of one node: ranks are numbered node after node and the last mesh dim varies
  fastest, so a dim whose groups fall inside one node uses the intra-node link, any other
  the inter-node link).

Collectives (n ranks, B bytes moving per rank): all-gather and reduce-scatter
`alpha + (n-1)/n * B_full / bw`, all-reduce twice that, all-to-all `alpha + (n-1)/n * B / bw`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils.flop_counter import flop_registry

from ..graph import placements as P
from ..ops.collective_ops import COLLECTIVE_OPS

INF = math.inf


@dataclass
class DeviceSpec:
    name: str
    tflops: dict[str, float]  # dense peak per dtype name ("float32", "bfloat16", "float16")
    mem_bw_gbps: float  # HBM / DRAM bandwidth, GB/s
    efficiency: float = 0.7  # fraction of peak reached in practice
    launch_us: float = 5.0  # per-kernel floor

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).replace("torch.", "")
        return self.tflops.get(name, self.tflops.get("float32", 1.0)) * 1e12


@dataclass
class LinkSpec:
    latency_us: float
    bw_gbps: float  # per-rank bus bandwidth, GB/s


# Public figures (dense, no sparsity); fp32 matmuls are assumed to use TF32 on GPUs.
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", {"float32": 0.2, "bfloat16": 0.2, "float16": 0.1}, 20.0, 0.7, 2.0),
    "a100": DeviceSpec("a100", {"float32": 156.0, "bfloat16": 312.0, "float16": 312.0}, 2039.0),
    "h100": DeviceSpec("h100", {"float32": 494.0, "bfloat16": 989.0, "float16": 989.0}, 3350.0),
    "h200": DeviceSpec("h200", {"float32": 494.0, "bfloat16": 989.0, "float16": 989.0}, 4800.0),
}

# (intra-node, inter-node) links, per-direction bandwidth per GPU:
# NVLink 4 (H100/H200 SXM) 450 GB/s, NVLink 3 (A100) 300 GB/s; one 400 Gb/s NDR InfiniBand
# NIC per H100/H200 = 50 GB/s, one 200 Gb/s HDR NIC per A100 = 25 GB/s.
LINKS: dict[str, tuple[LinkSpec, LinkSpec]] = {
    # gloo, 4 ranks on 2 shared cores (the project machine): ~3 ms per call, ~1 GB/s
    "cpu": (LinkSpec(3000.0, 1.0), LinkSpec(5000.0, 0.5)),
    "a100": (LinkSpec(10.0, 300.0), LinkSpec(20.0, 25.0)),
    "h100": (LinkSpec(10.0, 450.0), LinkSpec(20.0, 50.0)),
    "h200": (LinkSpec(10.0, 450.0), LinkSpec(20.0, 50.0)),
}


@dataclass
class CostModel:
    """Device + per-mesh-dim links.  `links=None` derives them from `gpus_per_node`."""

    device: DeviceSpec = field(default_factory=lambda: DEVICES["h100"])
    links: Sequence[LinkSpec] | None = None
    intra: LinkSpec | None = None
    inter: LinkSpec | None = None
    gpus_per_node: int = 8
    # Mesh search: no tensor-parallel degree above gpus_per_node is tried (TP's per-layer
    # activation collectives are only worth it on the intra-node link).
    tp_within_node: bool = True
    # Fraction of parameter-side communication (gathers of parameters before use,
    # reductions of gradients after: FSDP prefetching, DDP bucketed all-reduce) hidden
    # behind compute of neighbouring layers.  Activation communication (TP) sits on the
    # critical path and is never hidden.  0 disables overlap.  A constant fraction keeps the
    # objective separable; a max(0, comm - compute) form (one row coupling every variable)
    # made HiGHS' root LP ~10x slower on Llama3 programs.
    overlap_efficiency: float = 0.8

    @classmethod
    def for_device(cls, name: str, **overrides) -> CostModel:
        key = name.lower()
        if key not in DEVICES:
            from ..errors import PlannerError

            raise PlannerError(f"unknown device '{name}'; known: {sorted(DEVICES)}")
        intra, inter = LINKS[key]
        return cls(**{"device": DEVICES[key], "intra": intra, "inter": inter, **overrides})

    def mesh_links(self, mesh_shape: Sequence[int]) -> list[LinkSpec]:
        if self.links is not None:
            if len(self.links) != len(mesh_shape):
                from ..errors import PlannerError

                raise PlannerError(
                    f"cost model has {len(self.links)} links for a {len(mesh_shape)}-D mesh"
                )
            return list(self.links)
        intra = self.intra or LINKS["h100"][0]
        inter = self.inter or LINKS["h100"][1]
        return [intra if within else inter for within in self.within_node(mesh_shape)]

    def within_node(self, mesh_shape: Sequence[int]) -> list[bool]:
        """Per mesh dim: whether each of its groups lies inside one node.  A group of dim d
        is `n` ranks `stride = prod(later dims)` apart, spanning a block of `stride * n`
        consecutive ranks; it stays in a node when such blocks tile the node."""
        out = []
        for d, n in enumerate(mesh_shape):
            block = math.prod(mesh_shape[d + 1 :]) * n
            out.append(n == 1 or self.gpus_per_node % block == 0)
        return out

    def node_layout(self, mesh_shape: Sequence[int], names: Sequence[str]) -> str:
        """e.g. "nodes of 8 ranks: dp inter-node, tp intra-node" (dims of size 1 left out)."""
        dims = [
            f"{name} {'intra' if within else 'inter'}-node"
            for name, n, within in zip(names, mesh_shape, self.within_node(mesh_shape))
            if n > 1
        ]
        return f"nodes of {self.gpus_per_node} ranks: " + (", ".join(dims) or "one rank")

    def with_links(self, links: Sequence[LinkSpec]) -> CostModel:
        return replace(self, links=list(links))


def resolve_cost_model(cost_model) -> CostModel:
    """Accept a CostModel, a device name, or None (H100 figures)."""
    if isinstance(cost_model, CostModel):
        return cost_model
    if cost_model is None:
        return CostModel.for_device("h100")
    if isinstance(cost_model, str):
        return CostModel.for_device(cost_model)
    from ..errors import PlannerError

    raise PlannerError(
        f"cost_model must be a CostModel or a device name, got {type(cost_model).__name__}"
    )


class Estimator:
    """Caches compute and communication estimates for one mesh and cost model."""

    def __init__(self, cm: CostModel, mesh_shape: Sequence[int]):
        self.cm = cm
        self.mesh_shape = tuple(mesh_shape)
        self.links = cm.mesh_links(self.mesh_shape)
        self._comm: dict = {}

    # ---------------- compute ----------------
    def compute_us(self, op, in_vals, in_pls, out_vals, out_pls, args) -> float:
        if not isinstance(op, torch._ops.OpOverload) or op.is_view:
            return 0.0
        nbytes = 0
        for v, pl in list(zip(in_vals, in_pls)) + list(zip(out_vals, out_pls)):
            if isinstance(v, torch.Tensor):
                shape = P.local_shape(v.shape, pl, self.mesh_shape) if pl is not None else v.shape
                nbytes += math.prod(shape) * v.element_size()
        flops = 0.0
        f = flop_registry.get(op.overloadpacket)
        if f is not None:
            flops = _flops(f, op, args, in_vals, in_pls, out_vals, out_pls, self.mesh_shape)
        dev = self.cm.device
        dtype = next((v.dtype for v in in_vals if isinstance(v, torch.Tensor)), torch.float32)
        t_flop = flops / (dev.peak_flops(dtype) * dev.efficiency) * 1e6
        t_mem = nbytes / (dev.mem_bw_gbps * 1e9 * dev.efficiency) * 1e6
        return max(t_flop, t_mem) + dev.launch_us + self._in_op_comm_us(op, in_vals, in_pls)

    def _in_op_comm_us(self, op, in_vals, in_pls) -> float:
        """All-to-alls inside an op with a collective strategy (ops/collective_ops.py)."""
        rule = COLLECTIVE_OPS.get(op)
        dim = rule.collective_dim(in_pls) if rule is not None else None
        if rule is None or dim is None:
            return 0.0
        calls, nbytes = rule.comm(in_vals, in_pls, self.mesh_shape)
        return self.alltoall_us(dim, calls, nbytes)

    def alltoall_us(self, dim: int, calls: int, nbytes: float) -> float:
        """`calls` all-to-alls over mesh dim `dim` in which each rank sends (and receives)
        `nbytes` in all."""
        n = self.mesh_shape[dim]
        if n == 1:
            return 0.0
        link = self.links[dim]
        return calls * link.latency_us + (n - 1) / n * nbytes / (link.bw_gbps * 1e3)

    # ---------------- communication ----------------
    def comm_us(
        self, src: P.Placements, tgt: P.Placements, shape, itemsize: int, bucketed: bool = False
    ) -> float:
        """Time to redistribute a tensor from `src` to `tgt`.  `bucketed`: the collective
        shares one call with the other tensors of its bucket (the executor's per-unit
        parameter gathers and gradient reductions), so the link's latency, paid once per
        bucket, is not charged to each tensor."""
        key = (src, tgt, tuple(shape), itemsize, bucketed)
        r = self._comm.get(key)
        if r is None:
            r = self._comm[key] = self._comm_uncached(src, tgt, shape, itemsize, bucketed)
        return r

    def _comm_uncached(self, src, tgt, shape, itemsize, bucketed) -> float:
        if src == tgt:
            return 0.0
        cur = list(src)
        total = 0.0
        for d, s, t in redistribution_steps(src, tgt):
            if isinstance(t, Partial):
                return INF  # creating a Partial is never a redistribution we allow
            # bytes this rank holds before the step, under the placements reached so far
            nbytes = math.prod(P.local_shape(shape, tuple(cur), self.mesh_shape)) * itemsize
            n = self.mesh_shape[d]
            if n == 1:  # a mesh dim of one rank: every placement holds the whole tensor
                cur[d] = t
                continue
            link = self.links[d]
            latency = 0.0 if bucketed else link.latency_us
            frac = (n - 1) / n
            bw = link.bw_gbps * 1e9 / 1e6  # bytes per us
            if isinstance(s, Shard) and isinstance(t, Replicate):  # all-gather
                total += latency + frac * nbytes * n / bw
            elif isinstance(s, Shard) and isinstance(t, Shard):  # all-to-all
                total += latency + frac * nbytes / bw
            elif isinstance(s, Partial) and isinstance(t, Replicate):  # all-reduce
                total += 2 * (latency + frac * nbytes / bw)
            elif isinstance(s, Partial) and isinstance(t, Shard):  # reduce-scatter
                total += latency + frac * nbytes / bw
            elif not (isinstance(s, Replicate) and isinstance(t, Shard)):  # (a free local slice)
                return INF
            cur[d] = t
        return total


def redistribution_steps(
    src: P.Placements, tgt: P.Placements
) -> list[tuple[int, Placement, Placement]]:
    """The one-mesh-dim steps DTensor's (greedy) redistribution takes from src to tgt, in order:
    if src shards anything, inner mesh dims first (a dim whose target sharding sits under a
    different outer sharding of the same tensor dim goes through Replicate); then outer to
    inner for what remains.
    Order matters for the price: gathering S(0),S(0) -> R,R moves the small tensor over the
    inner (tp) link and the large one over the outer (dp) link."""
    cur, steps = list(src), []

    def sharded_on(pls, dim: int, below: int) -> list[int]:
        return [i for i in range(below) if isinstance(pls[i], Shard) and pls[i].dim == dim]

    for d in reversed(range(len(src)) if any(isinstance(p, Shard) for p in src) else ()):
        t = tgt[d]
        if isinstance(t, Shard) and sharded_on(cur, t.dim, d) != sharded_on(tgt, t.dim, d):
            t = Replicate()
        if cur[d] != t:
            steps.append((d, cur[d], t))
            cur[d] = t
    for d in range(len(src)):
        if cur[d] != tgt[d]:
            steps.append((d, cur[d], tgt[d]))
            cur[d] = tgt[d]
    return steps


def _flops(f, op, args, in_vals, in_pls, out_vals, out_pls, mesh_shape) -> float:
    """Apply torch's FLOP formula to local shapes (tensor args replaced by local torch.Size)."""
    it = iter(zip(in_vals, in_pls))
    import torch.fx as fx

    def loc(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                val, pl = next(it)
                return torch.Size(
                    P.local_shape(val.shape, pl, mesh_shape) if pl is not None else val.shape
                )
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(loc(x) for x in a)
        return a

    try:
        local_args = [loc(a) for a in args]
        outs = [
            torch.Size(P.local_shape(v.shape, pl, mesh_shape)) if pl is not None else v.shape
            for v, pl in zip(out_vals, out_pls)
            if isinstance(v, torch.Tensor)
        ]
        out_val = outs[0] if len(outs) == 1 else tuple(outs)
        return float(f(*local_args, out_val=out_val))
    except Exception:
        return 0.0
