"""The planner's own config section, `[autoparallel]`.

Loaded with `--job.custom_config_module torchtitan.experiments.auto_parallel.job_config`
(or `custom_config_module` under `[job]` in a TOML); without it the planner runs with these
defaults.  `--help` with the module loaded lists the options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config.manager import ConfigError
from torchtitan.errors import UserInputError


@dataclass
class AutoParallelConfig:
    """The auto-parallel planner (llama3_auto_parallel, hf_auto_parallel)."""

    cost_model: str = "auto"
    """Device whose compute and link figures price a plan: auto (the device this job runs
    on: cpu, or the GPU's name among the known ones, h100 figures for others) or a known
    name (cpu, h100, h200, a100, ...)."""

    memory_budget_gib: float | None = None
    """Bytes per rank a plan must fit, in GiB, as the planner's memory model counts them
    (parameters, gradients, optimizer state, saved activations, the largest block's
    recomputation).  none: what a rank has, less 10% for what the model leaves out (a GPU's
    memory; on CPU an equal share of the machine's RAM among the ranks on it).  Within it the
    solver replicates parameters (DDP-like), shards them (FSDP-like) or mixes, per parameter,
    whichever is fastest; with `--activation_checkpoint.mode auto` it recomputes blocks to
    fit, with `--parallelism.fsdp_reshard_after_forward auto` it gathers parameters again in
    the backward of the blocks it chooses."""

    max_parameter_fraction: str = "none"
    """An extra bound on parameter bytes per rank, as a fraction of all parameter bytes:
    none (only the memory budget bounds them), fsdp (1/world: every parameter split as far
    as its shape allows, as FSDP does) or a number in (0, 1]."""

    solver_time_limit_seconds: float = 300.0
    """Stop the solver after this long and take the best plan found so far (the log says
    how far from optimal it may be)."""

    solver_proof_limit_seconds: float = 15.0
    """Once the solver holds a plan near its lower bound, search this long for a cheaper one
    or for the proof that none is more than 0.1% cheaper, then take the best found (the plan
    records the gap it proved)."""

    plan_cache: bool = True
    """Reuse a plan cached under {dump_folder}/plans/ (keyed by the traced graph, mesh,
    constraints, precision and cost model) and cache new ones."""

    pin: str = ""
    """Placements the plan must use, 'PATTERN=PLACEMENTS' entries separated by ';': a glob
    over parameter names and one placement per mesh dim, outermost first (R, S(dim)), e.g.
    'layers.*.feed_forward.w1.weight=S(0),S(0);tok_embeddings.weight=S(0),R' on a
    (dp_shard, tp) mesh.  The solver chooses everything else around them.  Needs fixed
    degrees (no auto)."""

    plan_file: str = ""
    """Train with this plan (JSON) instead of planning: `scripts/plan.py`'s plan.json or a
    plan an earlier run cached under {dump_folder}/plans/, possibly edited by hand.  It is
    checked against the model, mesh and constraints first (a mismatch names the first
    difference); applied as written, or, if its `params` were edited, solved again with
    every parameter where the file puts it.  Needs fixed degrees (no auto)."""

    def validate(self, job_config: Any) -> None:
        from torchtitan.autoparallel.cost.model import DEVICES
        from torchtitan.distributed.parallel_dims import mesh_search_requested
        from torchtitan.experiments.auto_parallel.pins import OPTION, parse_pins
        from torchtitan.experiments.auto_parallel.steering import read_plan_file

        if parse_pins(self.pin) and mesh_search_requested(job_config.parallelism):
            raise ConfigError(
                f"{OPTION}: pins give one placement per mesh dim, so they need a fixed mesh; "
                "give every --parallelism degree instead of auto (or drop the pins)"
            )

        if self.plan_file:
            if mesh_search_requested(job_config.parallelism):
                raise ConfigError(
                    "--autoparallel.plan_file: a plan is made for one mesh; give every "
                    "--parallelism degree instead of auto (or drop the plan file)"
                )
            if parse_pins(self.pin):
                raise ConfigError(
                    f"--autoparallel.plan_file and {OPTION}: a plan file places every "
                    "parameter already; edit its params instead of pinning"
                )
            try:
                read_plan_file(self.plan_file)
            except UserInputError as e:
                raise ConfigError(str(e)) from None

        parameter_fraction(self.max_parameter_fraction, world=1)  # raises if malformed
        if self.cost_model != "auto" and self.cost_model.lower() not in DEVICES:
            raise ConfigError(
                f"--autoparallel.cost_model: unknown device {self.cost_model!r}; "
                f"choose auto or one of {', '.join(sorted(DEVICES))}"
            )
        for name in (
            "memory_budget_gib",
            "solver_time_limit_seconds",
            "solver_proof_limit_seconds",
        ):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--autoparallel.{name}: must be a positive number, got {value}")


def parameter_fraction(option: str, world: int) -> float | None:
    """`--autoparallel.max_parameter_fraction` as a fraction of all parameter bytes, or None
    for no such bound."""
    value = option.strip().lower()
    if value == "none":
        return None
    if value == "fsdp":
        return 1.0 / world
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if not (0.0 < fraction <= 1.0):
        raise ConfigError(
            f"--autoparallel.max_parameter_fraction: {option!r} is not none, fsdp or a number "
            "in (0, 1]"
        )
    return fraction


@dataclass
class JobConfig:
    autoparallel: AutoParallelConfig = field(default_factory=AutoParallelConfig)
