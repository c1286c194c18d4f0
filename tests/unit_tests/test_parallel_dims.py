"""ParallelDims validation messages and mesh layout (fake process group, one process)."""

import pytest

from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismConfigError


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ParallelismConfigError, match=r"multiply to 6 .* world size is 4"):
        ParallelDims(dp_replicate=1, dp_shard=3, tp=2, world_size=4)


def test_shard_minus_one_takes_the_rest_or_says_why_not():
    assert ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, world_size=8).dp_shard == 4
    with pytest.raises(
        ParallelismConfigError, match="not divisible by .* tensor_parallel_degree 3"
    ):
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=3, world_size=4)


def test_bad_degree_named():
    with pytest.raises(ParallelismConfigError, match="tensor_parallel_degree must be >= 1, got 0"):
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=0, world_size=4)


@pytest.fixture
def world8(fake_world):
    with fake_world(8):
        yield


def test_mesh_has_only_dims_above_one_and_flattened_dp(world8):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert dims.dp_mesh().size() == 4
    assert dims.loss_parallel_enabled and dims.non_data_parallel_size == 2
    tp_only = ParallelDims(dp_replicate=1, dp_shard=1, tp=8, world_size=8)
    assert tp_only.build_mesh("cpu").mesh_dim_names == ("tp",)
    assert tp_only.dp_mesh() is None and not tp_only.dp_enabled


def test_pipeline_stages_are_the_outermost_dim(world8):
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, world_size=8, pp=2)
    assert dims.dp_shard == 2
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_shard", "tp")
    assert dims.pp_mesh().size() == 2 and dims.dp_mesh().size() == 2
    assert dims.non_data_parallel_size == 4  # tp x pp ranks share one sample stream
    with pytest.raises(
        ParallelismConfigError, match=r"multiply to 16 \(pp 2 × replicate 1 × shard 4 × tp 2\)"
    ):
        ParallelDims(dp_replicate=1, dp_shard=4, tp=2, world_size=8, pp=2)
    with pytest.raises(ParallelismConfigError, match="pipeline_parallel_degree must be >= 1"):
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=8, pp=0)
