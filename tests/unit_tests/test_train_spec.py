"""TrainSpec registry: built-ins resolve lazily, unknown names list what exists."""

import dataclasses

import pytest

from torchtitan.protocols.train_spec import (
    get_train_spec,
    register_train_spec,
    registered_names,
    UnknownTrainSpecError,
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
