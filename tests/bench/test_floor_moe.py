"""The floor of mixture-of-experts models (pagellm.bench.floor, pagellm.bench.experts): a tiny Qwen3-MoE
shape counted by hand, and every MoE family's config against its loaded engine."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagellm.bench import floor as fl
from pagellm.bench.experts import MOE_FAMILIES, Experts
from pagellm.bench.floor import Floor, Machine, ModelShape, workload_work

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import make_tiny_checkpoint  # noqa: E402

# hidden 8, 2 layers, 2 heads of 4, 1 KV head, vocab 10; layer 0 a dense MLP of 16, layer 1 8 experts of
# width 4, 2 per token:
#   attention per layer: qkv 8 * (8 + 4 + 4) = 128, o 8 * 8 = 64 -> 192; 2 layers: 384
#   layer 0's MLP 3 * 8 * 16 = 384; layer 1's router 8 * 8 = 64 -> linears 384 + 384 + 64 = 832
#   one expert 3 * 8 * 4 = 96 weights, 192 bytes in bf16; a token runs 2 of them: 2 * 2 * 96 = 384 FLOPs
#   distinct experts n tokens choose (uniform): 8 * (1 - (3/4)^n): 2 for one token, 5.46875 for four
TINY_MOE = SimpleNamespace(
    model_type="qwen3_moe",
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    moe_intermediate_size=4,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
    vocab_size=10,
)
MACHINE = Machine(peak_flops=1e4, read_bytes_s=1e4, dtype="bfloat16", device="cpu", threads=1, measured=False)


def expected_distinct(n: int) -> float:
    return 8 * (1 - 0.75**n)


def test_shape_of_a_tiny_moe_config():
    shape = ModelShape.from_hf_config(TINY_MOE, torch.bfloat16)
    assert shape.linear_params == 832 and shape.linear_bytes == 832 * 2
    assert shape.experts == Experts(layers=1, num_experts=8, top_k=2, params=96, bytes=192, local_experts=8)
    assert shape.weight_bytes == (832 + 80) * 2  # experts apart: charged by the tokens that choose them
    assert shape.experts.distinct(1) == 2 and shape.experts.distinct(4) == 5.46875


def test_a_decode_step_reads_the_experts_its_tokens_choose():
    shape = ModelShape.from_hf_config(TINY_MOE, torch.bfloat16)
    one = fl.step_work(shape, [(9, 1, True)])
    assert one.expert_flops == 2 * 2 * 96
    assert one.expert_bytes == 2 * 192  # one token: its 2 experts
    batch = fl.step_work(shape, [(9, 1, True)] * 64)
    assert batch.linear_flops == 2 * 832 * 64
    assert batch.expert_flops == 64 * 2 * 2 * 96  # K of E experts per token
    assert batch.expert_bytes == pytest.approx(expected_distinct(64) * 192)  # nearly all 8
    assert batch.weight_bytes == (832 + 80) * 2
    floor = Floor(batch, MACHINE)
    assert floor.memory_s == pytest.approx(((832 + 80) * 2 + expected_distinct(64) * 192 + 64 * 9 * 32) / 1e4)
    assert "+ experts" in fl.format_floor(floor.report())


def test_workload_charges_experts_by_the_all_at_once_schedule():
    """Prompts 3 and 2 (one cached), outputs 3 and 1: one step of 3 + 1 prompt tokens, then decode steps
    of 1 token each (only the first request has a second and third output token)."""
    shape = ModelShape.from_hf_config(TINY_MOE, torch.bfloat16)
    work = workload_work(shape, [3, 2], [3, 1], steps=3, cached=[0, 1])
    assert work.expert_bytes == pytest.approx((5.46875 + 2 + 2) * 192)
    assert work.expert_flops == (3 + 1 + 2) * 2 * 2 * 96  # 4 prompt tokens, 2 decode tokens
    assert work.weight_bytes == 3 * (832 + 80) * 2


def test_expert_parallel_rank_holds_a_share():
    half = Experts(layers=2, num_experts=8, top_k=2, params=96, bytes=192, local_experts=4)
    assert half.flops_per_token() == 2 * 2 * 96 * 2 / 2
    assert half.distinct(1) == 1 and half.step_bytes(1) == 2 * 1 * 192


def test_dense_model_has_no_expert_terms():
    """The same config without experts is test_floor's dense TINY: 1152 linear weights, nothing else."""
    dense = {k: v for k, v in vars(TINY_MOE).items() if "expert" not in k}
    shape = ModelShape.from_hf_config(SimpleNamespace(**{**dense, "model_type": "llama"}), torch.bfloat16)
    assert shape.experts is None and shape.linear_params == 1152
    work = workload_work(shape, [3], [3], steps=3)
    assert work.expert_flops == work.expert_bytes == 0
    assert "experts" not in fl.format_floor(Floor(work, MACHINE).report())


def test_unknown_experts_are_refused():
    olmoe = SimpleNamespace(**{**vars(TINY_MOE), "model_type": "olmoe"})
    with pytest.raises(ValueError, match="experts of 'olmoe'"):
        ModelShape.from_hf_config(olmoe, torch.bfloat16)


@pytest.mark.parametrize("arch", [f for f in MOE_FAMILIES if f not in ("qwen3_next", "qwen3_5_moe_text")])
def test_loaded_moe_engine_agrees_with_its_config(arch, tmp_path):
    from pagellm import LLM

    llm = LLM(str(make_tiny_checkpoint(arch, tmp_path)), dtype="float32", kv_cache_space=0.01)
    from_model = ModelShape.from_llm(llm)
    from_config = ModelShape.from_hf_config(llm.engine.setup.hf_config, torch.float32)
    assert from_model.experts is not None and from_model.experts == from_config.experts
    assert from_model.linear_params == from_config.linear_params
    assert from_model.lm_head_params == from_config.lm_head_params
    assert from_model.kv_bytes_per_token == from_config.kv_bytes_per_token
    assert (from_model.num_heads, from_model.num_kv_heads, from_model.head_size, from_model.v_head_size) == (
        from_config.num_heads,
        from_config.num_kv_heads,
        from_config.head_size,
        from_config.v_head_size,
    )
    # biases (and DeepSeek-V3's correction bias) are in the engine's bytes only
    assert 0 <= from_model.weight_bytes - from_config.weight_bytes < 0.05 * from_config.weight_bytes


def test_layers_whose_experts_take_different_bytes_are_charged_their_mean(tmp_path):
    """llama-quantize's Q4_K_M keeps some layers' down projections in more bits (model E: Q5_0 in most
    layers, Q8_0 in some): the floor charges each expert the layers' mean bytes, not a refusal."""
    from pagellm import LLM
    from pagellm.bench.experts import experts_of_model
    from pagellm.models.layers.fused_moe.block import SparseMoeBlock

    llm = LLM(str(make_tiny_checkpoint("qwen3_moe", tmp_path)), dtype="float32", kv_cache_space=0.01)
    model = llm.engine.runner.model
    layers = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(layers) >= 2
    plain = experts_of_model(model)
    layers[0].expert_block_bytes = 300
    for layer in layers[1:]:
        layer.expert_block_bytes = 100
    mixed = experts_of_model(model)
    assert mixed.params == plain.params and mixed.layers == plain.layers
    assert mixed.bytes == round((300 + 100 * (len(layers) - 1)) / len(layers))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_reads_the_indexer_keys_and_k_latent_rows(arch, tmp_path):
    """A decode query far past index_topk (8 in the tiny configs) attends to k latent rows a layer and its
    indexers read every earlier key: the loaded engine and its config agree on both."""
    from pagellm import LLM

    llm = LLM(str(make_tiny_checkpoint(arch, tmp_path)), dtype="float32", kv_cache_space=0.01)
    c = llm.engine.setup.hf_config
    from_model = ModelShape.from_llm(llm)
    from_config = ModelShape.from_hf_config(c, torch.float32)
    indexed = sum(
        kind == "full" for kind in (getattr(c, "indexer_types", None) or ["full"] * c.num_hidden_layers)
    )
    for shape in (from_model, from_config):
        assert shape.num_layers == c.num_hidden_layers  # the indexers' key caches are not attention layers
        assert shape.layer_windows == (c.index_topk,) * c.num_hidden_layers
        assert shape.index_bytes_per_token == indexed * c.index_head_dim * 4
        assert shape.index_flops_per_key == 2.0 * indexed * c.index_n_heads * c.index_head_dim
        assert shape.kv_bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert from_model.linear_params == from_config.linear_params
    context = 1000
    work = from_config.chunk_work(context, 1, samples=True)
    rows = c.num_hidden_layers * c.index_topk
    assert work.attention_flops == from_config.attention_flops(rows) + from_config.index_flops_per_key * (
        context + 1
    )
    latent = from_config.kv_bytes_per_token / c.num_hidden_layers
    assert (
        work.kv_bytes
        == latent * c.num_hidden_layers * (c.index_topk - 1) + indexed * c.index_head_dim * 4 * context
    )
