"""`LLM()` and `AsyncLLM` take their device from PAGELLM_DEVICE when `device=` is not given, as the CLI does,
so one variable points the whole test suite (and a user's script) at a device."""

from __future__ import annotations

import pytest
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.errors import ConfigError
from pagellm.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("device")))


def small_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=16, max_model_len=64, **kwargs)


def test_an_unknown_device_in_the_variable_fails_naming_it(model_dir, monkeypatch):
    monkeypatch.setenv("PAGELLM_DEVICE", "nonsense")
    with pytest.raises(ConfigError, match="Device 'nonsense' is not a registered platform"):
        small_llm(model_dir)
    with pytest.raises(ConfigError, match="Device 'nonsense'"):
        AsyncLLM(model_dir, engine_process=False, dtype="float32")


def test_the_variable_chooses_the_device(model_dir, monkeypatch):
    monkeypatch.setenv("PAGELLM_DEVICE", "cpu")
    llm = small_llm(model_dir)
    assert llm.engine.setup.platform.name == "cpu"
    assert llm.engine.setup.explanation[0] == "device cpu (requested)"  # not auto's pick


def test_the_argument_wins_over_the_variable(model_dir, monkeypatch):
    monkeypatch.setenv("PAGELLM_DEVICE", "nonsense")
    assert small_llm(model_dir, device="cpu").engine.setup.platform.name == "cpu"
