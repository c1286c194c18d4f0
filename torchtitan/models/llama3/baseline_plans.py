"""The placements `parallelize.py`'s hand-written FSDP and FSDP + TP give each Llama 3
parameter, written as per-mesh-dim placements (one per mesh dim, for `mesh_dim_names`
holding `dp` and optionally `tp`).  The planner's dry run (`scripts/plan.py`) pins them to
price the hand-written plans under the same cost model as its own."""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard

# apply_tp's column-parallel and row-parallel projections
COLWISE = ("wq", "wk", "wv", "w1", "w3")
ROWWISE = ("wo", "w2")
Placements = tuple[Placement, ...]


def dp_dim(names) -> int | None:
    """The mesh dim FSDP shards on: `dp`, else the first that is not `tp`, else none."""
    if "dp" in names:
        return names.index("dp")
    return next((d for d, n in enumerate(names) if n != "tp"), None)


def tp_dim(names) -> int | None:
    """The mesh dim TP splits on: `tp`, else the second of two, else none."""
    return names.index("tp") if "tp" in names else (1 if len(names) == 2 else None)


def fsdp_plan(params: dict[str, tuple[int, ...]], names) -> dict[str, Placements]:
    """FSDP: every parameter Shard(0) on dp, replicated elsewhere."""
    dp = dp_dim(names)
    return {
        f: tuple(Shard(0) if d == dp else Replicate() for d in range(len(names))) for f in params
    }


def fsdp_tp_plan(params: dict[str, tuple[int, ...]], names) -> dict[str, Placements]:
    """FSDP + Megatron TP (sequence parallel): colwise wq/wk/wv/w1/w3 and the output
    projection Shard(0) on tp, rowwise wo/w2 Shard(1) on tp, the embedding Shard(0) on tp
    (rowwise), norms replicated on tp.  FSDP2 shards dim 0 of the TP shard on dp (a
    `_StridedShard`), so its gathers are dp all-gathers of the TP shard; pinning that as
    Shard(0) on both dims would price DTensor's nested-sharding path instead (a tp
    all-gather first, then a dp all-gather of 8x the bytes).  The same traffic and memory
    result from sharding the *other* matrix dim on dp where tp splits dim 0, which is what
    is pinned."""
    dp, tp = dp_dim(names), tp_dim(names)
    out: dict[str, Placements] = {}
    for f, shape in params.items():
        leaf = f.split(".")[-2] if f.endswith(".weight") else f.split(".")[-1]
        on_tp: Placement
        if leaf in COLWISE or leaf in ("output", "tok_embeddings"):
            on_tp = Shard(0)
        elif leaf in ROWWISE:
            on_tp = Shard(1)
        else:
            on_tp = Replicate()
        on_dp = Shard(1) if on_tp == Shard(0) and len(shape) > 1 else Shard(0)
        out[f] = tuple(
            on_dp if d == dp else on_tp if d == tp else Replicate() for d in range(len(names))
        )
    return out
