"""Typed description of a training job.

One dataclass per TOML section. Every field has a default and a docstring
(the string literal right below it); `ConfigManager` reads those strings from
the source and shows them in `--help`, so adding a field here is all that is
needed to make it settable from TOML and the command line.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class Job:
    """Where the run writes its outputs and how it describes itself."""

    config_file: str | None = None
    """TOML file with settings for this job. Values given on the command line override it."""

    dump_folder: str = "./outputs"
    """Root folder for everything the run writes (checkpoints, TensorBoard logs, traces)."""

    description: str = "torchtitan training job"
    """Free-form description, printed at start-up."""

    custom_config_module: str = ""
    """Module whose `JobConfig` dataclass adds sections of an experiment's own, e.g.
    torchtitan.experiments.auto_parallel.job_config for the planner's [autoparallel]."""

    print_config: bool = False
    """Print the fully resolved config (as TOML) when the trainer starts."""


@dataclass
class Model:
    """Which model to build (looked up in the TrainSpec registry)."""

    name: str = "llama3"
    """Registered model (TrainSpec) name."""

    flavor: str = "debugmodel"
    """Size/variant of the model, a key of the TrainSpec's config table (e.g. debugmodel, 8B)."""

    tokenizer_path: str = "./tests/assets/tokenizer"
    """Folder (or file) holding the tokenizer."""


@dataclass
class Optimizer:
    """Optimizer and its hyper-parameters."""

    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warm-up."""

    beta1: float = 0.9
    """Adam beta1: decay rate of the first-moment (momentum) estimate."""

    beta2: float = 0.95
    """Adam beta2: decay rate of the second-moment estimate."""

    eps: float = 1e-8
    """Adam epsilon, added to the denominator for numerical stability."""

    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW, L2 penalty for Adam)."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Kernel strategy: for-loop (one param at a time), foreach (multi-tensor ops) or fused
    (one kernel over all parameters, torchtitan's default: the fastest on CPU and GPU; on
    DTensor parameters its first step propagates half the shardings foreach's does; not
    available for every device/dtype)."""


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warm-up, optional stable phase, then decay."""

    warmup_steps: int = 200
    """Steps of linear warm-up from near zero to optimizer.lr."""

    decay_ratio: float | None = None
    """None: decay starts right after warm-up. Otherwise warmup-stable-decay (WSD): hold the
    peak lr, then decay over the last `decay_ratio` fraction of training.steps."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = 0.0
    """Final lr as a fraction of optimizer.lr (0.0 decays to zero)."""


@dataclass
class Training:
    """Data, batch shape, step count and numerics of the training loop."""

    dataset: str = "titan_corpus"
    """Registered dataset name."""

    dataset_path: str | None = None
    """Local path of the dataset; none uses the registered default location."""

    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks. -1 means local_batch_size x data-parallel
    degree; a larger multiple of that turns on gradient accumulation."""

    seq_len: int = 2048
    """Tokens per training sequence."""

    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 or negative disables clipping)."""

    steps: int = 10000
    """Number of optimizer steps to train for."""

    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of parameters in forward/backward under FSDP; weights and optimizer state stay
    float32. auto = bfloat16 on GPU, float32 on CPU."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which gradients are reduced across data-parallel ranks."""

    gc_freq: int = 50
    """Run Python garbage collection every N steps (automatic GC is disabled to avoid stalls)."""

    seed: int | None = None
    """Random seed for model init and data order; none picks a fresh seed."""

    deterministic: bool = False
    """Use deterministic algorithms (slower; for debugging and bit-exact comparisons)."""

    stop_at_step: int = -1
    """Exit cleanly after this step (and its checkpoint save), as if the job had been
    interrupted there; for tests and pre-emption drills. -1 runs all `steps`."""


@dataclass
class Parallelism:
    """How the world is split into a device mesh. The product of all degrees equals the world
    size."""

    data_parallel_replicate_degree: int | Literal["auto"] = 1
    """Number of model replicas (DDP, or the replicate dimension of HSDP); auto: chosen by
    the mesh search (see tensor_parallel_degree)."""

    data_parallel_shard_degree: int | Literal["auto"] = -1
    """FSDP shard degree. -1 means whatever is left of the world after the other degrees
    (with the others auto: left to the mesh search, like auto)."""

    tensor_parallel_degree: int | Literal["auto"] = 1
    """Tensor-parallel degree (1 disables TP). auto: the spec plans every mesh the world
    factors into (over the degrees given as auto, and the shard degree when -1) and trains
    on the cheapest that fits (planner specs only). The global batch then stays what a
    pure data-parallel mesh gives (global_batch_size, or local_batch_size x world size) and
    local_batch_size becomes its share per data-parallel rank."""

    expert_parallel_degree: int | Literal["auto"] = 1
    """Split a mixture-of-experts model's routed experts over this many ranks, carved from
    the data-parallel shard ranks (it must divide data_parallel_shard_degree); each rank
    sends its tokens to their experts' ranks by all-to-all.  1 disables it (the planner
    specs then choose the experts' layout themselves); auto: the mesh search also tries
    every degree that divides the shard degree and the experts (planner specs only)."""

    fsdp_reshard_after_forward: Literal["default", "always", "never", "auto"] = "default"
    """Free gathered parameters after forward: always (saves memory), never (saves an
    all-gather in backward), default (always, except for the last block), or auto (the
    auto-parallel planner keeps or gathers again per block, under the memory budget:
    --autoparallel.memory_budget_gib)."""

    disable_loss_parallel: bool = False
    """With TP, compute the loss on the full (gathered) logits instead of sharded logits."""

    pipeline_parallel_degree: int | Literal["auto"] = 1
    """Pipeline-parallel degree: the model's blocks split into consecutive stages over this
    many ranks (the outermost mesh dim), microbatches flowing through them by the schedule
    below; 1 disables it.  Specs that know their model's split only (llama3,
    llama3_auto_parallel).  auto: the mesh search also tries every pipeline degree the
    world, the blocks and the batch allow, pricing the schedule's bubble and sends
    (planner specs only)."""

    pipeline_parallel_schedule: str = "1F1B"
    """The pipelining schedule, by torch.distributed.pipelining's name: one stage per rank
    (GPipe, 1F1B) or several (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble)."""

    pipeline_parallel_microbatch_size: int | Literal["auto"] = 1
    """Sequences per microbatch; it must divide the local batch size, and the schedule
    runs local batch / microbatch size microbatches per step.  auto: the mesh search tries
    every size that divides the local batch into at least as many microbatches as there
    are pipeline ranks (fewer would leave a rank idle all step) and keeps the fastest."""

    pipeline_parallel_split_points: str = ""
    """Where stages start, as comma-separated positions of blocks (e.g. 2,4: blocks 0-1,
    2-3, 4-5); empty: by layers per stage below."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Blocks per pipeline stage (it must divide the blocks); none: the blocks split as
    evenly as they go over the stages the schedule runs (one per rank, or two for the
    schedules with several), the middle stages taking any left over."""


@dataclass
class Checkpoint:
    """Saving and resuming (distributed checkpoints)."""

    enable: bool = False
    """Save checkpoints and resume from the latest one in `folder`."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 500
    """Save every N steps (a final checkpoint is also saved at the last step)."""

    keep_latest_k: int = 10
    """Keep only the newest K checkpoints (0 keeps all)."""

    initial_load_path: str | None = None
    """Checkpoint to start from when `folder` holds none (e.g. converted pretrained weights)."""

    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path (no optimizer, scheduler or step).
    Use --checkpoint.no_initial_load_model_only for a full resume."""

    last_save_model_only: bool = False
    """Make the final checkpoint weights-only (smaller, for export/inference)."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of a model-only final checkpoint."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """async writes checkpoints in the background so training continues meanwhile."""

    load_step: int = -1
    """Step to resume from; -1 means the latest available."""


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: Literal["none", "selective", "full", "auto"] = "selective"
    """none, selective (per `selective_ac_option`) or full (every transformer block); auto
    (the auto-parallel specs only): the planner chooses per block under the memory budget
    (`--autoparallel.memory_budget_gib`)."""

    selective_ac_option: str = "2"
    """For selective mode: an integer N checkpoints every Nth block; "op" saves the outputs of
    expensive ops (matmuls, attention) and recomputes the rest."""


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = False
    """Compile the components listed in `components`."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile, comma-separated on the command line: model (per block), loss."""

    # Inductor communication passes.  Applied in one place before anything is compiled
    # (torchtitan.distributed.inductor_comms) and checked against the installed torch.
    # The defaults leave inductor exactly as it is.

    bucket_all_gathers_fx: str = "none"
    """Merge all-gathers in compiled graphs into fewer, larger ones: none, all, or only_fsdp
    (only parameter all-gathers) — the values inductor's `bucket_all_gathers_fx` accepts."""

    bucket_reduce_scatters_fx: str = "none"
    """Merge reduce-scatters in compiled graphs: none or all (inductor's
    `bucket_reduce_scatters_fx`)."""

    reorder_for_compute_comm_overlap: bool = False
    """Let inductor move collectives and their waits to overlap communication with compute."""

    reorder_for_compute_comm_overlap_passes: list[str] = field(default_factory=list)
    """Scheduler passes run when reordering, in order, e.g.
    reorder_communication_preserving_peak_memory,sink_waits_iterative (names from
    torch._inductor.comms: sink_waits, sink_waits_iterative, raise_comms,
    reorder_compute_for_overlap, reorder_communication_preserving_peak_memory)."""

    reorder_prefetch_limit: int | None = None
    """How many collectives ahead the reordering may issue (None: inductor's default)."""

    force_disable_caches: bool = False
    """Make inductor recompile and re-run its passes every time (no FX-graph or kernel cache);
    use when experimenting with the passes above, since a cached graph skips them."""


@dataclass
class Metrics:
    """Logging of loss, throughput and memory."""

    log_freq: int = 10
    """Log metrics every N steps."""

    enable_tensorboard: bool = False
    """Write TensorBoard event files."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    disable_color_printing: bool = False
    """Plain console logs without ANSI colours."""

    count_collectives_step: int = 0
    """Count the collectives of this training step with torch.profiler (its `gloo:`/`nccl:`
    events on rank 0), log them and write `comm/collectives` to TensorBoard; 0 = never.
    The profiler slows that one step."""

    cpu_peak_tflops: float = 1.0
    """Peak dense TFLOP/s assumed for MFU when training on CPU (there is no table of CPU peaks).
    MFU = achieved model FLOP/s / this peak, so set it to your CPU's figure for a meaningful MFU;
    GPU peaks are looked up from the device name."""


@dataclass
class Comm:
    """Collective-communication timeouts."""

    init_timeout_seconds: int = 300
    """Timeout for collectives during initialisation (first checkpoint load, warm-up)."""

    train_timeout_seconds: int = 100
    """Timeout for collectives once training has started; a hang fails after this long."""


@dataclass
class Experimental:
    """Hooks for code living outside the core package."""

    custom_import: str = ""
    """Module imported at start-up, e.g. one that registers an extra TrainSpec."""


@dataclass
class JobConfig:
    """Root of the config: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    experimental: Experimental = field(default_factory=Experimental)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict of every value."""
        return asdict(self)
