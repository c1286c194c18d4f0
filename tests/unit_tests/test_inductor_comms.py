"""[compile] comms knobs: defaults touch nothing, values are checked against this torch."""

import pytest
import torch._inductor.config as inductor_config

from torchtitan.config import ConfigManager
from torchtitan.distributed.inductor_comms import apply_inductor_comms_knobs, inductor_settings
from torchtitan.errors import UserInputError


def _compile_config(*args):
    return ConfigManager().parse_args(list(args)).compile


def test_defaults_change_nothing():
    assert inductor_settings(_compile_config()) == {}


def test_knobs_map_to_inductor_settings():
    cfg = _compile_config(
        "--compile.bucket_all_gathers_fx",
        "all",
        "--compile.bucket_reduce_scatters_fx",
        "all",
        "--compile.reorder_for_compute_comm_overlap",
        "--compile.reorder_for_compute_comm_overlap_passes",
        "reorder_communication_preserving_peak_memory,sink_waits_iterative",
        "--compile.reorder_prefetch_limit",
        "2",
        "--compile.force_disable_caches",
    )
    assert inductor_settings(cfg) == {
        "bucket_all_gathers_fx": "all",
        "bucket_reduce_scatters_fx": "all",
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
        ],
        "allow_buffer_reuse": False,
        "reorder_prefetch_limit": 2,
        "force_disable_caches": True,
    }


def test_apply_sets_inductor_config():
    with inductor_config.patch({}):  # restores every key on exit
        apply_inductor_comms_knobs(_compile_config("--compile.bucket_reduce_scatters_fx", "all"))
        assert inductor_config.bucket_reduce_scatters_fx == "all"


def test_unknown_bucket_mode_lists_choices():
    with pytest.raises(
        UserInputError, match=r"--compile.bucket_reduce_scatters_fx: 'fsdp' is not one of none, all"
    ):
        inductor_settings(_compile_config("--compile.bucket_reduce_scatters_fx", "fsdp"))


def test_unknown_pass_lists_what_torch_offers():
    cfg = _compile_config(
        "--compile.reorder_for_compute_comm_overlap",
        "--compile.reorder_for_compute_comm_overlap_passes",
        "sink_waitz",
    )
    with pytest.raises(
        UserInputError, match="unknown pass 'sink_waitz'; this torch offers .*sink_waits_iterative"
    ):
        inductor_settings(cfg)


def test_passes_without_reordering_is_an_error():
    cfg = _compile_config("--compile.reorder_for_compute_comm_overlap_passes", "sink_waits")
    with pytest.raises(UserInputError, match="needs --compile.reorder_for_compute_comm_overlap"):
        inductor_settings(cfg)
