"""The engine treats a plugin by the facts its class declares, never by its name: a vendor's GGUF-like
quantization method or accelerator-like platform gets exactly what the built-in one would."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from sim_platforms import SimAccelerator
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.config import EngineConfig
from pagellm.core.quant import QuantMethod
from pagellm.engine import llm_engine, setup
from pagellm.plugins import load_plugins
from pagellm.worker.step import ModelSource

MiB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("facts"))


class VendorGgufMethod(QuantMethod):
    """Reads llama.cpp blocks like the built-in `gguf`, under another name."""

    name = "vendor_gguf"
    loads_gguf_blocks = True


class VendorFloatMethod(QuantMethod):
    name = "vendor_float"


def _weights(model_dir, method: type[QuantMethod], monkeypatch) -> object:
    from pagellm.models import gguf_checkpoint

    packed = object()
    monkeypatch.setattr(gguf_checkpoint, "iter_gguf_weights", lambda path, config, raw_linear: packed)
    converted = []  # the float weights are converted for a method that reads them, and only then
    monkeypatch.setattr(gguf_checkpoint, "gguf_checkpoint_weights", lambda path, root: converted.append(path))
    fake_setup = SimpleNamespace(
        config=EngineConfig(),
        source=ModelSource(str(model_dir), gguf_original="/models/m.Q4_0.gguf"),
        hf_config=None,
        quant_method=method,
        kernels_pending=False,
    )
    weights = llm_engine.load_weights(fake_setup)
    assert converted == ([] if weights is packed else ["/models/m.Q4_0.gguf"])
    return weights is packed


def test_a_method_that_loads_gguf_blocks_gets_them_from_the_file_whatever_its_name(model_dir, monkeypatch):
    assert _weights(model_dir, VendorGgufMethod, monkeypatch)
    assert not _weights(model_dir, VendorFloatMethod, monkeypatch)  # the converted copy's float weights


def test_a_host_run_platform_sizes_the_kv_cache_by_its_own_memory_facts(model_dir, monkeypatch):
    registry = load_plugins()
    with_sim = dataclasses.replace(registry, platforms={**registry.platforms, "sim_accel": SimAccelerator})
    monkeypatch.setattr(setup, "load_plugins", lambda: with_sim)
    llm = LLM(
        str(model_dir),
        device="sim_accel",
        dtype="float32",
        gpu_memory_utilization=0.5,
        max_model_len=256,
        attention_backend="TORCH_SDPA",
    )
    runner = llm.engine.runner
    assert llm.engine.setup.platform is SimAccelerator
    # half of 64 MiB, less the 16 MiB in use on the device (not just the weights)
    assert runner.num_blocks == (32 - 16) * MiB // runner.block_bytes()
    assert torch.device("cpu") == runner.device


def test_the_kv_cache_holds_no_more_blocks_than_max_num_seqs_full_contexts(model_dir, monkeypatch):
    """A big device's memory would make millions of blocks (issue 17): no more than max_num_seqs requests
    of max_model_len tokens can use, plus the null block."""
    registry = load_plugins()
    with_sim = dataclasses.replace(registry, platforms={**registry.platforms, "sim_accel": SimAccelerator})
    monkeypatch.setattr(setup, "load_plugins", lambda: with_sim)
    llm = LLM(
        str(model_dir),
        device="sim_accel",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=3,
        attention_backend="TORCH_SDPA",
    )
    runner = llm.engine.runner
    assert runner.num_blocks == 3 * (64 // 16 + 1) + 1 < 16 * MiB // runner.block_bytes()
