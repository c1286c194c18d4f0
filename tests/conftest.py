"""Fixtures shared by the tests.

* `fake_world` — `with fake_world(n):` runs the block inside a fake process group of world
  size `n` (one process; collectives do nothing), e.g. to plan a cluster-sized mesh.
* `module_fake_world` — one fake process group for a whole test module, of the module's
  `FAKE_WORLD_SIZE` (default 4); use it with
  `pytestmark = pytest.mark.usefixtures("module_fake_world")`.
* `train_on_ranks` — `train_on_ranks(nproc, args)` trains the debug Llama 3 (the harness's
  fast settings, then `args`) on `nproc` gloo ranks into the test's `tmp_path` (or
  `folder=`) and returns the checked `Run` (losses, output, dump folder).
* the `slow` mark — set on every test under `integration_tests/` (they start real torchrun
  jobs), so `pytest -m "not slow"` is the fast loop.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

_INTEGRATION = Path(__file__).parent / "integration_tests"


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()  # later tests expect no process group


@pytest.fixture
def fake_world():
    return _fake_process_group


@pytest.fixture(scope="module")
def module_fake_world(request):
    size = getattr(request.module, "FAKE_WORLD_SIZE", 4)
    with _fake_process_group(size):
        yield size


@pytest.fixture
def train_on_ranks(tmp_path):
    from harness import run_training  # tests/integration_tests, on pytest's pythonpath

    def train(nproc: int, args, folder: Path | None = None, **kwargs):
        return run_training(nproc, list(args), folder or tmp_path, **kwargs).check()

    return train


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
