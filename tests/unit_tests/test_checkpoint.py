"""Single-process checks of the checkpoint manager: discovery, atomicity, purge, safe loading,
checksums, and the learning rate after a resume."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from torchtitan.components.checkpoint import (
    MANIFEST,
    CheckpointManager,
    SafeLoadPlanner,
    SafeReader,
    build_manifest,
    verify_checkpoint,
    write_manifest,
)
from torchtitan.components.checkpoint import manager as ckpt  # where the manager finds names
from torchtitan.components.lr_scheduler import build_lr_schedulers, lr_factor
from torchtitan.components.optimizer import build_optimizers
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
    fields = dict(
        enable=True,
        folder="checkpoint",
        interval=5,
        keep_latest_k=10,
        initial_load_path=None,
        initial_load_model_only=True,
        last_save_model_only=False,
        export_dtype="float32",
        async_mode="disabled",
        load_step=-1,
    )
    fields.update(checkpoint)
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)), checkpoint=SimpleNamespace(**fields)
    )


def manager(tmp_path: Path, seed: int = 0, **checkpoint):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    sched, loader, train = Counter(), Loader(), Counter()
    m = CheckpointManager(
        loader, [model], Counter(), sched, {"train_state": train}, job(tmp_path, **checkpoint)
    )
    return m, model, loader, train


def make_complete(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    dcp.save({"x": torch.tensor([float(step)])}, checkpoint_id=path, no_dist=True)
    return path


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
    assert (
        verify_checkpoint(tmp_path / "checkpoint" / "step-5", strict=True) is None
    )  # has a manifest
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


# ---- checksums ---------------------------------------------------------------------------


def saved_5_and_10(tmp_path: Path) -> Path:
    """Full checkpoints step-5 (train_state 5) and step-10 (10); returns step-10's folder."""
    m, _, _, train = manager(tmp_path)
    for step in (5, 10):
        train.value = step
        m.save(step)
    return tmp_path / "checkpoint" / "step-10"


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def flip_weight_bytes(shard: Path) -> None:
    """Flip the stored float bytes of the model's `weight`: still a loadable file."""
    stored = {"weight": torch.empty(3, 4)}
    dcp.load(stored, checkpoint_id=shard.parent, no_dist=True)
    raw = stored["weight"].numpy().tobytes()
    data = bytearray(shard.read_bytes())
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    data[at : at + len(raw)] = bytes(b ^ 0xFF for b in raw)
    shard.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "bit_flip": ("__0_0.distcp", flip_weight_bytes, "__0_0.distcp checksum mismatch"),
    "truncated": ("__0_0.distcp", truncate, r"__0_0.distcp size \d+ != \d+ \(truncated\?\)"),
    "missing_shard": ("__0_0.distcp", Path.unlink, "__0_0.distcp missing"),
    "missing_manifest": ("checksums.json", Path.unlink, "checksums.json missing"),
    "missing_metadata": (".metadata", Path.unlink, r"\.metadata missing"),
    "metadata_bit_flip": (".metadata", flip_bytes, r"\.metadata checksum mismatch"),
}


def test_manifest_lists_every_file_by_content(tmp_path):
    folder = saved_5_and_10(tmp_path)
    manifest = json.loads((folder / "checksums.json").read_text())
    names = sorted(os.listdir(folder))
    assert names == [".metadata", "__0_0.distcp", "checksums.json"]  # no temporary left behind
    assert manifest["hash"] == "blake2b-256"
    assert manifest["files"] == {
        name: {
            "size": (folder / name).stat().st_size,
            "blake2b": hashlib.blake2b((folder / name).read_bytes(), digest_size=32).hexdigest(),
        }
        for name in names
        if name != "checksums.json"
    }
    assert verify_checkpoint(folder, strict=True) is None


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_checkpoint_falls_back_with_one_warning(kind, tmp_path, caplog):
    name, corrupt, reason = CORRUPTIONS[kind]
    folder = saved_5_and_10(tmp_path)
    corrupt(folder / name)
    assert re.fullmatch(
        reason + ".*", verify_checkpoint(folder) or ""
    )  # no torch.distributed needed
    m2, _, _, train2 = manager(tmp_path)
    with caplog.at_level("WARNING", logger=ckpt.logger.name):
        assert m2.load()
    assert train2.value == 5
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and r.name == ckpt.logger.name
    ]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(folder))}: {reason}.*; falling back to step-5", warnings[0]
    )
    assert folder.is_dir()  # reported, not deleted: the folder is the user's to inspect


def test_flipped_weight_bytes_would_load_silently_without_checksums(tmp_path, monkeypatch):
    folder = saved_5_and_10(tmp_path)
    _, model, _, _ = manager(tmp_path)  # the same initial weights as the saved ones
    flip_weight_bytes(folder / "__0_0.distcp")
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda path, strict=False, share=(0, 1): None)
    m2, model2, _, train2 = manager(tmp_path, seed=1)
    assert m2.load() and train2.value == 10  # no error at all
    assert not torch.equal(model2.weight, model.weight)  # but the weights are not the saved ones


def test_no_intact_checkpoint_is_an_error_and_the_folders_stay(tmp_path):
    folder = saved_5_and_10(tmp_path)
    for step in (5, 10):
        flip_bytes(folder.parent / f"step-{step}" / "__0_0.distcp")
    m2, _, _, train2 = manager(tmp_path)
    with pytest.raises(UserInputError) as info:
        m2.load()
    assert str(info.value) == (
        f"no intact checkpoint to resume from in {folder.parent}: "
        "step-10 (__0_0.distcp checksum mismatch (corrupted bytes)), "
        "step-5 (__0_0.distcp checksum mismatch (corrupted bytes)); they are kept as they "
        "are: to start again from step 1, move them out of that folder (or use another "
        "--job.dump_folder)"
    )
    assert train2.value == 0
    assert sorted(os.listdir(folder.parent)) == ["step-10", "step-5"]


def test_a_corrupt_checkpoint_is_set_aside_not_overwritten_when_its_step_is_saved_again(
    tmp_path,
):
    folder = saved_5_and_10(tmp_path)
    flip_bytes(folder / "__0_0.distcp")
    evidence = (folder / "__0_0.distcp").read_bytes()
    m2, _, _, train2 = manager(tmp_path)
    assert m2.load() and train2.value == 5  # fell back
    m2.save(10)
    m2.close()
    names = sorted(os.listdir(folder.parent))
    assert names[:2] == ["step-10", "step-10.corrupt-" + m2._run_id], names
    assert (folder.parent / names[1] / "__0_0.distcp").read_bytes() == evidence
    assert verify_checkpoint(folder) is None  # the new step-10 is intact
    m3, _, _, train3 = manager(tmp_path)
    assert m3.load() and train3.value == 5  # it holds what was saved after the fallback


def test_load_step_of_corrupt_checkpoint_is_user_error(tmp_path):
    folder = saved_5_and_10(tmp_path)
    truncate(folder / "__0_0.distcp")
    with pytest.raises(UserInputError) as info:
        manager(tmp_path)[0].load(step=10)
    message = str(info.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"--checkpoint.load_step 10: checkpoint {re.escape(str(folder))} is corrupt: "
        r"__0_0.distcp size \d+ "
        r"!= \d+ \(truncated\?\); pick another step \(found: 5\) or delete that folder",
        message,
    )
    m2, _, _, train2 = manager(tmp_path)
    assert m2.load(step=5) and train2.value == 5  # the other step is fine


def test_corrupt_initial_load_path_is_user_error(tmp_path):
    folder = saved_5_and_10(tmp_path)
    flip_bytes(folder / "__0_0.distcp")
    with pytest.raises(
        UserInputError, match="initial_load_path .*corrupt checkpoint: __0_0.distcp checksum"
    ):
        manager(tmp_path / "other", initial_load_path=str(folder))[0].load()


def test_checkpoint_from_before_checksums_loads_unverified(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ckpt, "hash_own_files", lambda folder, rank: None)
    monkeypatch.setattr(ckpt, "merge_manifest", lambda folder, world, timeout_s: None)
    monkeypatch.setattr(ckpt.CheckpointWriter, "storage_meta", FileSystemWriter.storage_meta)
    folder = saved_5_and_10(tmp_path)
    assert not (folder / "checksums.json").exists()
    assert "written before checkpoints carried checksums" in verify_checkpoint(folder, strict=True)
    m2, _, _, train2 = manager(tmp_path)
    with caplog.at_level("WARNING", logger=ckpt.logger.name):
        assert m2.load()
    assert train2.value == 10
    assert (
        f"checkpoint {folder}: no checksums.json" in caplog.text
        and "loading it unverified" in caplog.text
    )


# ---- the learning rate after a resume --------------------------------------------------------


def trainer(tmp_path: Path, steps: int, warmup: int, lr: float):
    """A tiny model with the real AdamW, schedule (linear decay to 0) and checkpointer."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    cfg = SimpleNamespace(
        training=SimpleNamespace(steps=steps),
        lr_scheduler=SimpleNamespace(
            warmup_steps=warmup, decay_ratio=None, decay_type="linear", min_lr_factor=0.0
        ),
        optimizer=SimpleNamespace(
            name="AdamW",
            lr=lr,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.0,
            implementation="foreach",
        ),
    )
    opts = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opts, cfg)
    train = Counter()
    m = CheckpointManager(
        Loader(), [model], opts, sched, {"train_state": train}, job(tmp_path, interval=100)
    )
    return m, model, opts, sched, train


def train_step(model, opts, sched) -> None:
    opts.zero_grad()
    model(torch.ones(2, 4)).square().sum().backward()
    opts.step()
    sched.step()


@pytest.mark.parametrize(
    "warmup,lr", [(1, 1.0), (6, 2.0)], ids=["more_steps", "new_warmup_and_peak"]
)
def test_resume_with_more_steps_runs_the_new_schedule(warmup, lr, tmp_path):
    m, model, opts, sched, train = trainer(tmp_path, steps=4, warmup=1, lr=1.0)
    for step in range(1, 5):
        train_step(model, opts, sched)
        train.value = step
        m.save(step, last_step=step == 4)
    assert opts.param_groups[0]["lr"] == 0.0  # the finished run decayed to 0

    m2, model2, opts2, sched2, train2 = trainer(tmp_path, steps=8, warmup=warmup, lr=lr)
    assert m2.load() and train2.value == 4
    expected = lr * lr_factor(
        5,
        warmup_steps=warmup,
        total_steps=8,
        decay_ratio=None,
        decay_type="linear",
        min_lr_factor=0.0,
    )
    assert expected > 0
    assert sched2.get_last_lr() == pytest.approx(expected)  # what the trainer logs for step 5
    assert opts2.param_groups[0]["lr"] == pytest.approx(expected)  # what step 5 uses
    assert opts2.param_groups[0]["initial_lr"] == lr
    before = model2.weight.detach().clone()
    train_step(model2, opts2, sched2)
    assert not torch.equal(model2.weight, before)  # at lr 0 AdamW would leave them as they were


def test_every_rank_hashes_its_own_files_and_rank_0_merges_the_parts(tmp_path):
    from torchtitan.components.checkpoint.manifest import hash_own_files, merge_manifest

    for name, data in (("__0_0.distcp", b"zero"), ("__1_0.distcp", b"one!"), (".metadata", b"m")):
        (tmp_path / name).write_bytes(data)
    hash_own_files(tmp_path, 1)
    with pytest.raises(TimeoutError, match="no checksums from checksums.part0.json"):
        merge_manifest(tmp_path, world=2, timeout_s=0.1)  # rank 0's part is missing
    hash_own_files(tmp_path, 0)
    part = json.loads((tmp_path / "checksums.part1.json").read_text())
    assert list(part) == ["__1_0.distcp"]  # rank 1 hashed only what it wrote
    merge_manifest(tmp_path, world=2, timeout_s=1)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    assert json.loads((tmp_path / MANIFEST).read_text()) == build_manifest(tmp_path)


def test_ranks_verify_their_shares_and_together_the_whole_folder(tmp_path):
    for r in range(3):
        (tmp_path / f"__{r}_0.distcp").write_bytes(bytes([r]) * 100)
    (tmp_path / ".metadata").write_bytes(b"meta")
    write_manifest(tmp_path)
    flip_bytes(tmp_path / "__2_0.distcp")
    names = sorted(build_manifest(tmp_path)["files"])  # the order shares are cut from
    culprit = names.index("__2_0.distcp")
    verdicts = [verify_checkpoint(tmp_path, share=(i, 2)) for i in range(2)]
    assert verdicts[culprit % 2] == "__2_0.distcp checksum mismatch (corrupted bytes)"
    assert verdicts[1 - culprit % 2] is None  # the other share does not read that file
    assert verify_checkpoint(tmp_path) == verdicts[culprit % 2]
