"""The parallelism degrees of a job and the device mesh they describe."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.errors import UserInputError


class ParallelismConfigError(UserInputError):
    pass


AUTO = "auto"
DEGREES = (  # (ParallelDims field, its --parallelism option), outermost mesh dim first
    ("pp", "pipeline_parallel_degree"),
    ("dp_replicate", "data_parallel_replicate_degree"),
    ("dp_shard", "data_parallel_shard_degree"),
    ("tp", "tensor_parallel_degree"),
)


EP_OPTION = "expert_parallel_degree"


def mesh_search_requested(parallelism) -> bool:
    """Whether any degree is `auto` (left to the spec's mesh search)."""
    options = [option for _, option in DEGREES] + [EP_OPTION]
    return any(getattr(parallelism, option, 1) == AUTO for option in options)


def expert_parallel_candidates(dp_shard: int, routed_experts: int, setting) -> list[int]:
    """The expert-parallel degrees a mesh search tries with this shard degree: the given one,
    or for `auto` every degree dividing both the shard ranks and the experts (1 included)."""
    if setting != AUTO:
        return [setting] if dp_shard % setting == 0 else []
    if routed_experts == 0:
        return [1]
    return [d for d in range(1, dp_shard + 1) if dp_shard % d == 0 and routed_experts % d == 0]


def open_degrees(parallelism) -> dict[str, int | None]:
    """Each degree by ParallelDims name: its size, or None when a mesh search chooses it
    (`auto`, and the shard degree's -1, whatever is left; called when some degree is auto)."""
    out: dict[str, int | None] = {}
    for name, option in DEGREES:
        value = getattr(parallelism, option)
        out[name] = None if value == AUTO or (name == "dp_shard" and value == -1) else value
    return out


def check_search_degrees(parallelism, world_size: int) -> None:
    """The degrees a mesh search keeps must be sizes (>= 1) whose product divides the world."""
    fixed = 1
    for name, option in DEGREES:
        size = open_degrees(parallelism)[name]
        if size is None:
            continue
        if size < 1:
            allowed = "auto, -1 or >= 1" if name == "dp_shard" else "auto or >= 1"
            raise ParallelismConfigError(f"--parallelism.{option} must be {allowed}, got {size}")
        fixed *= size
    if world_size % fixed:
        raise ParallelismConfigError(
            f"the fixed parallelism degrees multiply to {fixed}, which does not divide the "
            f"world size {world_size}; leave more of them to the search (auto)"
        )


def tensor_parallel_misfits(
    sizes: Mapping[str, int], tp: int, seq_len: int, loss_parallel: bool
) -> list[str]:
    """The one rule for a tensor-parallel degree: `tp` must divide the model's split sizes
    (`BaseModelArgs.tensor_parallel_sizes`: heads, kv-heads, hidden sizes; the vocabulary
    only when the loss is vocabulary-parallel) and the sequence (sequence parallelism).
    Returns "name size" for each it does not divide ([] when it fits; always for tp 1)."""
    sizes = dict(sizes)
    if tp == 1 or not loss_parallel:
        sizes.pop("vocab_size", None)
    sizes["training.seq_len"] = seq_len
    return [f"{name} {size}" for name, size in sizes.items() if size % tp]


EP = "ep"  # the mesh dim of expert parallelism: the inner part of the shard ranks


def mesh_dims(
    dp_replicate: int, dp_shard: int, tp: int, ep: int = 1, pp: int = 1
) -> list[tuple[str, int]]:
    """(name, size) of the mesh dims a job with these degrees has: those of size > 1, and a
    `dp_shard` dim of size 1 when no other is (one rank, or pipeline stages only: the
    stages' own meshes; uniform code paths).  With expert
    parallelism the shard ranks are two dims, `dp_shard` (dp_shard / ep) and `ep`; pipeline
    stages are the outermost dim, `pp`."""
    sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard // ep, EP: ep, "tp": tp}
    order = ("pp", "dp_replicate", "dp_shard", EP, "tp")
    dims = [(name, sizes[name]) for name in order if sizes[name] > 1]
    if all(name == "pp" for name, _ in dims):
        dims.append(("dp_shard", 1))
    return dims


def is_data_dim(name: str) -> bool:
    """Mesh dims that split the batch: the data-parallel ones and expert parallelism's."""
    return name.startswith("dp_") or name == EP


@dataclass
class ParallelDims:
    """Degrees from `[parallelism]`, validated against the world size.

    Mesh dimensions, outermost first: `pp` (pipeline stages), `dp_replicate` (HSDP/DDP
    replicas), `dp_shard` (FSDP), `tp`.  Only dimensions of size > 1 appear in the mesh.
    Flattened views: `dp` (all data-parallel ranks: data loading and loss averaging) and,
    for HSDP, both data dims side by side for `fully_shard`.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    enable_loss_parallel: bool = True
    ep: int = 1
    pp: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat_dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat_shard_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name, degree in (
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("tp", self.tp),
            ("ep", self.ep),
        ):
            if degree == AUTO:
                option = {**dict(DEGREES), "ep": EP_OPTION}[name]
                raise ParallelismConfigError(
                    f"--parallelism.{option} auto: no mesh search chose it; give a number"
                )
        for name, degree in (
            ("data_parallel_replicate_degree", self.dp_replicate),
            ("tensor_parallel_degree", self.tp),
            ("pipeline_parallel_degree", self.pp),
        ):
            if degree < 1:
                raise ParallelismConfigError(f"--parallelism.{name} must be >= 1, got {degree}")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp * self.pp
            if self.world_size % rest:
                pp = f"pipeline_parallel_degree {self.pp} × " if self.pp > 1 else ""
                raise ParallelismConfigError(
                    f"world size {self.world_size} is not divisible by {pp}"
                    f"data_parallel_replicate_degree {self.dp_replicate} × "
                    f"tensor_parallel_degree {self.tp} = {rest}"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ParallelismConfigError(
                f"--parallelism.data_parallel_shard_degree must be -1 or >= 1, got {self.dp_shard}"
            )
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ParallelismConfigError(
                f"--parallelism.expert_parallel_degree {self.ep} must divide "
                f"data_parallel_shard_degree {self.dp_shard} (expert-parallel ranks are carved "
                "from the shard ranks)"
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            pp = f"pp {self.pp} × " if self.pp > 1 else ""
            raise ParallelismConfigError(
                f"parallelism degrees multiply to {product} "
                f"({pp}replicate {self.dp_replicate} × shard {self.dp_shard} × tp {self.tp}) "
                f"but the world size is {self.world_size}; make them multiply to "
                f"{self.world_size} or set --parallelism.data_parallel_shard_degree -1"
            )

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            tp=parallelism.tensor_parallel_degree,
            world_size=world_size,
            enable_loss_parallel=not parallelism.disable_loss_parallel,
            ep=parallelism.expert_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        dims = mesh_dims(self.dp_replicate, self.dp_shard, self.tp, self.ep, self.pp)
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        dp_names = tuple(n for n in names if is_data_dim(n))
        if len(dp_names) > 1:
            self._flat_dp_mesh = mesh[dp_names]._flatten("dp")
        shard_names = tuple(n for n in names if n in ("dp_shard", EP))
        if len(shard_names) > 1:
            self._flat_shard_mesh = mesh[shard_names]._flatten("dp_shard_ep")
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh_names(self) -> tuple[str, ...]:
        names = self.world_mesh.mesh_dim_names or ()
        return tuple(n for n in names if is_data_dim(n))

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: the shard ranks (one dim, flattened with expert
        parallelism's), after the replicate dim for HSDP."""
        mesh = self.world_mesh
        names = mesh.mesh_dim_names or ()
        shard = (
            "dp_shard_ep"
            if self._flat_shard_mesh is not None
            else (EP if EP in names else "dp_shard")
        )
        if "dp_replicate" in names:
            return mesh[("dp_replicate", shard)]
        return mesh[shard]

    def pp_mesh(self) -> DeviceMesh | None:
        """The pipeline ranks holding this rank's part of the model's other stages (None
        without pipeline parallelism)."""
        return self.world_mesh["pp"] if self.pp > 1 else None

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel ranks as one 1-D mesh (None when there is no data parallelism)."""
        names = self.dp_mesh_names
        if not names:
            return None
        return self._flat_dp_mesh if len(names) > 1 else self.world_mesh[names[0]]

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    def check_tensor_parallel_sizes(self, sizes: dict[str, int], seq_len: int, model: str) -> None:
        """Refuse a tp degree that breaks `tensor_parallel_misfits`, naming the degrees of
        this world that fit."""
        bad = tensor_parallel_misfits(sizes, self.tp, seq_len, self.enable_loss_parallel)
        if not bad:
            return
        fits = [
            d
            for d in range(1, self.world_size + 1)
            if self.world_size % d == 0
            and not tensor_parallel_misfits(sizes, d, seq_len, self.enable_loss_parallel)
        ]
        raise ParallelismConfigError(
            f"--parallelism.tensor_parallel_degree {self.tp} does not divide "
            f"{', '.join(bad)} of {model}; use one that divides them all and the world size "
            f"{self.world_size}: {', '.join(map(str, fits))}"
        )

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one sample stream (used to report tokens/s per rank)."""
        return self.tp * self.pp
