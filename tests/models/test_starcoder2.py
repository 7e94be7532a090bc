"""StarCoder2 against transformers on tiny checkpoints: logits through prefill and decode with and without
biases, window and tied head; a tensor-parallel rank's part of the plain MLP and the biases; GGUF files
refused; under -m slow, greedy parity on two ranks (tensor or pipeline parallel) and with a LoRA adapter.
Greedy parity through the engine (chunked prefill, prefix-cache hits, preemption) is
tests/engine/test_family_parity.py (FAMILIES["starcoder2"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from parity import Reference, assert_greedy_parity, assert_two_rank_parity, mixed_prompts
from peft_adapters import (
    assert_adapter_changes_outputs,
    assert_adapter_refused,
    lora_engine,
    make_peft_adapter,
)
from safetensors.torch import load_file
from tiny import make_tiny_checkpoint, tiny_config
from transformers import AutoConfig

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.errors import ConfigError
from pagellm.distributed import Group, Parallel
from pagellm.models.base import ModelInit
from pagellm.models.gguf_config import fill_gguf_config
from pagellm.models.loader import iter_checkpoint_weights, load_model

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]  # longer than the window of 32
VARIANTS = {
    "starcoder2": {},
    # checkpoints of the other kind: no biases, no window, an output projection of its own, plain gelu
    "starcoder2-untied-no-bias-no-window": {
        "use_bias": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "hidden_act": "gelu",
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    overrides = VARIANTS[variant]
    path = make_tiny_checkpoint("starcoder2", tmp_path, **overrides)
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    assert [a.spec.sliding_window for a in model.attention_layers()] == [config.sliding_window] * 2
    layer = model.model.layers[0]
    biases = [layer.self_attn.qkv_proj.bias, layer.self_attn.o_proj.bias, layer.mlp.c_fc.bias]
    assert all((b is not None) == config.use_bias for b in biases)
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_a_tensor_parallel_rank_keeps_its_part(tmp_path):
    """Rank 1 of 2: its half of c_fc's rows and bias, of c_proj's columns with c_proj's whole bias (added
    once, after the ranks' sum), its heads of q/k/v with their biases and o_proj's whole bias."""
    path = make_tiny_checkpoint("starcoder2", tmp_path)  # 4 heads, 2 KV heads of 16, MLP 128
    full = load_file(str(path / "model.safetensors"))
    parallel = Parallel(tp=Group(size=2, rank=1, ranks=[0, 1]))
    init = ModelInit(AutoConfig.from_pretrained(path), torch.float32, TorchSDPABackend, parallel=parallel)
    model = load_model(
        "pagellm.models.starcoder2:Starcoder2ForCausalLM", init, iter_checkpoint_weights(path), "cpu"
    )
    layer = model.model.layers[1]
    prefix = "model.layers.1."
    mlp, attn = layer.mlp, layer.self_attn
    torch.testing.assert_close(mlp.c_fc.weight, full[prefix + "mlp.c_fc.weight"][64:], rtol=0, atol=0)
    torch.testing.assert_close(mlp.c_fc.bias, full[prefix + "mlp.c_fc.bias"][64:], rtol=0, atol=0)
    torch.testing.assert_close(mlp.c_proj.weight, full[prefix + "mlp.c_proj.weight"][:, 64:], rtol=0, atol=0)
    torch.testing.assert_close(mlp.c_proj.bias, full[prefix + "mlp.c_proj.bias"], rtol=0, atol=0)
    q, k, v = (full[f"{prefix}self_attn.{n}_proj.bias"] for n in "qkv")
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat([q[32:], k[16:], v[16:]]), rtol=0, atol=0)
    o = f"{prefix}self_attn.o_proj."
    torch.testing.assert_close(attn.o_proj.weight, full[o + "weight"][:, 32:], rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.bias, full[o + "bias"], rtol=0, atol=0)


class _StarCoder2GGUF:
    """The part of a GGUF reader `fill_gguf_config` reads: a `starcoder2` file's architecture."""

    tensors = ()

    def get_field(self, key: str):
        if key != "general.architecture":
            return None
        return type("Field", (), {"contents": lambda self: "starcoder2"})()


def test_a_gguf_file_is_refused_at_start():
    """transformers' reader drops the rope base and the window: refused as the file's config is read."""
    with pytest.raises(ConfigError, match="StarCoder2 GGUF files are not supported"):
        fill_gguf_config(tiny_config("starcoder2", 384), _StarCoder2GGUF())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_greedy_parity_on_two_ranks(tmp_path, tp, pp):
    assert_two_rank_parity("starcoder2", tmp_path, 2, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.slow
def test_lora_on_attention_equals_peft_merged_and_on_the_mlp_is_refused(tmp_path):
    """A PEFT adapter on q/k/v/o: greedy outputs equal peft's merge_and_unload() model's. One on c_fc (the
    plain MLP, no LoRA target of pagellm's) is refused when it is added, naming the module."""
    base = make_tiny_checkpoint("starcoder2", tmp_path)
    engine = lora_engine(base, tmp_path / "attention", ["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = mixed_prompts(300)[:6]
    assert_greedy_parity(engine, Reference(tmp_path / "attention" / "merged", 8), prompts)
    assert_adapter_changes_outputs(engine, prompts)
    mlp = make_peft_adapter(base, tmp_path / "mlp", ["c_fc"], merged=False)
    assert_adapter_refused(engine.llm, mlp, prompts, "c_fc")
