"""Start-up resolution: the attention spec the backend is selected for is the one the model's layers build."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import torch
from tiny import make_tokenizer, tiny_config

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.paths import op_schemas_key
from pagellm.engine.setup import resolve_engine
from pagellm.models.base import ModelInit
from pagellm.models.loader import import_model_class

WINDOW = dict(use_sliding_window=True, sliding_window=64)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
}


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),
        ("qwen3", {}),  # head_dim from the config
        ("mistral", dict(sliding_window=64)),  # every layer windowed
        ("qwen2", dict(WINDOW, max_window_layers=1)),  # layer 1 windowed, layer 0 not
        ("qwen2", dict(WINDOW, max_window_layers=2)),  # a window in the config that no layer uses
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True)),  # a scale per layer
        ("opt", {}),
    ],
)
def test_the_selected_spec_is_what_the_layers_build(arch, overrides, tmp_path):
    config = tiny_config(arch, len(make_tokenizer()), architectures=[ARCHITECTURES[arch]], **overrides)
    config.save_pretrained(tmp_path)
    setup = resolve_engine(EngineConfig(model=str(tmp_path), dtype="float32", attention_backend="TORCH_SDPA"))
    init = ModelInit(setup.hf_config, setup.dtype, setup.backend, setup.config.block_size)
    with torch.device("meta"):
        model = import_model_class(setup.model_class_path)(init)
    specs = [layer.spec for layer in model.attention_layers()]
    assert setup.spec in specs
    windows = [s.sliding_window for s in specs if s.sliding_window is not None]
    assert setup.spec.sliding_window == (windows[0] if windows else None)


@pytest.fixture
def fake_cuda_with_flash_attn(monkeypatch):
    """An H100 as the CUDA platform's probes see it, and flash-attn 2.7 installed (metadata and module)."""
    from pagellm.platforms import cuda

    for probe, value in (
        ("_torch_hip_version", None),
        ("_torch_cuda_version", "12.8"),
        ("_cuda_device_count", 1),
    ):
        monkeypatch.setattr(cuda, probe, lambda v=value: v)
    for fact, value in (("device_capability", (9, 0)), ("device_name", "Fake H100"), ("device_count", 1)):
        monkeypatch.setattr(cuda.CudaPlatform, fact, classmethod(lambda cls, *a, v=value: v))
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "2.7.4" if name == "flash-attn" else real_version(name)
    )
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setenv("PAGELLM_ATTENTION_TIMING", "0")  # preference order: FLASH_ATTN first on CUDA


def _llama_dir(tmp_path):
    tiny_config("llama", len(make_tokenizer()), architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    return str(tmp_path)


def test_auto_on_cuda_picks_flash_attn_with_its_block_size(fake_cuda_with_flash_attn, tmp_path):
    config = EngineConfig(model=_llama_dir(tmp_path), device="cuda", dtype="bfloat16")
    setup = resolve_engine(config)
    assert setup.backend.name == "FLASH_ATTN"
    assert setup.spec.block_size == 256 and config.block_size == 256 and setup.config.block_size == 256
    assert (
        "KV-cache block size 256 (FLASH_ATTN's preferred, as no --block-size was given)" in setup.explanation
    )


def test_an_explicit_block_size_on_cuda_refuses_flash_attn_with_the_reason(
    fake_cuda_with_flash_attn, tmp_path
):
    model = _llama_dir(tmp_path)
    setup = resolve_engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", block_size=16))
    assert setup.backend.name != "FLASH_ATTN" and setup.spec.block_size == 16
    assert any(
        line.startswith("  rejected FLASH_ATTN: block size 16: flash-attn") for line in setup.explanation
    )
    with pytest.raises(ConfigError, match="FLASH_ATTN cannot run .*block size 16.*--block-size 256"):
        resolve_engine(
            EngineConfig(
                model=model, device="cuda", dtype="bfloat16", block_size=16, attention_backend="FLASH_ATTN"
            )
        )


def test_on_cpu_the_block_size_stays_16(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_ATTENTION_TIMING", "0")
    config = EngineConfig(model=_llama_dir(tmp_path), device="cpu", dtype="float32")
    setup = resolve_engine(config)
    assert setup.platform.name == "cpu" and setup.spec.block_size == 16 and config.block_size == 16


def test_compiled_code_is_cached_under_pagellms_folder_before_anything_compiles(tmp_path, monkeypatch):
    """Inductor fixes its cache folder at its first compile. The attention backends' timing compiles flex
    attention before the model, so the folder must be set before the timings: otherwise the first start's
    graphs went to /tmp/torchinductor_<user> and the next start, with its timings cached, compiled again."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    config = tiny_config("llama", len(make_tokenizer()), architectures=[ARCHITECTURES["llama"]])
    config.save_pretrained(tmp_path / "model")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    resolve_engine(
        EngineConfig(model=str(tmp_path / "model"), dtype="float32", attention_backend="TORCH_SDPA")
    )
    assert inductor_cache_dir() == os.path.join(str(tmp_path / "cache"), "inductor", op_schemas_key())


def test_a_fresh_process_compiles_into_pagellms_folder(tmp_path):
    """In a process as the CLI starts one (no TORCHINDUCTOR_CACHE_DIR; pagellm and the runner imported, and
    torch imports that make inductor write its default folder into the environment), start-up still
    points inductor at pagellm's folder."""
    config = tiny_config("llama", len(make_tokenizer()), architectures=[ARCHITECTURES["llama"]])
    config.save_pretrained(tmp_path / "model")
    script = (
        "import os, pagellm.worker.model_runner, torch._dynamo.decorators\n"
        "from pagellm.core.config import EngineConfig\n"
        "from pagellm.engine.setup import resolve_engine\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        f"resolve_engine(EngineConfig(model={str(tmp_path / 'model')!r}, dtype='float32', "
        "attention_backend='TORCH_SDPA'))\n"
        "print(cache_dir())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PAGELLM_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    folder = out.stdout.strip().splitlines()[-1]
    assert os.path.dirname(folder) == os.path.join(str(tmp_path / "cache"), "inductor"), out.stderr[-2000:]


def test_the_inductor_folder_changes_with_pagellms_operator_schemas():
    """A graph compiled before an operator gained an argument must not be loaded after (inductor's keys
    do not cover the schema: the cached C++ wrapper called the op with the old arguments and crashed)."""
    before = op_schemas_key()
    assert len(before) == 12 and before == op_schemas_key()
    library = torch.library.Library("pagellm", "FRAGMENT")
    try:
        library.define("_schema_key_probe(Tensor x) -> Tensor")
        assert op_schemas_key() != before
    finally:
        library._destroy()
    assert op_schemas_key() == before
