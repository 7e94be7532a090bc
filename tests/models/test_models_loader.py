"""Checkpoint formats, weight mapping checks, architecture resolution and the quantization hook."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from tiny import make_tiny_checkpoint, write_bin_checkpoint
from torch import nn
from transformers import AutoConfig

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.errors import ConfigError
from pagellm.core.quant import QuantMethod
from pagellm.models.base import ModelInit
from pagellm.models.layers.linear import Linear
from pagellm.models.loader import iter_checkpoint_weights, load_model, model_weight_bytes, resolve_model_class
from pagellm.models.registry import pagellm_models
from pagellm.plugins import load_plugins

PROMPT = [5, 77, 200, 13, 150, 42, 99, 260]


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint_weights(model_dir))


def _assert_matches_reference(path, reference=None, **init_kwargs):
    reference = reference or load_reference(path)
    got = PagedRunner(load_pagellm(path, **init_kwargs), num_seqs=1).step({0: PROMPT})[0]
    torch.testing.assert_close(got, reference_logits(reference, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["sharded-safetensors", "bin", "sharded-bin"])
def test_checkpoint_formats_load_the_same_tensors(fmt, tmp_path):
    single = _weights(make_tiny_checkpoint("qwen2", tmp_path / "single"))
    if fmt == "sharded-safetensors":
        path = make_tiny_checkpoint("qwen2", tmp_path / "other", max_shard_size="20KB")
        assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    else:
        path = make_tiny_checkpoint("qwen2", tmp_path / "other")
        write_bin_checkpoint(path, shards=3 if fmt == "sharded-bin" else 1)
        assert not list(path.glob("*.safetensors"))
    other = _weights(path)
    assert other.keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(other[name], tensor, atol=0, rtol=0)
    _assert_matches_reference(path)


def test_no_weights_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no \\*.safetensors or pytorch_model"):
        list(iter_checkpoint_weights(tmp_path))


def test_tied_embeddings_share_one_tensor(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=True)
    model = load_pagellm(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = load_pagellm(make_tiny_checkpoint("llama", tmp_path / "untied"))
    assert model_weight_bytes(untied) - model_weight_bytes(model) == model.lm_head.weight.numel() * 4


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    path = make_tiny_checkpoint("gpt2", tmp_path)
    config = AutoConfig.from_pretrained(path)
    weights = _weights(path)
    weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()
    legacy = {name.removeprefix("transformer."): t for name, t in weights.items()}  # pre-prefix GPT-2 names
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
    init = ModelInit(config, torch.float32, TorchSDPABackend)
    model = load_model(resolve_model_class(config, pagellm_models()), init, legacy.items(), "cpu")
    torch.testing.assert_close(model.lm_head.weight, weights["transformer.wte.weight"])


def _init(path) -> tuple[str, ModelInit]:
    config = AutoConfig.from_pretrained(path)
    return resolve_model_class(config, pagellm_models()), ModelInit(config, torch.float32, TorchSDPABackend)


def test_missing_weights_are_named(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    weights = {n: t for n, t in _weights(path).items() if n != "model.layers.1.mlp.down_proj.weight"}
    with pytest.raises(ConfigError, match="no weights for model.layers.1.mlp.down_proj.weight"):
        load_model(*_init(path), weights.items(), "cpu")


def test_shape_mismatch_and_unknown_tensors_are_named(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    weights = _weights(path)
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ConfigError, match=r"model.norm.weight.*shape \(3,\)"):
        load_model(*_init(path), weights.items(), "cpu")
    weights = _weights(path)
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.ones(5, 64)
    with pytest.raises(ConfigError, match="does not match the weights"):
        load_model(*_init(path), weights.items(), "cpu")
    weights = _weights(path)
    weights["model.vision_tower.weight"] = torch.ones(1)
    with pytest.raises(ConfigError, match="model.vision_tower.weight"):
        load_model(*_init(path), weights.items(), "cpu")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    config = AutoConfig.from_pretrained(make_tiny_checkpoint("llama", tmp_path))
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(
        ConfigError,
        match="FalconForCausalLM.*supported architectures: .*DeepseekV2ForCausalLM, .*GPT2LMHeadModel",
    ):
        resolve_model_class(config, pagellm_models())


def test_models_register_through_the_plugin_entry_point():
    models = load_plugins().models
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert models[arch].startswith("pagellm.models.llama:")
    assert models["GPT2LMHeadModel"] == "pagellm.models.gpt2:GPT2LMHeadModel"
    assert models["OPTForCausalLM"] == "pagellm.models.opt:OPTForCausalLM"


class _RepackingMethod(QuantMethod):
    """A stand-in quantization method: plain weights, repacked transposed after loading."""

    name = "test-repack"

    def __init__(self):
        super().__init__()
        self.repacked: list[nn.Module] = []

    def create_weights(self, layer, in_features, out_features, params_dtype):
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=params_dtype), requires_grad=False
        )

    def process_weights_after_loading(self, layer):
        layer.weight_t = layer.weight.t().contiguous()
        self.repacked.append(layer)

    def apply(self, layer, x, bias=None):
        y = x @ layer.weight_t
        return y if bias is None else y + bias


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_linear_layers_use_the_quant_method(arch, tmp_path):
    path = make_tiny_checkpoint(arch, tmp_path)
    method = _RepackingMethod()
    _assert_matches_reference(path, quant_method=method)
    linears = [m for m in load_pagellm(path).modules() if isinstance(m, Linear)]
    assert len(method.repacked) == len(linears) - (arch == "qwen2")  # every linear but the untied lm_head
