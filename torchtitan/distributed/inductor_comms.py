"""Inductor's communication passes (bucketing, reordering), set from `[compile]` in one place.

Inductor's knobs move between torch releases, so each value is checked against the
installed torch before anything is set: an unknown value or pass name is a
`UserInputError` listing what this torch accepts.  With the defaults nothing is touched.
"""

from __future__ import annotations

import typing
from typing import Any

from torchtitan.config.job_config import Compile
from torchtitan.errors import UserInputError
from torchtitan.tools.logging import logger


def _choices(inductor_config, key: str) -> tuple[str, ...] | None:
    entry = inductor_config._config.get(key)
    if entry is None:
        return None
    return typing.get_args(entry.value_type) or None


def _require_key(inductor_config, key: str, flag: str) -> None:
    if key not in inductor_config._config:
        raise UserInputError(f"{flag}: this torch's inductor has no {key!r} setting")


def inductor_settings(compile_config: Compile) -> dict[str, Any]:
    """The inductor config values the `[compile]` knobs ask for, validated; {} for defaults."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    settings: dict[str, Any] = {}
    for key in ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx"):
        value = getattr(compile_config, key)
        if value == "none":
            continue
        flag = f"--compile.{key}"
        _require_key(inductor_config, key, flag)
        allowed = _choices(inductor_config, key)
        if allowed and value not in allowed:
            raise UserInputError(f"{flag}: {value!r} is not one of {', '.join(allowed)}")
        settings[key] = value

    passes = list(compile_config.reorder_for_compute_comm_overlap_passes)
    if passes and not compile_config.reorder_for_compute_comm_overlap:
        raise UserInputError(
            "--compile.reorder_for_compute_comm_overlap_passes needs "
            "--compile.reorder_for_compute_comm_overlap"
        )
    for name in passes:
        if not callable(getattr(comms, name, None)) or name.startswith("_"):
            known = sorted(
                n
                for n in (
                    "sink_waits",
                    "sink_waits_iterative",
                    "raise_comms",
                    "reorder_compute_for_overlap",
                    "reorder_communication_preserving_peak_memory",
                )
                if callable(getattr(comms, n, None))
            )
            raise UserInputError(
                f"--compile.reorder_for_compute_comm_overlap_passes: unknown pass {name!r}; "
                f"this torch offers {', '.join(known)}"
            )
    if compile_config.reorder_for_compute_comm_overlap:
        _require_key(
            inductor_config,
            "reorder_for_compute_comm_overlap",
            "--compile.reorder_for_compute_comm_overlap",
        )
        settings["reorder_for_compute_comm_overlap"] = True
        settings["reorder_for_compute_comm_overlap_passes"] = passes
        # Reordering moves buffer lifetimes; inductor's buffer reuse assumes the old order.
        settings["allow_buffer_reuse"] = False
    if compile_config.reorder_prefetch_limit is not None:
        if compile_config.reorder_prefetch_limit < 0:
            raise UserInputError(
                "--compile.reorder_prefetch_limit must be >= 0, "
                f"got {compile_config.reorder_prefetch_limit}"
            )
        settings["reorder_prefetch_limit"] = compile_config.reorder_prefetch_limit
    if compile_config.force_disable_caches:
        settings["force_disable_caches"] = True
    return settings


def apply_inductor_comms_knobs(compile_config: Compile) -> dict[str, Any]:
    """Validate and set the knobs on torch._inductor.config; returns what was set."""
    settings = inductor_settings(compile_config)
    if settings:
        import torch._inductor.config as inductor_config

        for key, value in settings.items():
            setattr(inductor_config, key, value)
        logger.info(f"inductor comms settings: {settings}")
    return settings
