"""The training loop: build everything from a JobConfig through the model's TrainSpec.

Nothing here knows which model or which parallelism runs: the TrainSpec supplies the
model class, its `parallelize_fn` and the builders; the loop only follows the contract
meta build → parallelize → `to_empty` → `init_weights` → optimizer → steps.

Run with `python -m torchtitan.train --job.config_file ...` under torchrun
(`run_train.sh` does this).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.divergence import check_finite
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.preemption import Preemption
from torchtitan.config import JobConfig, main_parse, to_toml
from torchtitan.config.job_config import Comm
from torchtitan.config.resolve import resolve, resolve_model_args, search_mesh
from torchtitan.config.validate import validate_job_config
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.inductor_comms import apply_inductor_comms_knobs
from torchtitan.distributed.init_check import every_value_initialised
from torchtitan.distributed.parallel_dims import mesh_search_requested
from torchtitan.distributed.pipeline import PipelineStages, split_stages, stage_io
from torchtitan.errors import UserInputError
from torchtitan.exact_init import exact_sharded_init
from torchtitan.protocols.model import ModelProtocol
from torchtitan.protocols.train_spec import MeshChoice, get_train_spec, import_custom_module
from torchtitan.tools import rank_errors
from torchtitan.tools.collectives import count_collectives
from torchtitan.tools.local_processes import die_with_parent
from torchtitan.tools.logging import init_logger, logger, repeated_warnings_summary


class Trainer:
    """`user_config` is the config as typed (never changed); `job_config` is the resolved
    copy the run uses (`config.resolve`: degrees and batch sizes settled)."""

    def __init__(self, job_config: JobConfig):
        self.user_config = job_config
        validate_job_config(job_config)
        import_custom_module(job_config.experimental.custom_import)
        if job_config.job.print_config and int(os.environ.get("RANK", "0")) == 0:
            print(to_toml(job_config), flush=True)

        world_size = dist_utils.init_distributed(job_config.comm.init_timeout_seconds)
        self.rank = dist.get_rank()
        self.device = torch.device(dist_utils.device_type())
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.train_spec = spec = get_train_spec(job_config.model.name)
        self.tokenizer = spec.build_tokenizer_fn(job_config)
        model_args = resolve_model_args(spec, job_config, self.tokenizer)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        mesh_choice = None  # the spec's mesh search's answer, with the plan it keeps
        if mesh_search_requested(job_config.parallelism):
            mesh_choice = search_mesh(spec, model, model_args, job_config, world_size)
        self.resolved = resolve(spec, job_config, model_args, world_size, mesh_choice)
        if self.rank == 0:
            logger.info(self.resolved.describe(self.user_config))
        self.job_config = job_config = self.resolved.job_config  # what the run uses

        self.parallel_dims = self.resolved.parallel_dims()
        self.parallel_dims.build_mesh(self.device.type)
        self.dp_mesh = self.parallel_dims.dp_mesh()
        dp_degree = self.parallel_dims.dp_degree
        dp_rank = self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
        dist_utils.set_determinism(job_config.training.seed, job_config.training.deterministic)
        self.dataloader = spec.build_dataloader_fn(dp_degree, dp_rank, self.tokenizer, job_config)

        training = job_config.training
        self.grad_accumulation_steps = self.resolved.grad_accumulation_steps
        nparams, flops_per_token = model_args.get_nparams_and_flops(model, training.seq_len)
        logger.info(
            f"{job_config.job.description}: {spec.name} {job_config.model.flavor}, "
            f"{nparams:,} parameters; mesh {self.parallel_dims.world_mesh}"
        )

        apply_inductor_comms_knobs(job_config.compile)  # before anything is compiled
        self.loss_fn = spec.build_loss_fn(job_config)
        self.pipeline: PipelineStages | None = None
        if self.parallel_dims.pp_enabled:
            self.model_parts = self._pipeline_stages(model)
        else:
            self.model_parts = [self._parallel_model(model, mesh_choice)]
        del mesh_choice  # the search's planner and trace are not needed past this point

        self.optimizers = spec.build_optimizers_fn(self.model_parts, job_config)
        self.lr_schedulers = spec.build_lr_schedulers_fn(self.optimizers, job_config)
        self.metrics = MetricsProcessor(
            job_config,
            self.device.type,
            flops_per_token,
            self.parallel_dims.non_data_parallel_size,
            self.rank,
        )
        self.step = 0
        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            job_config=job_config,
        )
        self.preemption = Preemption(job_config.checkpoint.enable, self.device)
        self.gc_freq = training.gc_freq
        gc.disable()  # collected every gc_freq steps on all ranks at once, no stragglers
        logger.info(
            f"training {training.steps} steps: local batch {training.local_batch_size}, "
            f"grad accumulation {self.grad_accumulation_steps}, "
            f"seq_len {training.seq_len}"
        )

    def _parallel_model(self, model: nn.Module, mesh_choice: MeshChoice | None) -> nn.Module:
        """The spec's parallel module of the meta `model`, materialised and initialised with
        single-process values on any mesh."""
        spec, job_config = self.train_spec, self.job_config
        if mesh_choice is not None and mesh_choice.plan is not None:
            # the spec applies the plan its search made for this mesh
            model = spec.parallelize_fn(
                model, self.parallel_dims, job_config, mesh_choice=mesh_choice
            )
        else:
            model = spec.parallelize_fn(model, self.parallel_dims, job_config)
        model.to_empty(device=self.device)
        with torch.no_grad(), exact_sharded_init(model), every_value_initialised(model):
            cast(ModelProtocol, model).init_weights()  # what every spec's model class has
        model.train()
        return model

    def _pipeline_stages(self, model: nn.Module) -> list[nn.Module]:
        """This rank's pipeline stages of the meta `model` (distributed/pipeline.py), each
        parallelised by the spec like a whole model and initialised with the values one
        process gives it; the schedule that runs them is `self.pipeline`."""
        spec, job_config, dims = self.train_spec, self.job_config, self.parallel_dims
        plan, pp_mesh = self.resolved.stage_plan, dims.pp_mesh()
        # resolve() made the stage plan, having checked that the spec names a split
        assert plan is not None and spec.pipeline_split is not None and pp_mesh is not None
        microbatch = self.resolved.local_batch_size // plan.microbatches
        tokens = torch.zeros(microbatch, job_config.training.seq_len, dtype=torch.long)
        io = stage_io(model, spec.pipeline_split, plan, tokens, dims.pp)
        pipeline = split_stages(model, spec.pipeline_split, plan, pp_mesh.get_local_rank(), dims.pp)
        cuda = [self.device.index] if self.device.type == "cuda" else []
        for i, part in enumerate(pipeline.parts):
            part = spec.parallelize_fn(part, dims, job_config, stage=io[pipeline.stage_ids[i]])
            pipeline.parts[i] = part
            part.to_empty(device=self.device)
            last = i == len(pipeline.parts) - 1  # every part draws from the same state
            with (
                contextlib.nullcontext() if last else torch.random.fork_rng(devices=cuda),
                torch.no_grad(),
                every_value_initialised(part, reduce=False),  # stages differ in their values
                pipeline.whole_model(i, self.device) as whole,
                exact_sharded_init(whole),
            ):
                cast(ModelProtocol, whole).init_weights()
            part.train()
        grad_accumulation = self.resolved.grad_accumulation_steps

        def microbatch_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # the schedule averages the microbatches' gradients itself (scale_grads)
            return self.loss_fn(pred, labels) / grad_accumulation

        pipeline.start(self.device, pp_mesh.get_group(), microbatch_loss)
        logger.info(f"pipeline: {plan.describe()}; this rank holds stages {pipeline.stage_ids}")
        self.pipeline = pipeline
        return pipeline.parts

    def state_dict(self) -> dict[str, Any]:
        """The loop's own checkpointed state (plain values only)."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])

    def batches(self):
        """Endless (inputs, labels) on the training device, counting tokens."""
        while True:
            for inputs, labels in self.dataloader:
                self.metrics.count_tokens(labels.numel())
                yield inputs["input"].to(self.device), labels.to(self.device)

    def train_context(self):
        """Vocabulary-parallel cross-entropy when the logits come out split along the vocab."""
        if self.parallel_dims.loss_parallel_enabled:
            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, data_iter) -> tuple[float, float, float]:
        self.optimizers.zero_grad()
        step_loss = torch.zeros((), device=self.device)
        for _ in range(self.grad_accumulation_steps):
            tokens, labels = next(data_iter)
            with self.train_context():
                if self.pipeline is not None:
                    losses = self.pipeline.step(tokens, labels)
                    loss = torch.stack([_full(x) for x in losses]).mean() if losses else None
                else:
                    loss = self.loss_fn(self.model_parts[0](tokens), labels)
                    loss = loss / self.grad_accumulation_steps
                    loss.backward()
            if loss is not None:
                step_loss += _full(loss).detach()
        if self.pipeline is not None:  # the loss is on the last stage's ranks: share it
            step_loss = dist_utils.pipeline_sum(step_loss, self.parallel_dims.pp_mesh())
        grad_norm = dist_utils.clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.job_config.training.max_norm,
            pp_mesh=self.parallel_dims.pp_mesh(),
        )
        avg = dist_utils.dist_reduce(step_loss, "avg", self.dp_mesh)
        mx = dist_utils.dist_reduce(step_loss, "max", self.dp_mesh)
        check_finite(
            self.step,
            avg,
            float(grad_norm),
            self.checkpointer.newest,
            self.checkpointer.enable,
        )
        self.optimizers.step()
        self.lr_schedulers.step()
        return avg, mx, float(grad_norm)

    def train(self) -> None:
        cfg = self.job_config
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart:
            logger.warning(
                f"restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} after "
                "a failure: resuming from the newest intact checkpoint"
            )
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        if self.step >= cfg.training.steps:
            logger.warning(
                f"nothing to do: resumed at step {self.step} and --training.steps is "
                f"{cfg.training.steps}; raise --training.steps to train further"
            )
        data_iter = self.batches()
        while self.step < cfg.training.steps:
            self.step += 1
            if self.step % self.gc_freq == 0:
                gc.collect(1)
            lr = self.lr_schedulers.get_last_lr()
            counting = self.step == cfg.metrics.count_collectives_step
            with count_collectives(counting) as counts, _timeout_explained(self.step, cfg.comm):
                loss, max_loss, grad_norm = self.train_step(data_iter)
            if self.step == 1:  # compiling and planning are done: bound every later wait
                dist_utils.set_collective_timeout(cfg.comm.train_timeout_seconds)
            if counting:
                self.metrics.log_collectives(self.step, counts)
            if (
                self.step == 1
                or self.step % cfg.metrics.log_freq == 0
                or self.step == cfg.training.steps
            ):
                self.metrics.log(self.step, loss, max_loss, grad_norm, lr)
            preempted = self.preemption.agreed()
            last = self.step == cfg.training.steps
            self.checkpointer.save(self.step, last_step=last, force=preempted)
            if preempted:
                logger.warning(
                    f"preempted (SIGTERM): stopped after step {self.step} with a checkpoint; "
                    "the next launch resumes from it"
                )
                break
            if self.step == cfg.training.stop_at_step:
                logger.info(f"stopping after step {self.step} (--training.stop_at_step)")
                break
        logger.info("training completed")

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


def _full(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain scalar (loss parallelism makes it a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class CollectiveTimeoutError(RuntimeError):
    pass


@contextlib.contextmanager
def _timeout_explained(step: int, comm: Comm):
    """Name the option behind a collective that timed out once training runs."""
    try:
        yield
    except RuntimeError as e:  # gloo raises a plain RuntimeError, NCCL a DistBackendError
        if step > 1 and "timed out" in str(e).lower():
            raise CollectiveTimeoutError(
                f"step {step}: a collective waited longer than --comm.train_timeout_seconds "
                f"{comm.train_timeout_seconds}; another rank stalled or died"
            ) from e
        raise


def main(argv: list[str] | None = None) -> None:
    init_logger()
    job_config = main_parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    _die_with_launcher()
    if (folder := rank_errors.error_dir()) is not None:
        rank_errors.clear_own_report(folder, rank)  # from an attempt before a restart
    try:
        trainer = Trainer(job_config)
        trainer.train()
        trainer.close()
        if summary := repeated_warnings_summary():
            logger.warning(summary)
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so in one line
        _exit(128 + signal.SIGINT)
    except Exception as e:
        folder = rank_errors.error_dir()
        if folder is not None:  # the launcher prints one line for the whole job
            rank_errors.write_report(e, rank, folder)
            _exit(2)
        if not isinstance(e, UserInputError):
            raise
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        _exit(2)
    # gloo ranks can abort in teardown after all work is done; leave in lockstep, flushed.
    dist.barrier()
    _exit(0)


def _die_with_launcher() -> None:
    """Under the launcher, end this rank when the launcher dies (even by SIGKILL), rather
    than train on unsupervised: torchrun starts ranks in their own session, so nothing
    else reaches them.  Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    if rank_errors.error_dir() is not None and not die_with_parent(os.getppid()):
        _exit(1)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
