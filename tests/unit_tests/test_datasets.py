"""Tests for dataset loading, packing, rank splitting, resumption, bad input, the preflight
check and the corpus builder."""

import importlib.util
import itertools
import json
import logging
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.components.errors import AssetError
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.datasets import (
    DATASETS,
    DatasetConfig,
    HuggingFaceDataset,
    build_hf_dataloader,
    hub,
)
from torchtitan.datasets.local_files import check_local_dataset, load_local_dataset
from torchtitan.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    (f"Document number {i} says: " + "lorem ipsum dolor sit amet " * (i % 4)).strip()
    for i in range(12)
]


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
    one_rank = build_hf_dataloader(
        1, 0, tokenizer, _job_config(path, dataset=name, batch=world * local, seq_len=4)
    )
    global_batches = [x["input"] for x, _ in _take(one_rank, 4)]
    per_rank = [
        [
            x["input"]
            for x, _ in _take(
                build_hf_dataloader(
                    world, r, tokenizer, _job_config(path, dataset=name, batch=local, seq_len=4)
                ),
                4,
            )
        ]
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
    assert list(load_local_dataset(str(path)).texts) == DOCS
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
    spec = importlib.util.spec_from_file_location(
        "build_corpus", REPO_ROOT / "scripts/build_corpus.py"
    )
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
    (tmp_path / "pkg" / "alpha.py").write_text(
        '"""Alpha comes first in sorted path order, always."""\n'
    )
    (tmp_path / "test" / "skipped.py").write_text(
        '"""Tests are excluded from the corpus entirely."""\n'
    )
    (tmp_path / "broken.py").write_text("def (:\n")

    first = build_corpus.build_corpus(tmp_path)
    assert first == build_corpus.build_corpus(tmp_path)
    texts = [json.loads(line)["text"] for line in first.decode().splitlines()]
    assert texts[0].startswith("Alpha comes first") and len(texts) == 2
    assert "Tests are excluded" not in first.decode() and ">>>" not in texts[1]
    assert "second line of prose" in texts[1] and "noqa" not in texts[1]
    assert "Return one.\n\nThe text after the example is kept." in texts[1]
    assert build_corpus.build_corpus(tmp_path, max_bytes=len(first) - 1).count(b"\n") == 1


# ---------------------------------------------------------------------------------------
# Bad local files: one-line errors naming file and line, the same from training and check
# ---------------------------------------------------------------------------------------


def _error(path) -> str:
    """The message training raises for ``path``; the preflight check must raise the same."""
    with pytest.raises(AssetError) as info:
        load_local_dataset(str(path))
    message = str(info.value)
    with pytest.raises(AssetError) as checked:
        check_local_dataset(str(path))
    assert str(checked.value) == message
    assert "\n" not in message and isinstance(info.value, UserInputError)
    return message


def _lines_file(tmp_path, name, *lines) -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_malformed_json_line_names_file_and_line(tmp_path, name):
    path = _lines_file(tmp_path, name, '{"text": "a"}', "", '{"text": "b",}', '{"text": "c"}')
    message = _error(path)
    assert message.startswith(f"{path}:3: not valid JSON (") and message.endswith(
        "fix or remove that line"
    )


def test_malformed_json_list_names_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b"}\n  {"text": "c"}\n]\n')
    assert _error(path).startswith(f"{path}:4: not valid JSON (Expecting ',' delimiter")


@pytest.mark.parametrize(
    "name, data, where",
    [
        (
            "d.txt",
            "first paragraph\n\ncaf\xe9\n".encode("latin-1"),
            ":3: not UTF-8 text (byte 0xe9 at byte offset 20)",
        ),
        (
            "d.jsonl",
            b"\xff\xfe\x00\x01garbage\n",
            ":1: not UTF-8 text (byte 0xff at byte offset 0)",
        ),
        ("d.json", b'[{"text": "\xe9"}]', ":1: not UTF-8 text (byte 0xe9 at byte offset 11)"),
    ],
)
def test_not_utf8_names_file_offset_and_fix(tmp_path, name, data, where):
    path = tmp_path / name
    path.write_bytes(data)
    message = _error(path)
    assert message.startswith(f"{path}{where}") and "convert the file to UTF-8" in message


@pytest.mark.parametrize(
    "record, problem",
    [
        ('{"text": 12345}', '"text" must be a string, got int'),
        ('{"text": null}', '"text" must be a string, got null'),
        ('{"body": "x", "id": 3}', 'the record has no "text" field (its keys: body, id)'),
        ('["text"]', 'expected a JSON object with a "text" field, got list'),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, record, problem):
    path = _lines_file(tmp_path, "d.jsonl", '{"text": "fine"}', record)
    assert _error(path).startswith(f"{path}:2: {problem}")


def test_bad_record_in_json_list_names_record(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": 7}]))
    assert _error(path).startswith(f'{path}: record 2: "text" must be a string, got int')


@pytest.mark.parametrize(
    "table, problem",
    [
        ({"body": ["x"]}, 'the parquet file needs a "text" column (its columns: body)'),
        ({"text": [1, 2]}, 'the "text" column must hold strings, got int64'),
        ({"text": ["a", None]}, 'row 1 (counting from 0): "text" is null'),
    ],
)
def test_bad_parquet_names_file(tmp_path, table, problem):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table(table), path)
    assert _error(path).startswith(f"{path}: {problem}")


def test_garbage_parquet_names_file(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"this is not parquet at all")
    assert _error(path).startswith(f"{path}: not a readable parquet file (")


@pytest.mark.parametrize(
    "files", [{"d.jsonl": ""}, {"d.txt": "\n  \n\t\n"}, {"a.jsonl": "\n", "b.txt": ""}]
)
def test_no_text_names_the_files(tmp_path, files):
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    path = tmp_path / next(iter(files)) if len(files) == 1 else tmp_path
    message = _error(path)
    assert "holds no text" in message and "--training.dataset_path" in message
    assert all(str(tmp_path / name) in message for name in files)


def test_utf8_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + b"".join(json.dumps({"text": t}).encode() + b"\r\n" for t in DOCS)
    )
    assert list(load_local_dataset(str(path)).texts) == DOCS


# ---------------------------------------------------------------------------------------
# The preflight check
# ---------------------------------------------------------------------------------------


def test_check_reads_small_data_whole(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(DOCS[:4]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[4:]))
    pq.write_table(pa.table({"text": ["one more"]}), tmp_path / "c.parquet")
    assert check_local_dataset(str(tmp_path)) == "checked 3 files, 13 documents (all)"


def test_check_samples_the_start_of_every_file(tmp_path):
    line = json.dumps({"text": "x" * 1000}) + "\n"
    big = tmp_path / "a.jsonl"
    big.write_text(line * 200 + '{"text": 1}\n')  # a bad record far past the sample
    (tmp_path / "b.txt").write_text("fine\n")
    summary = check_local_dataset(str(tmp_path), max_bytes=20_000)
    # 10 kB a file: 10 documents of a.jsonl (about 1 kB each) and all of b.txt
    assert (
        summary
        == "checked 2 files, 11 documents (9.9 KiB of 197.9 KiB sampled: the start of each file)"
    )
    with pytest.raises(AssetError, match=f"{big}:201: "):
        load_local_dataset(str(tmp_path))  # training reads it all
    (tmp_path / "b.txt").write_bytes(b"\xff")  # a bad head is found however small the share
    with pytest.raises(AssetError, match=f"{tmp_path / 'b.txt'}:1: not UTF-8"):
        check_local_dataset(str(tmp_path), max_bytes=20_000)


def test_check_missing_path(tmp_path):
    with pytest.raises(AssetError, match="does not exist.*--training.dataset_path"):
        check_local_dataset(str(tmp_path / "absent.jsonl"))


# ---------------------------------------------------------------------------------------
# Re-looping and the hub
# ---------------------------------------------------------------------------------------


def test_reloop_is_warned_once_naming_the_file(tmp_path, tokenizer, caplog):
    text = " ".join(f"word{i}" for i in range(40))  # more than one batch of 5 tokens
    path = _lines_file(tmp_path, "d.jsonl", json.dumps({"text": text}))
    dataset = HuggingFaceDataset("titan_corpus", str(path), tokenizer, seq_len=4, infinite=True)
    with caplog.at_level(logging.DEBUG, logger="torchtitan.datasets.packing"):
        list(itertools.islice(iter(dataset), 200))
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and dataset.reloops > 3, warnings
    assert warnings[0].startswith(f"Dataset titan_corpus ({path}) is being re-looped after ")
    assert f"re-looped {dataset.reloops} times" in caplog.records[-1].message


def test_data_smaller_than_one_global_batch_is_named(tmp_path, tokenizer, caplog):
    path = _lines_file(tmp_path, "d.jsonl", json.dumps({"text": "tiny"}))
    dataset = HuggingFaceDataset(
        "titan_corpus",
        str(path),
        tokenizer,
        seq_len=4,
        infinite=True,
        local_batch_size=2,
        dp_world_size=2,
    )
    tokens = len(tokenizer.encode("tiny"))
    with caplog.at_level(logging.WARNING, logger="torchtitan.datasets.packing"):
        next(iter(dataset))
    (warning,) = [r.message for r in caplog.records]
    assert warning.startswith(
        f"Dataset titan_corpus ({path}) holds {tokens} tokens, less than one global batch "
        "(20 tokens): every batch trains on repeats of it"
    ), warning


def _online(monkeypatch, endpoint: str):
    """Offline mode off, no proxies, ``HF_ENDPOINT`` = ``endpoint``; load_dataset must not run."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
        monkeypatch.delenv(key.upper(), raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was not probed first")
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_fails_fast(monkeypatch, tokenizer):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    _online(monkeypatch, endpoint)
    start = time.monotonic()
    with pytest.raises(AssetError) as info:
        HuggingFaceDataset("c4", None, tokenizer)
    assert time.monotonic() - start < 1
    message = str(info.value)
    assert (
        f"cannot connect to {endpoint}" in message
        and "no hub access" in message
        and "\n" not in message
    )
    assert "--training.dataset titan_corpus" in message


def test_hub_probe_is_bounded_when_the_lookup_hangs(monkeypatch, tokenizer):
    _online(monkeypatch, "https://hub.invalid")
    release = threading.Event()

    def hanging_lookup(*args, **kwargs):
        release.wait(5)
        raise OSError("released")

    monkeypatch.setattr(hub, "_HUB_PROBE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(socket, "create_connection", hanging_lookup)
    start = time.monotonic()
    try:
        with pytest.raises(
            AssetError, match=r"no connection to https://hub.invalid .* within 0.2 s"
        ):
            HuggingFaceDataset("c4_validation", None, tokenizer)
    finally:
        release.set()
    assert time.monotonic() - start < 1
