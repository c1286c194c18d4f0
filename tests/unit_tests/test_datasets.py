"""Tests for dataset loading, packing, rank splitting, resumption and the corpus builder."""

import importlib.util
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.components.errors import AssetError
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.datasets import DATASETS, DatasetConfig, HuggingFaceDataset, build_hf_dataloader
from torchtitan.datasets.hf_datasets import load_local_dataset
from torchtitan.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [(f"Document number {i} says: " + "lorem ipsum dolor sit amet " * (i % 4)).strip() for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(REPO_ROOT / "tests/assets/tokenizer"))


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return path


@pytest.fixture
def streaming_dataset(monkeypatch):
    """Registers 'stream_test': DOCS as a 2-shard streaming ``datasets.IterableDataset``."""

    def loader(path):
        return datasets.Dataset.from_dict({"text": DOCS}).to_iterable_dataset(num_shards=2)

    monkeypatch.setitem(DATASETS, "stream_test", DatasetConfig("unused", loader))
    return "stream_test"


def _job_config(dataset_path=None, dataset="titan_corpus", batch=2, seq_len=8):
    training = SimpleNamespace(
        dataset=dataset, dataset_path=dataset_path, local_batch_size=batch, seq_len=seq_len
    )
    return SimpleNamespace(training=training)


def _stream(samples) -> list[int]:
    """The token stream a list of (input, label) samples was cut from."""
    return [t for x, y in samples for t in x.tolist() + y[-1:].tolist()]


def test_packing(tokenizer, jsonl):
    seq_len = 16
    samples = list(HuggingFaceDataset("titan_corpus", str(jsonl), tokenizer, seq_len=seq_len))
    assert samples
    for x, y in samples:
        assert x.shape == y.shape == (seq_len,) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[1:], y[:-1])
    expected = [t for doc in DOCS for t in tokenizer.encode(doc)]
    stream = _stream(samples)
    assert stream == expected[: len(stream)]
    assert len(expected) - len(stream) <= seq_len  # only a partial window is dropped


@pytest.mark.parametrize("use_stream", [False, True])
def test_rank_split_is_a_slice_of_the_global_batch(tokenizer, jsonl, streaming_dataset, use_stream):
    name, path = (streaming_dataset, None) if use_stream else ("titan_corpus", str(jsonl))
    world, local = 3, 2
    one_rank = build_hf_dataloader(1, 0, tokenizer, _job_config(path, dataset=name, batch=world * local, seq_len=4))
    global_batches = [x["input"] for x, _ in _take(one_rank, 4)]
    per_rank = [
        [x["input"] for x, _ in _take(build_hf_dataloader(
            world, r, tokenizer, _job_config(path, dataset=name, batch=local, seq_len=4)), 4)]
        for r in range(world)
    ]
    for step, full in enumerate(global_batches):
        # disjoint slices whose concatenation is the global batch a single rank sees
        assert torch.equal(torch.cat([per_rank[r][step] for r in range(world)]), full)


def test_dataloader_batches(tokenizer, jsonl):
    loader = build_hf_dataloader(1, 0, tokenizer, _job_config(str(jsonl), batch=3, seq_len=8))
    inputs, labels = next(iter(loader))
    assert set(inputs) == {"input"}
    assert inputs["input"].shape == labels.shape == (3, 8) and labels.dtype == torch.long
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])


def _take(loader, n):
    return list(itertools.islice(iter(loader), n))


@pytest.mark.parametrize("k", [1, 4, 7, 12])
@pytest.mark.parametrize("use_stream", [False, True])
def test_resume_equals_uninterrupted(tokenizer, jsonl, streaming_dataset, k, use_stream):
    # ~300 tokens per epoch and rank, 2 x 9 tokens per batch: the runs cross epoch boundaries
    name, path = (streaming_dataset, None) if use_stream else ("titan_corpus", str(jsonl))
    config, m = _job_config(path, dataset=name), 25

    def make():
        return build_hf_dataloader(2, 1, tokenizer, config, infinite=True)

    reference = _take(make(), k + m)
    interrupted = make()
    _take(interrupted, k)
    state = interrupted.state_dict()
    assert set(state) == {"dataset"}
    resumed = make()
    resumed.load_state_dict(state)
    for (x_ref, y_ref), (x, y) in zip(reference[k:], _take(resumed, m), strict=True):
        assert torch.equal(x_ref["input"], x["input"]) and torch.equal(y_ref, y)
    assert resumed.dataset._epoch >= 1


def test_state_is_rank_independent_and_resumes_under_another_dp_degree(tokenizer, jsonl):
    path = str(jsonl)
    states = []
    for rank in (0, 1):
        loader = build_hf_dataloader(2, rank, tokenizer, _job_config(path, batch=2))
        _take(loader, 3)
        states.append(loader.state_dict())
    assert states[0] == states[1]
    # continue on one rank with the same global batch (4): the next global batches match
    reference = build_hf_dataloader(1, 0, tokenizer, _job_config(path, batch=4))
    expected = [x["input"] for x, _ in _take(reference, 5)][3:]
    resumed = build_hf_dataloader(1, 0, tokenizer, _job_config(path, batch=4))
    resumed.load_state_dict(states[0])
    got = [x["input"] for x, _ in _take(resumed, 2)]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("layout", ["jsonl", "json_list", "txt", "parquet", "folder"])
def test_local_formats(tmp_path, layout, tokenizer):
    if layout == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": 1}) + "\n" for t in DOCS))
    elif layout == "json_list":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([{"text": t} for t in DOCS]))
    elif layout == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n\n  \n".join(DOCS) + "\n")
    elif layout == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), path)
    else:
        path = tmp_path / "folder"
        (path / "sub").mkdir(parents=True)
        (path / "a.txt").write_text("\n\n".join(DOCS[:4]))
        (path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[4:8]))
        pq.write_table(pa.table({"text": DOCS[8:]}), path / "sub" / "c.parquet")
        (path / ".hidden.txt").write_text("ignored")
        (path / "notes.md").write_text("ignored")
    assert load_local_dataset(str(path))["text"] == DOCS
    loader = build_hf_dataloader(1, 0, tokenizer, _job_config(str(path)))
    assert next(iter(loader))[1].shape == (2, 8)


def test_default_corpus_from_any_cwd(tmp_path, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)
    loader = build_hf_dataloader(1, 0, tokenizer, _job_config(seq_len=32))
    inputs, labels = next(iter(loader))
    assert inputs["input"][0, 0].item() == tokenizer.bos_id and labels.shape == (2, 32)


def test_unknown_dataset_name(tokenizer):
    with pytest.raises(AssetError, match="unknown dataset 'nope'.*c4, c4_validation, titan_corpus"):
        HuggingFaceDataset("nope", None, tokenizer)


def test_missing_dataset_path(tmp_path, tokenizer):
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(AssetError) as info:
        HuggingFaceDataset("titan_corpus", str(missing), tokenizer)
    assert isinstance(info.value, UserInputError)  # reported as one line, no traceback
    assert str(missing) in str(info.value) and "--training.dataset_path" in str(info.value)


@pytest.mark.parametrize("name", ["c4", "c4_validation"])
def test_hub_dataset_offline_fails_clearly(monkeypatch, tokenizer, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(AssetError) as info:
        HuggingFaceDataset(name, None, tokenizer)
    message = str(info.value)
    assert "\n" not in message and "allenai/c4" in message and "no hub access" in message
    assert "--training.dataset titan_corpus" in message and "--training.dataset_path" in message


def test_corpus_builder_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location("build_corpus", REPO_ROOT / "scripts/build_corpus.py")
    build_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_corpus)

    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "zeta.py").write_text(
        '"""Zeta module explains how the last file is handled here."""\n'
        "# This comment block talks about the code that follows it,\n"
        "# and it continues on a second line of prose.\n"
        "x = 1  # noqa\n"
        "def f():\n"
        '    """Return one.\n\n    >>> f()\n    1\n\n    The text after the example is kept."""\n'
    )
    (tmp_path / "pkg" / "alpha.py").write_text('"""Alpha comes first in sorted path order, always."""\n')
    (tmp_path / "test" / "skipped.py").write_text('"""Tests are excluded from the corpus entirely."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")

    first = build_corpus.build_corpus(tmp_path)
    assert first == build_corpus.build_corpus(tmp_path)
    texts = [json.loads(line)["text"] for line in first.decode().splitlines()]
    assert texts[0].startswith("Alpha comes first") and len(texts) == 2
    assert "Tests are excluded" not in first.decode() and ">>>" not in texts[1]
    assert "second line of prose" in texts[1] and "noqa" not in texts[1]
    assert "Return one.\n\nThe text after the example is kept." in texts[1]
    assert build_corpus.build_corpus(tmp_path, max_bytes=len(first) - 1).count(b"\n") == 1
