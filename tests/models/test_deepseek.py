"""DeepSeek-V2 and -V3 (Multi-head Latent Attention, a dense layer then mixture-of-experts layers) against
transformers on tiny checkpoints: logits through prefill and decode for each q path, rope layout and
routing (V2 greedy and group-limited softmax, V3 sigmoid with the correction bias over groups, renormalised
or not), which layers have experts (`moe_layer_freq` too), the latent KV cache's size against a K/V cache
of the same model, the MTP layer skipped, and greedy parity on both CPU backends that run the latent
layout. Greedy parity under chunking, prefix hits and preemption is in tests/engine/test_family_parity.py
(FAMILIES); each router alone against transformers' in tests/models/test_moe_routing.py."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.floor import ModelShape
from pagellm.core.attention import AttentionSpec
from pagellm.core.config import EngineConfig
from pagellm.core.errors import BackendUnsupportedError, ConfigError
from pagellm.core.kv_cache_spec import KVCacheSpec
from pagellm.engine.setup import resolve_engine
from pagellm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, mla_softmax_scale
from pagellm.models.layers.fused_moe.block import SparseMoeBlock

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]

VARIANTS = {
    # q_proj, interleaved (complex) rope, default rope; softmax top 2 ("greedy"), 2 shared experts
    "deepseek_v2-lite": ("deepseek_v2", {}),
    "deepseek_v2-q_lora-bias-group_limited_greedy": (
        "deepseek_v2",
        {
            "q_lora_rank": 24,
            "attention_bias": True,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.0,
        },
    ),
    # q_lora, interleaved pairs, YaRN with mscale; sigmoid + correction bias, top 3 of 2 of 4 groups
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-not-interleaved-unnormalised-2-moe-layers": (
        "deepseek_v3",
        {
            "rope_interleave": False,
            "norm_topk_prob": False,
            "num_hidden_layers": 3,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    reference = load_reference(path)
    model = load_pagellm(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [
        isinstance(layer.mlp, (DeepseekV2Moe, DeepseekV3MoE)) for layer in reference.model.layers
    ]
    assert sparse[0] is False and all(sparse[1:])
    runner = PagedRunner(model, num_seqs=2)

    ids, other = list(PROMPT), PROMPT[::-1]
    got = runner.step({0: ids, 1: other[:5]})
    torch.testing.assert_close(got[0], reference_logits(reference, ids), atol=ATOL, rtol=0)
    for i in range(4):  # decodes beside the other sequence's prefill chunks
        ids.append(int(got[0][-1].argmax()))
        got = runner.step({0: ids[-1:], 1: other[5 + 2 * i : 7 + 2 * i]})
        torch.testing.assert_close(got[0][-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], reference_logits(reference, other[:13])[11:], atol=ATOL, rtol=0)


def gqa_bytes_per_token(config, itemsize: int) -> int:
    """One layer's K and V of one token in a cache of per-head rows: num_heads x (qk_nope + qk_rope) for K
    and num_heads x v_head_dim for V."""
    heads = config.num_attention_heads
    return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * itemsize


def latent_bytes_per_token(config, dtype: torch.dtype) -> int:
    spec = KVCacheSpec.of(DeepseekV3ForCausalLM.attention_spec(config, dtype, 16, 0))
    return spec.page_bytes // spec.block_size


def test_latent_cache_is_a_fraction_of_a_kv_cache():
    """DeepSeek-V3's real dimensions (transformers' config defaults): 576 elements per token and layer
    against 128 heads x (192 + 128) = 40,960, 1/71 of it; the tiny test model: 40 against 192."""
    from tiny import tiny_config
    from transformers import DeepseekV3Config

    v3 = DeepseekV3Config()
    assert (v3.kv_lora_rank, v3.qk_rope_head_dim, v3.num_attention_heads) == (512, 64, 128)
    assert latent_bytes_per_token(v3, torch.bfloat16) == 576 * 2
    assert gqa_bytes_per_token(v3, 2) == 40_960 * 2
    assert round(gqa_bytes_per_token(v3, 2) / latent_bytes_per_token(v3, torch.bfloat16), 1) == 71.1
    tiny = tiny_config("deepseek_v3", vocab_size=384)
    assert latent_bytes_per_token(tiny, torch.float32) == 40 * 4
    assert gqa_bytes_per_token(tiny, 4) == 192 * 4


def test_engine_keeps_one_latent_row_per_token(tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=256)
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 2
    spec = llm.engine.setup.spec
    assert spec.latent_kv and spec.num_kv_heads == 1 and (spec.head_size, spec.v_size) == (40, 32)
    for cache in caches:  # [1, KV heads, blocks, block size, row] (CPU_ATTN) or [1, blocks, ...]
        assert cache.shape[0] == 1 and cache.shape[-1] == 40 and cache.numel() == 32 * 16 * 40


def test_mtp_layer_is_skipped(tmp_path):
    """V3 checkpoints hold the multi-token-prediction module as layer num_hidden_layers: its tensors load
    into nothing and change nothing."""
    from safetensors.torch import save_file

    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    before = PagedRunner(load_pagellm(path), 1).step({0: PROMPT})[0]
    mtp = {
        "model.layers.2.eh_proj.weight": torch.randn(64, 128),
        "model.layers.2.enorm.weight": torch.randn(64),
        "model.layers.2.hnorm.weight": torch.randn(64),
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": torch.randn(40, 64),
        "model.layers.2.mlp.gate_proj.weight": torch.randn(128, 64),
        "model.layers.2.shared_head.head.weight": torch.randn(384, 64),
    }
    save_file(mtp, path / "model-mtp.safetensors")
    after = PagedRunner(load_pagellm(path), 1).step({0: PROMPT})[0]
    assert torch.equal(before, after)


def test_moe_layer_freq_keeps_layers_between_dense():
    """DeepSeek's own modelling code (transformers reads no moe_layer_freq): experts on layer i when
    i >= first_k_dense_replace and moe_layer_freq divides i."""
    from tiny import tiny_config

    from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
    from pagellm.models.base import ModelInit

    config = tiny_config("deepseek_v2", vocab_size=384, num_hidden_layers=5, moe_layer_freq=2)
    model = DeepseekV2ForCausalLM(ModelInit(config, torch.float32, TorchSDPABackend))
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [False, False, True, False, True]


def test_v2_topk_methods_other_than_greedy_and_group_limited_are_refused():
    from tiny import tiny_config

    from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
    from pagellm.models.base import ModelInit

    config = tiny_config("deepseek_v2", vocab_size=384, topk_method="noaux_tc")
    with pytest.raises(ConfigError, match="topk_method 'noaux_tc' is not supported"):
        DeepseekV2ForCausalLM(ModelInit(config, torch.float32, TorchSDPABackend))


def test_correction_bias_is_loaded_and_changes_the_choice(tmp_path):
    """The tiny V3 checkpoint's `e_score_correction_bias` is not zero and moves some token to other experts,
    so the logits test above depends on it."""
    from safetensors.torch import load_file

    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    saved = load_file(str(path / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    gate = load_pagellm(path).model.layers[1].mlp.gate
    assert saved.abs().min() > 0 and torch.equal(gate.e_score_correction_bias.cpu(), saved)
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(saved.device)
    ids = gate.route(hidden.to(gate.weight.device))[1].sort().values
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
    assert not torch.equal(ids, gate.route(hidden.to(gate.weight.device))[1].sort().values)


def test_softmax_scale_is_transformers():
    """DeepSeek-V3's YaRN (factor 40, mscale_all_dim 1): the scale grows by mscale squared."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    config = DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163840)
    expected = yarn_apply_mscale(config.rope_parameters, 192**-0.5)
    assert mla_softmax_scale(config) == pytest.approx(expected, rel=1e-12)
    assert expected > 1.8 * 192**-0.5
    assert mla_softmax_scale(DeepseekV3Config()) == 192**-0.5  # default rope: no mscale


def test_latent_spec_is_refused_by_backends_without_it(tmp_path):
    path = make_tiny_checkpoint("deepseek_v2", tmp_path)
    with pytest.raises(BackendUnsupportedError, match="no latent KV cache \\(MLA\\) support"):
        resolve_engine(EngineConfig(model=str(path), dtype="float32", attention_backend="FLEX_ATTENTION"))
    with pytest.raises(ValueError, match="latent_kv"):
        AttentionSpec(4, 1, 40, torch.float32, v_head_size=32)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA"])
def test_greedy_parity_on_each_cpu_backend(backend, tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    reference = Reference(path, max_tokens=8)
    llm = LLM(
        str(path),
        dtype="float32",
        attention_backend=backend,
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    assert llm.engine.setup.backend.name == backend
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=2)[:8])


def test_bfloat16_up_projections_run_on_the_platforms_per_head_kernel(tmp_path, monkeypatch):
    """On a CPU with the AVX-512 BF16 pair kernel, MLA's two per-head products (W_UK, W_UV) are packed for
    it at load (`Platform.pack_per_head`) and the plain weight dropped; greedy tokens equal the same engine
    on torch.bmm's products."""
    from pagellm.platforms import cpu

    if cpu._bf16_pair_kernels() is None:
        pytest.skip("no AVX-512 BF16 pair kernel here")
    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    prompts = [{"prompt_token_ids": PROMPT}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    packed = LLM(str(path), dtype="bfloat16", num_kv_blocks=32, max_model_len=256, enforce_eager=True)
    projections = [m for m in packed.engine.runner.model.modules() if hasattr(m, "packed_absorb")]
    assert projections and all(m.weight is None for m in projections)
    tokens = packed.generate(prompts, params)[0].outputs[0].token_ids
    monkeypatch.setattr(cpu.CpuPlatform, "pack_per_head", classmethod(lambda cls, weight: None))
    plain = LLM(str(path), dtype="bfloat16", num_kv_blocks=32, max_model_len=256, enforce_eager=True)
    assert not any(hasattr(m, "packed_absorb") for m in plain.engine.runner.model.modules())
    assert plain.generate(prompts, params)[0].outputs[0].token_ids == tokens
    # the bench's floor counts the same weights either way
    assert ModelShape.from_llm(packed).linear_params == ModelShape.from_llm(plain).linear_params
