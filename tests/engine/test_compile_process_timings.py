"""The background compile process, once it saved the forward, times the attention backends for the next start
(`compile_process.time_attention_for_next_start`): the start whose kernels were building picked by
preference and timed nothing, and the next start would spend ~3 s timing (FLEX_ATTENTION's compile)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm.core.config import EngineConfig
from pagellm.engine import compile_process, setup
from pagellm.platforms import cpu_kernels
from pagellm.worker import compiled_forward


@pytest.fixture
def timings_here(tmp_path, monkeypatch):
    if cpu_kernels.load() is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")
    monkeypatch.setattr(setup, "cache_dir", lambda: str(tmp_path))
    return tmp_path / "attention_timings.json"


def test_the_next_start_finds_the_timings_and_picks_the_fastest_without_timing(
    tmp_path, timings_here, idle_machine, monkeypatch
):
    config = EngineConfig.from_kwargs(model=make_tiny_checkpoint("llama", tmp_path / "m"), dtype="float32")
    threads = torch.get_num_threads()
    compile_process.time_attention_for_next_start(config, threads)
    assert torch.get_num_threads() == threads
    timed = json.loads(timings_here.read_text())
    assert any("CPU_ATTN" in key for key in timed) and any("TORCH_SDPA" in key for key in timed)

    def no_timing(*args):
        raise AssertionError("the next start timed the backends again")

    monkeypatch.setattr(setup, "_backend_timer", lambda: no_timing)
    choice = setup.resolve_engine(config).backend_choice
    assert choice.backend.name in choice.timings, "picked from the timings found"


def test_the_compile_request_carries_the_engines_config_where_it_chose_its_backend(
    tmp_path, compiled_forwards_of_this_test, monkeypatch
):
    """Only a start that chose its backend itself asks for timings (a pinned --attention-backend times none)."""
    requests = []
    monkeypatch.setattr(compiled_forward, "CompileProcess", lambda request: requests.append(request))
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    from pagellm import LLM

    for backend in ({}, {"attention_backend": "TORCH_SDPA"}):  # the default (auto), as serve starts
        LLM(
            path,
            dtype="float32",
            enforce_eager=False,
            compile_in_background=True,
            num_kv_blocks=64,
            max_model_len=128,
            **backend,
        )
    auto, pinned = requests
    assert auto.timings_config is not None and auto.timings_config.attention_backend == "auto"
    assert not auto.timings_config.compile_in_background and auto.config.attention_backend != "auto"
    assert pinned.timings_config is None
