"""Single-process checks of the checkpoint manager: discovery, atomicity, purge, safe loading."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan.components import checkpoint as ckpt
from torchtitan.components.checkpoint import CheckpointManager, SafeLoadPlanner, SafeReader
from torchtitan.errors import UserInputError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Counter:
    """A Stateful holding one plain value."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict):
        self.value = state_dict["value"]


class Loader:
    """Like the real dataloader: its state is JSON bytes."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def state_dict(self):
        return {"dataset": f'{{"pos": {self.pos}}}'.encode()}

    def load_state_dict(self, state_dict):
        self.pos = int(state_dict["dataset"].decode().split(":")[1].rstrip("}"))


def job(tmp_path: Path, **checkpoint) -> SimpleNamespace:
    fields = dict(enable=True, folder="checkpoint", interval=5, keep_latest_k=10, initial_load_path=None,
                  initial_load_model_only=True, last_save_model_only=False, export_dtype="float32",
                  async_mode="disabled", load_step=-1)
    fields.update(checkpoint)
    return SimpleNamespace(job=SimpleNamespace(dump_folder=str(tmp_path)), checkpoint=SimpleNamespace(**fields))


def manager(tmp_path: Path, seed: int = 0, **checkpoint):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    sched, loader, train = Counter(), Loader(), Counter()
    m = CheckpointManager(loader, [model], Counter(), sched, {"train_state": train}, job(tmp_path, **checkpoint))
    return m, model, loader, train


def make_complete(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    dcp.save({"x": torch.tensor([float(step)])}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.delenv(ckpt.KILL_ENV, raising=False)


def test_scan_finds_complete_and_reports_partial(tmp_path):
    for step in (5, 10, 15):
        make_complete(tmp_path, step)
    (tmp_path / "step-15" / ".metadata").unlink()  # interrupted before the metadata
    (tmp_path / "step-20.tmp-abc").mkdir()  # interrupted before the rename
    (tmp_path / "notes").mkdir()
    complete, partial = ckpt.scan_folder(tmp_path)
    assert list(complete) == [5, 10]
    assert sorted(p.name for p in partial) == ["step-15", "step-20.tmp-abc"]
    assert ckpt.scan_folder(tmp_path / "missing") == ({}, [])


def test_purge_keeps_latest_k(tmp_path):
    for step in (1, 2, 3, 10):
        make_complete(tmp_path, step)
    ckpt.purge_old(tmp_path, 0)
    assert len(ckpt.scan_folder(tmp_path)[0]) == 4
    ckpt.purge_old(tmp_path, 2)
    assert list(ckpt.scan_folder(tmp_path)[0]) == [3, 10]  # numeric, not lexical, order


def test_save_load_roundtrip_and_interval(tmp_path):
    m, model, loader, train = manager(tmp_path, keep_latest_k=2)
    saved = {}
    for step in range(1, 13):
        train.value, loader.pos = step, 100 + step
        with torch.no_grad():
            model.weight.add_(1.0)
        saved[step] = model.weight.clone()
        m.save(step, last_step=step == 12)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-10", "step-12"]  # 5 purged

    m2, model2, loader2, train2 = manager(tmp_path, seed=1)
    assert m2.load()
    assert (train2.value, loader2.pos) == (12, 112)
    assert torch.equal(model2.weight, saved[12])
    m3, model3, _, train3 = manager(tmp_path, seed=1)
    assert m3.load(step=10) and train3.value == 10 and torch.equal(model3.weight, saved[10])
    with pytest.raises(UserInputError, match="load_step 7"):
        manager(tmp_path)[0].load(step=7)


def test_incomplete_checkpoint_is_never_loaded(tmp_path, caplog):
    m, model, loader, train = manager(tmp_path)
    train.value = 5
    m.save(5)
    train.value = 10
    m.save(10)
    folder = tmp_path / "checkpoint"
    (folder / "step-10").rename(folder / "step-10.tmp-dead")  # as if killed before the rename
    (folder / "step-10.tmp-dead" / ".metadata").unlink()
    m2, _, _, train2 = manager(tmp_path)
    with caplog.at_level("WARNING", logger=ckpt.logger.name):
        assert m2.load()
    assert train2.value == 5
    assert "step-10.tmp-dead" in caplog.text
    assert not (folder / "step-10.tmp-dead").exists()


def test_nothing_to_load(tmp_path):
    assert not manager(tmp_path)[0].load()
    assert not manager(tmp_path, enable=False)[0].load()


def test_model_only_export_and_initial_load(tmp_path):
    m, model, _, train = manager(tmp_path, last_save_model_only=True, export_dtype="bfloat16")
    train.value = 5
    m.save(5)
    m.save(6, last_step=True)
    export = tmp_path / "checkpoint" / "step-6"
    meta = SafeReader(export).read_metadata().state_dict_metadata
    assert set(meta) == {"weight", "bias"}
    assert meta["weight"].properties.dtype == torch.bfloat16
    # Resuming skips the export and takes the last full checkpoint.
    m2, _, _, train2 = manager(tmp_path)
    assert m2.load() and train2.value == 5
    with pytest.raises(UserInputError, match="model-only"):
        manager(tmp_path)[0].load(step=6)
    # A fresh run starts from the export's weights only.
    other = tmp_path / "other"
    m3, model3, _, train3 = manager(other, seed=3, initial_load_path=str(export))
    assert m3.load() and train3.value == 0
    assert torch.equal(model3.weight, model.weight.to(torch.bfloat16).float())


def test_bad_initial_load_path(tmp_path):
    with pytest.raises(UserInputError, match="initial_load_path .*nowhere"):
        manager(tmp_path, initial_load_path=str(tmp_path / "nowhere"))[0].load()
    broken = make_complete(tmp_path / "x", 1)
    (broken / ".metadata").write_bytes(b"garbage")
    with pytest.raises(UserInputError, match=str(broken)):
        manager(tmp_path, initial_load_path=str(broken))[0].load()


def test_invalid_config(tmp_path):
    with pytest.raises(UserInputError, match="interval"):
        manager(tmp_path, interval=0)
    with pytest.raises(UserInputError, match="keep_latest_k"):
        manager(tmp_path, keep_latest_k=-1)


def test_async_save_completes_on_close(tmp_path):
    m, model, _, train = manager(tmp_path, async_mode="async")
    train.value = 5
    m.save(5)
    expected = model.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the save is written
    m.close()
    m2, model2, _, train2 = manager(tmp_path, seed=1)
    assert m2.load() and train2.value == 5 and torch.equal(model2.weight, expected)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_unpickler_refuses_foreign_globals(tmp_path):
    path = make_complete(tmp_path, 1)
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        SafeReader(path).read_metadata()


def test_non_tensor_values_load_weights_only(tmp_path):
    state = {"s": {"step": 3, "b": b"x", "t": (0.9, 0.99), "l": [1, "a"]}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    target = {"s": {"step": 0, "b": b"", "t": (), "l": []}}
    dcp.load(target, storage_reader=SafeReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert target == state
    # An object that only full unpickling could build is refused.
    planner = SafeLoadPlanner()
    with pytest.raises(pickle.UnpicklingError):
        buf = io.BytesIO()
        torch.save(Evil(), buf)
        buf.seek(0)
        planner.load_bytes(None, buf)
