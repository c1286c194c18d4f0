"""Tests for the shipped tokenizer asset, its wrapper and the tokenizer training script."""

import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, processors

from torchtitan.components.errors import AssetError
from torchtitan.components.tokenizer import HuggingFaceTokenizer, build_hf_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO_ROOT / "tests/assets/tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(TOKENIZER_DIR))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "text",
    ["", "Hello, world!", "  leading and trailing  \n", "naïve café 日本語 🙂 Ω≈ç√\ttab\r\nCRLF"],
)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bos_eos_added_once(tokenizer):
    ids = tokenizer.encode("some text")
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert ids.count(tokenizer.bos_id) == 1 and ids.count(tokenizer.eos_id) == 1
    bare = tokenizer.encode("some text", add_bos=False, add_eos=False)
    assert ids == [tokenizer.bos_id] + bare + [tokenizer.eos_id]
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|begin_of_text|>")


def test_vocab_size(tokenizer):
    assert 1900 <= tokenizer.vocab_size <= 2100
    assert {tokenizer.bos_id, tokenizer.eos_id} == {0, 1}


def test_backend_post_processor_does_not_double_add(tmp_path, tokenizer):
    backend = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, 0), (eos, 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(TOKENIZER_DIR / "tokenizer_config.json", tmp_path)
    wrapped = HuggingFaceTokenizer(str(tmp_path))
    assert wrapped.encode("abc") == tokenizer.encode("abc")
    assert wrapped.encode("abc", add_bos=False, add_eos=False).count(0) == 0


def test_missing_config_uses_default_names(tmp_path):
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp_path)
    wrapped = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))  # a file path works too
    assert (wrapped.bos_id, wrapped.eos_id) == (0, 1)


def test_unknown_special_token_is_added(tmp_path):
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}}))
    wrapped = HuggingFaceTokenizer(str(tmp_path))
    assert wrapped.bos_id == 2000 and wrapped.vocab_size == 2001
    assert wrapped.encode("x")[0] == 2000


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(AssetError) as info:
        HuggingFaceTokenizer(str(missing))
    message = str(info.value)
    assert str(missing) in message
    assert "--model.tokenizer_path" in message and "./tests/assets/tokenizer" in message


def test_build_from_job_config_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job_config = SimpleNamespace(model=SimpleNamespace(tokenizer_path="./tests/assets/tokenizer"))
    assert build_hf_tokenizer(job_config).vocab_size == 2000


def test_training_is_deterministic():
    train_tokenizer = _load_script("train_tokenizer")
    texts = ["the quick brown fox jumps over the lazy dog"] * 5 + ["naïve café, 日本語"]
    first = train_tokenizer.train(texts, vocab_size=300).to_str()
    second = train_tokenizer.train(texts, vocab_size=300).to_str()
    assert first == second
    vocab = json.loads(first)["model"]["vocab"]
    assert vocab["<|begin_of_text|>"] == 0 and vocab["<|end_of_text|>"] == 1


@pytest.mark.parametrize(
    "content",
    [
        bytes(range(256)),
        b"",
        b'{"not": "a tokenizer"}',
        b"[1, 2, 3]",
        b'{"model": {"type": "BPE"}}',
    ],
    ids=["binary", "empty", "other_json", "list", "no_vocab"],
)
def test_garbage_tokenizer_json_is_one_clear_error(tmp_path, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(AssetError) as info:
        HuggingFaceTokenizer(str(tmp_path))
    message = str(info.value)
    assert message.startswith(
        f"{tmp_path / 'tokenizer.json'} is not a Hugging Face tokenizer.json ("
    )
    assert "--model.tokenizer_path" in message and "\n" not in message


@pytest.mark.parametrize(
    "config, problem",
    [
        ("{bad", "not valid JSON"),
        ('["<s>"]', "expected a JSON object, got list"),
        ('{"eos_token": 7}', '"eos_token" must be a token string, got int'),
    ],
)
def test_bad_tokenizer_config_names_the_file(tmp_path, config, problem):
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(AssetError) as info:
        HuggingFaceTokenizer(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path / 'tokenizer_config.json'}: {problem}")
    assert "fix or delete it" in str(info.value) and "\n" not in str(info.value)
