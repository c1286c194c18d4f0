"""TrainSpec registry: built-ins resolve lazily, unknown names list what exists."""

import dataclasses
import json
from pathlib import Path

import pytest

from torchtitan.protocols.train_spec import (
    UnknownTrainSpecError,
    get_train_spec,
    register_train_spec,
    registered_names,
)


def test_builtin_llama3_resolves():
    spec = get_train_spec("llama3")
    assert spec.name == "llama3"
    assert {"debugmodel", "8B", "70B", "405B"} <= set(spec.flavors)


def test_unknown_name_lists_registered():
    with pytest.raises(UnknownTrainSpecError) as err:
        get_train_spec("llama9")
    message = str(err.value)
    assert "llama9" in message and "llama3" in message and "llama3_auto_parallel" in message


def test_register_custom_spec_and_reject_duplicates():
    spec = dataclasses.replace(get_train_spec("llama3"), name="my_llama")
    register_train_spec(spec)
    assert get_train_spec("my_llama") is spec
    assert "my_llama" in registered_names()
    with pytest.raises(ValueError, match="already registered"):
        register_train_spec(spec)


def _preflight(*args: str, block_transformers: bool = False):
    import subprocess
    import sys

    block = "import sys; sys.modules['transformers'] = None; " if block_transformers else ""
    code = block + "import sys; from torchtitan.preflight import main; main(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, "--world-size", "4", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


REPO = Path(__file__).resolve().parents[2]
HF_SPEC = ["--model.name", "hf_auto_parallel", "--model.flavor", "./tests/assets/hf_llama_debug"]


def test_hf_spec_without_transformers_says_how_to_install():
    res = _preflight(*HF_SPEC, block_transformers=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines() == [
        "error: --model.name hf_auto_parallel needs the transformers package: "
        "pip install -e '.[hf]' (or: pip install transformers)"
    ]


def test_hf_spec_preflight_accepts_the_shipped_config():
    pytest.importorskip("transformers")
    res = _preflight(*HF_SPEC)
    assert res.returncode == 0, res.stderr


def test_hf_spec_unreadable_config_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": ')
    res = _preflight("--model.name", "hf_auto_parallel", "--model.flavor", str(tmp_path))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: --model.flavor: cannot read {tmp_path / 'config.json'}")


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            {"num_attention_heads": 7, "num_key_value_heads": 7},
            "The hidden size (256) is not a multiple of the number of attention heads (7).",
        ),
        (
            {"num_attention_heads": "sixteen"},
            "Field 'num_attention_heads' expected int, got str (value: 'sixteen')",
        ),
    ],
)
def test_hf_spec_config_that_transformers_rejects_is_one_line(change, reason, tmp_path):
    pytest.importorskip("transformers")
    config = json.loads((REPO / "tests/assets/hf_llama_debug/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    res = _preflight("--model.name", "hf_auto_parallel", "--model.flavor", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"error: --model.flavor: cannot read {tmp_path / 'config.json'}: {reason}"
    ]


def test_hf_spec_rejects_a_model_without_causal_lm(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "t5", "vocab_size": 4000}')
    res = _preflight("--model.name", "hf_auto_parallel", "--model.flavor", str(tmp_path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "describes a 't5' model, which transformers has no causal-LM class for" in res.stderr
