"""Start-up resolution: the attention spec the backend is selected for is the one the model's layers build."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tokenizer, tiny_config

from pagellm.core.config import EngineConfig
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
