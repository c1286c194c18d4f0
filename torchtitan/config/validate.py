"""Value checks a parsed `JobConfig` must pass before any rank starts.

The parser (`manager.py`) guarantees types; this module guarantees ranges and the
relations between options (warm-up within the run, a decay phase that fits).  Each
failure is a `ConfigError` naming the option, the value and what would be accepted.
Checks that need more than the config (the mesh, the model, files on disk) live with
the code that knows those things and are called by `torchtitan.preflight`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError
from torchtitan.distributed.parallel_dims import AUTO
from torchtitan.tools.logging import logger


def _option(section: str, key: str, obj: Any) -> tuple[str, Any]:
    return f"--{section}.{key}", getattr(obj, key)


def _at_least(obj: Any, section: str, key: str, low: int, *, or_value: int | None = None) -> None:
    name, value = _option(section, key, obj)
    if value == or_value or value >= low:
        return
    allowed = f"{or_value} or an integer >= {low}" if or_value is not None else f">= {low}"
    raise ConfigError(f"{name}: must be {allowed}, got {value}")


def _number_in(
    obj: Any,
    section: str,
    key: str,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    name, value = _option(section, key, obj)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isfinite(value) and not too_low and not too_high:
        return
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    raise ConfigError(f"{name}: must be a finite number in {left}{low}, {high}{right}, got {value}")


def _check_training(cfg: JobConfig) -> None:
    t = cfg.training
    for key in ("local_batch_size", "seq_len", "steps", "gc_freq"):
        _at_least(t, "training", key, 1)
    _at_least(t, "training", "global_batch_size", 1, or_value=-1)
    _at_least(t, "training", "stop_at_step", 1, or_value=-1)
    if not math.isfinite(t.max_norm):
        raise ConfigError(f"--training.max_norm: must be a finite number, got {t.max_norm}")


def _check_pipeline(cfg: JobConfig) -> None:
    p = cfg.parallelism
    if p.pipeline_parallel_degree not in (1, AUTO):
        _at_least(p, "parallelism", "pipeline_parallel_degree", 1)


def _check_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    _number_in(o, "optimizer", "lr", 0.0, math.inf, high_open=True)
    _number_in(o, "optimizer", "beta1", 0.0, 1.0, high_open=True)
    _number_in(o, "optimizer", "beta2", 0.0, 1.0, high_open=True)
    _number_in(o, "optimizer", "eps", 0.0, math.inf, low_open=True, high_open=True)
    _number_in(o, "optimizer", "weight_decay", 0.0, math.inf, high_open=True)


def _check_schedule(cfg: JobConfig) -> None:
    s, steps = cfg.lr_scheduler, cfg.training.steps
    _at_least(s, "lr_scheduler", "warmup_steps", 0)
    if s.warmup_steps > steps:  # e.g. a one-step smoke test of a config that warms up
        logger.warning(
            f"--lr_scheduler.warmup_steps {s.warmup_steps} is longer than the run "
            f"(--training.steps {steps}): warming up over the whole run instead, so the lr "
            "never reaches --optimizer.lr"
        )
    _number_in(s, "lr_scheduler", "min_lr_factor", 0.0, 1.0)
    if s.decay_ratio is not None:
        _number_in(s, "lr_scheduler", "decay_ratio", 0.0, 1.0)


def _check_outputs(cfg: JobConfig) -> None:
    _at_least(cfg.checkpoint, "checkpoint", "interval", 1)
    _at_least(cfg.checkpoint, "checkpoint", "keep_latest_k", 0)
    _at_least(cfg.checkpoint, "checkpoint", "load_step", 0, or_value=-1)
    _at_least(cfg.metrics, "metrics", "log_freq", 1)
    _at_least(cfg.metrics, "metrics", "count_collectives_step", 0)
    _number_in(
        cfg.metrics, "metrics", "cpu_peak_tflops", 0.0, math.inf, low_open=True, high_open=True
    )
    _at_least(cfg.comm, "comm", "init_timeout_seconds", 1)
    _at_least(cfg.comm, "comm", "train_timeout_seconds", 1)
    limit = cfg.compile.reorder_prefetch_limit
    if limit is not None and limit < 0:
        raise ConfigError(f"--compile.reorder_prefetch_limit: must be none or >= 0, got {limit}")


def validate_job_config(cfg: JobConfig) -> None:
    """Raise `ConfigError` for the first option whose value no run could use."""
    _check_training(cfg)
    _check_pipeline(cfg)
    _check_optimizer(cfg)
    _check_schedule(cfg)
    _check_outputs(cfg)
    for f in dataclasses.fields(cfg):  # an experiment's section checks itself (and its
        validate_section = getattr(getattr(cfg, f.name), "validate", None)  # ties to others)
        if callable(validate_section):
            validate_section(cfg)
