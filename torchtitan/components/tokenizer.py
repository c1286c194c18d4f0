"""Tokenizer wrapper around a Hugging Face ``tokenizer.json``.

The repo ships a small byte-level BPE in ``tests/assets/tokenizer`` (built by
``scripts/train_tokenizer.py``); any folder holding a ``tokenizer.json`` works.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from torchtitan.components.errors import AssetError
from torchtitan.config.job_config import JobConfig

_REPO_ROOT = Path(__file__).resolve().parents[2]
_DEFAULT_BOS, _DEFAULT_EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _locate(tokenizer_path: str) -> Path:
    """The ``tokenizer.json`` for a folder (or the file itself).

    A relative path is tried from the current directory first, then from the repo root,
    so the default ``./tests/assets/tokenizer`` works from any working directory.
    """
    given = Path(tokenizer_path).expanduser()
    candidates = [given] if given.is_absolute() else [given, _REPO_ROOT / given]
    for candidate in candidates:
        file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
        if file.is_file() and file.name.endswith(".json"):
            return file
    raise AssetError(
        f"no tokenizer.json found at tokenizer path '{tokenizer_path}' "
        f"(resolved to {given.resolve()}): set --model.tokenizer_path to a folder containing "
        "tokenizer.json; the repo ships ./tests/assets/tokenizer"
    )


def _load_backend(file: Path) -> Tokenizer:
    """The tokenizer in ``file``; a file that is not one is an ``AssetError``."""
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the backend raises a bare Exception for every kind of bad file
        reason = " ".join(str(e).split())[:200]
        raise AssetError(
            f"{file} is not a Hugging Face tokenizer.json ({reason}); set --model.tokenizer_path "
            "to a folder containing a valid tokenizer.json; the repo ships ./tests/assets/tokenizer"
        ) from e


def _load_config(file: Path) -> dict:
    """The JSON object in ``file`` (``tokenizer_config.json``), or ``{}`` when there is none."""
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AssetError(
            f"{file}: not valid JSON ({e}); fix or delete it (it only names BOS/EOS)"
        ) from e
    if not isinstance(config, dict):
        raise AssetError(
            f"{file}: expected a JSON object, got {type(config).__name__}; fix or delete it"
        )
    return config


def _token_name(config: dict, key: str, file: Path) -> str | None:
    """``config[key]`` from ``file`` (tokenizer_config.json): a string or an AddedToken dict."""
    entry = config.get(key)
    if isinstance(entry, dict):
        entry = entry.get("content")
    if entry is not None and not isinstance(entry, str):
        raise AssetError(
            f'{file}: "{key}" must be a token string, got {type(entry).__name__}; fix or delete it'
        )
    return entry


class HuggingFaceTokenizer:
    """Encodes text to ids with optional BOS/EOS, and decodes ids back to text.

    BOS/EOS names come from ``tokenizer_config.json`` next to ``tokenizer.json``
    (``bos_token``/``eos_token``), defaulting to ``<|begin_of_text|>``/``<|end_of_text|>``;
    names missing from the vocabulary are added as special tokens. The backend is always
    called with ``add_special_tokens=False``, so a post-processor that would insert
    BOS/EOS itself never does, and each is added exactly once, here.
    """

    def __init__(self, tokenizer_path: str):
        file = _locate(tokenizer_path)
        self.tokenizer_path = str(file.parent)
        self._backend = _load_backend(file)
        config_file = file.parent / "tokenizer_config.json"
        config = _load_config(config_file)
        self.bos_token = _token_name(config, "bos_token", config_file) or _DEFAULT_BOS
        self.eos_token = _token_name(config, "eos_token", config_file) or _DEFAULT_EOS
        self._bos_id = self._special_id(self.bos_token)
        self._eos_id = self._special_id(self.eos_token)

    def _special_id(self, token: str) -> int:
        if self._backend.token_to_id(token) is None:
            self._backend.add_special_tokens([token])
        token_id = self._backend.token_to_id(token)
        assert token_id is not None  # added just above if it was missing
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, including added special tokens (the model's embedding size)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return ([self._bos_id] if add_bos else []) + ids + ([self._eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids`` (a list or a 1-D tensor); BOS/EOS are dropped unless asked for."""
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def build_hf_tokenizer(job_config: JobConfig) -> HuggingFaceTokenizer:
    """The tokenizer at ``job_config.model.tokenizer_path``."""
    return HuggingFaceTokenizer(job_config.model.tokenizer_path)
