"""Tiny random Hugging Face checkpoints for tests, with a locally built byte-level BPE tokenizer.

`make_tiny_checkpoint("llama", tmp_path)` writes a 2-layer, 64-wide model of that architecture and its
tokenizer (ChatML chat template) to a directory and returns it. Weights are drawn with a large spread and
norm weights and biases are randomised too, so greedy choices are decisive and every tensor matters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "opt",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "gemma3n_text",
    "phi3",
    "granite",
    "olmo2",
    "olmo3",
    "smollm3",
    "seed_oss",
    "exaone4",
    "starcoder2",
    "cohere2",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "glm4",
    "glm4_moe",
    "llama4_text",
    "olmoe",
    "granitemoe",
    "ernie4_5_moe",
    "minimax_m2",
    "hunyuan_v1_moe",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "granitemoehybrid",
    "granitemoehybrid_dense",
    "bamba",
    "nemotron_h",
    "falcon_h1",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "olmo_hybrid",
    "kimi_linear",
    "ministral3",
    "mistral4",
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# GPT-OSS's harmony format: pad, bos and eos at ids 0-2 as above (<|return|> ends an assistant's final
# message), then the tokens that frame messages
HARMONY_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|startoftext|>",
    "<|return|>",
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|channel|>",
    "<|call|>",
    "<|constrain|>",
)
# the shape of gpt-oss's own template, without its date section and with the tools' parameters as JSON
# rather than TypeScript: a system header naming the channels, system/developer instructions as a developer
# message, the tools as a developer message declaring `namespace functions`, earlier assistant turns on the
# final channel (their reasoning, `thinking`, on the analysis channel), their calls as commentary messages
# `to=functions.NAME` with the arguments as JSON, a tool's result as a message from `functions.NAME` (the
# last call's name), and the assistant's header to generate after
HARMONY_CHAT_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}// {{ tool['function']['description'] }}\n"
    "type {{ tool['function']['name'] }} = (_: {{ tool['function']['parameters'] | tojson }}) => any;\n\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% set last = namespace(call='') %}"
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}"
    "<|start|>developer<|message|># Instructions\n\n{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}"
    "{% if message.get('thinking') %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message['thinking'] }}<|end|>"
    "{% endif %}"
    "{% if message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}"
    "<|start|>assistant to=functions.{{ call['function']['name'] }}<|channel|>commentary json<|message|>"
    "{{ call['function']['arguments'] | tojson }}<|call|>"
    "{% set last.call = call['function']['name'] %}"
    "{% endfor %}"
    "{% else %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% elif message['role'] == 'tool' %}"
    "<|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>{{ message['content'] }}<|end|>"
    "{% else %}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a small model that answered every question.",
    "A scheduler decides how many tokens each request runs in one step.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 100 1000",
]

_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
_LLAMA = dict(_SIZES, intermediate_size=128, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.15)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA),
    "mistral": dict(_LLAMA, sliding_window=None),
    "qwen2": dict(_LLAMA),
    "qwen3": dict(_LLAMA, head_dim=16),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.15),
    "opt": dict(_SIZES, ffn_dim=128, word_embed_proj_dim=64, init_std=0.15, dropout=0.0),
    # windows of 32 tokens, so the parity prompts (up to 330 tokens) cross them
    "gemma2": dict(
        _LLAMA,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
    # 5 local : 1 global; the attention scale by the head size, as every Gemma 3 but 27B has it
    "gemma3_text": dict(
        _LLAMA, num_hidden_layers=6, head_dim=16, sliding_window=32, query_pre_attn_scalar=16
    ),
    # Gemma 4, E2B-like: windows of 32 on 5 of 8 layers; the full layers with heads of 64 (of which a quarter
    # of the frequency pairs rotate) over one KV head whose V is its K projection, beside the sliding
    # layers' 2 KV heads of 16 (so the two kinds' KV pages differ, 64 against 32 elements per token and
    # row, as Gemma 4's do); the last 3 layers read the KV of layers 2 (full) and 4 (sliding) and have
    # MLPs twice as wide; per-layer inputs of 8 per layer; a final soft-cap. The MoE form (26B-A4B-like, 8
    # experts of width 32, top 2, beside the MLP) is the "gemma4_text-moe" variant in parity.py
    "gemma4_text": dict(
        _LLAMA,
        num_hidden_layers=8,
        layer_types=["sliding_attention"] * 2
        + ["full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention", "sliding_attention", "full_attention"],
        head_dim=16,
        global_head_dim=64,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        sliding_window=32,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=512,
        final_logit_softcapping=30.0,
    ),
    # Gemma 3n, E2B-like: 4 local : 1 global over 10 layers (windows of 32), the last 3 reading the KV of
    # layers 6 (sliding) and 4 (full); 4 AltUp streams, LAuReL of rank 8, activation sparsity 0.95 in the
    # first 2 layers, MLP widths per layer, per-layer inputs of 8 from a table smaller than the vocabulary
    # (the ids past it read row 0); the final soft-cap of 30 (its default)
    "gemma3n_text": dict(
        _LLAMA,
        num_hidden_layers=10,
        head_dim=16,
        intermediate_size=[128] * 5 + [96] * 5,
        sliding_window=32,
        num_kv_shared_layers=3,
        altup_num_inputs=4,
        laurel_rank=8,
        activation_sparsity_pattern=[0.95] * 2 + [0.0] * 8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
    ),
    "phi3": dict(_LLAMA),
    "granite": dict(
        _LLAMA,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=8.0,
    ),
    "olmo2": dict(_LLAMA),
    # OLMo 3: layers 0-2 sliding (windows of 32), 3 full; a rope per layer type: plain on the sliding
    # layers, YaRN (4 x 128) with another base on the full one (a config's rope_scaling goes to the full
    # layers only)
    "olmo3": dict(
        _LLAMA,
        num_hidden_layers=4,
        sliding_window=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "smollm3": dict(_LLAMA, num_hidden_layers=4),  # no_rope_layers: every fourth layer without rotary
    # Llama 4 (Scout-like): layers 0-2 rope with chunks of 32 (the parity prompts cross them), L2 q/k norm
    # and llama3 rope scaling, layer 3 NoPE and global with the attention temperature (floor_scale 32, so
    # it grows within the prompts); layers 1 and 3 MoE (8 experts of width 32, top 2, a shared expert of
    # 32), 0 and 2 dense MLPs of 128
    "llama4_text": dict(
        _LLAMA,
        num_hidden_layers=4,
        head_dim=16,
        attention_chunk_size=32,
        floor_scale=32,
        attn_scale=0.1,
        intermediate_size=32,
        intermediate_size_mlp=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        interleave_moe_layer_step=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Seed-OSS as released: head_dim 32 (q twice the hidden size wide), GQA, q/k/v biases and none on o_proj
    # or the MLP (tests/models/test_seed_oss.py switches them); its dropouts are off at inference
    "seed_oss": dict(_LLAMA, head_dim=32, attention_bias=True, attention_out_bias=False, mlp_bias=False),
    # EXAONE 4 (32B's kind): layers 0-2 sliding (windows of 32) with rotary, layer 3 full without (NoPE);
    # per-head q/k norms, norms after the blocks (tests/models/test_exaone4.py: the 1.2B's all-full form)
    "exaone4": dict(_LLAMA, num_hidden_layers=4, sliding_window=32, sliding_window_pattern=4),
    # StarCoder2: LayerNorms with biases (norm_epsilon, not rms_norm_eps), biases on every projection, the
    # plain gelu-tanh MLP, GQA, a window of 32 on every layer, tied embeddings (the config's default)
    "starcoder2": dict(
        {k: v for k, v in _LLAMA.items() if k != "rms_norm_eps"}, norm_epsilon=1e-5, sliding_window=32
    ),
    # Command R7B / A: 3 window layers of 32 with interleaved rotary, then a global one without rotary
    # (sliding_window_pattern 4); the parallel block on one bias-free LayerNorm; logits scaled; tied head
    "cohere2": dict(
        {k: v for k, v in _LLAMA.items() if k != "rms_norm_eps"},
        num_hidden_layers=4,
        layer_norm_eps=1e-5,
        sliding_window=32,
        logit_scale=0.25,
    ),
    # mixtures of experts: 8 experts of width 32, 2 per token
    "qwen3_moe": dict(
        _LLAMA,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        _LLAMA,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": dict(
        _LLAMA, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=None
    ),
    # 4 experts of width 32, 2 per token; windows of 8 tokens on layers 0 and 2; YaRN stretching 128 to 512;
    # weights spread wider, so that the experts' SwiGLU clamps some of its inputs at 7
    "gpt_oss": dict(
        _LLAMA,
        initializer_range=0.35,
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    ),
    # MLA (4 heads of 16 nope + 8 rope features over a 32-wide latent), layer 0 dense, layer 1 a mixture of
    # 8 experts of width 32 and shared experts. V2-Lite-like: no q_lora_rank, softmax top 2 ("greedy"),
    # 2 shared experts. V3-like: q_lora_rank, YaRN with mscale_all_dim in the softmax scale and mscale /
    # mscale_all_dim on cos and sin, v_head_dim unlike qk_nope; sigmoid routing with the correction bias,
    # top 3 of the best 2 of 4 groups, renormalised and scaled by 2.5, one shared expert
    "deepseek_v2": dict(
        _LLAMA,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        moe_intermediate_size=32,
    ),
    "deepseek_v3": dict(
        _LLAMA,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ),
    # DeepSeek-V3.2: V3's shape plus the lightning indexer (16 heads of 16, half of each rotating), each query
    # reading its 8 best earlier tokens, so prompts longer than 8 drop tokens; 16 heads keep exact-zero
    # scores (every head's ReLU at 0, 1 in 65,536 with 16 heads, 1 in 256 with 8) and ties among them rare
    "deepseek_v32": dict(
        _LLAMA,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=16,
    ),
    # GLM-5: DeepSeek-V3.2's shape with the indexer's rope in interleaved pairs, and indexers on layers 0
    # and 3 only: layers 1 and 2 attend over layer 0's choice
    "glm_moe_dsa": dict(
        _LLAMA,
        num_hidden_layers=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=16,
        indexer_types=["full", "shared", "shared", "full"],
    ),
    # GLM-4 dense: GQA with head_dim 32 (not hidden / heads), half of it rotating in interleaved pairs, q/k/v
    # biases (none on o), the norms after attention and MLP; gate_up fused in the checkpoint
    "glm4": dict(_LLAMA, head_dim=32, partial_rotary_factor=0.5, attention_bias=True),
    # GLM-4.5: GQA with head_dim 32 (not hidden / heads), half of it rotating, q/k/v biases (none on o),
    # q/k norms; layer 0 dense, layer 1 8 experts of width 32 (top 2, sigmoid with the correction bias,
    # renormalised, scaled by 2.5) and a shared expert; one MTP layer counted (none written)
    "glm4_moe": dict(
        _LLAMA,
        head_dim=32,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=1,
    ),
    # OLMoE: q/k norms over the whole projections (k's 32 wide: 2 KV heads), 8 experts of width 32 (its
    # intermediate_size) in every layer, top 2 not renormalised, as released (tests/models/test_olmoe.py
    # adds norm_topk_prob and clip_qkv)
    "olmoe": dict(_LLAMA, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # Granite MoE: Granite's four scalars, 8 experts of width 32 (stacked input_linear / output_linear) in
    # every layer, softmax over the top 2 logits; tied embeddings, as the released models
    "granitemoe": dict(
        _LLAMA,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
    # ERNIE 4.5 MoE: rotary in interleaved pairs; layer 0 dense, layers 1-2 8 experts of width 32 (softmax,
    # the correction bias in the choice, top 2 renormalised) and 2 shared experts, layer 3 dense again
    # (moe_layer_end_index); untied embeddings (the config's default ties them)
    "ernie4_5_moe": dict(
        _LLAMA,
        num_hidden_layers=4,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=2,
        moe_layer_interval=1,
        tie_word_embeddings=False,
    ),
    # MiniMax-M2: q/k norms over the whole projections, head_dim 16 of which half rotates (rotary_dim 8),
    # 8 experts of width 32 in every layer (sigmoid, the correction bias in the choice, top 2 renormalised)
    "minimax_m2": dict(
        _LLAMA,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Hunyuan MoE: per-head q/k norms after the rotary, NTK-alpha rope (the base stretched by alpha 8, for
    # every length), in every layer a shared MLP and 8 experts, both of width 32, top k per layer (2, 1, 3)
    "hunyuan_v1_moe": dict(
        _LLAMA,
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=32,
        num_experts=8,
        moe_topk=[2, 1, 3],
        rope_parameters={"rope_type": "dynamic", "alpha": 8.0, "factor": 1.0, "rope_theta": 10000.0},
    ),
    # Ministral 3: head_dim 32 (q twice the hidden size wide), GQA, YaRN (16 x 32 positions) and the queries
    # scaled by their position every 32 tokens (llama_4_scaling_beta), so the parity prompts reach scales up
    # to 1 + 0.1 log 11; no window, as released (tests/models/test_ministral3.py: a window of 32, a tied head)
    "ministral3": dict(
        _LLAMA,
        head_dim=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    # Mistral 4: MLA (4 heads of 16 nope + 8 rope features, q_lora_rank 24, a 32-wide latent, v_head_dim 24)
    # with rope in interleaved pairs, YaRN (16 x 32) with mscale_all_dim in the softmax scale, and the queries
    # scaled by position every 32 tokens; layer 0 dense, layer 1 8 experts of width 32 (softmax, top 2 from
    # the best 2 of 4 groups scored by their two best, renormalised, scaled by 1.5) and a shared expert
    # (tests/models/test_mistral4.py: plain q_proj with biases, rope in halves, one group, a tied head)
    "mistral4": dict(
        _LLAMA,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        moe_intermediate_size=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    # Gated DeltaNet in layers 0-2, gated attention in 3 (and 7: 8 layers would repeat the pattern); 2 key
    # heads feeding 4 value heads, conv kernel 4; a quarter of each attention head rotates
    "qwen3_next": dict(
        _LLAMA,
        num_hidden_layers=4,
        head_dim=16,
        full_attention_interval=4,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
}
# Qwen3.5: Qwen3-Next's layer pattern and sizes with the delta nets' projections separate; dense, or with
# experts in every layer (and a gated shared expert)
_QWEN3_5 = {
    k: v
    for k, v in _DEFAULTS["qwen3_next"].items()
    if k not in ("full_attention_interval", "partial_rotary_factor", "norm_topk_prob")
} | dict(
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
_DEFAULTS["qwen3_5_text"] = {
    k: v
    for k, v in _QWEN3_5.items()
    if k
    not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
}
_DEFAULTS["qwen3_5_moe_text"] = {k: v for k, v in _QWEN3_5.items() if k != "intermediate_size"}
# Granite 4.0-H's shape: Mamba-2 in layers 0, 1 and 3, attention without rotary in 2; 4 heads of 16 in 2 groups
# (B and C per group), chunks of 16 tokens so that prompts cross them; 4 experts beside the shared MLP
_DEFAULTS["granitemoehybrid"] = dict(
    _LLAMA,
    num_hidden_layers=4,
    layer_types=["mamba", "mamba", "attention", "mamba"],
    intermediate_size=32,
    shared_intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=16,
    position_embedding_type=None,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.2,
    logits_scaling=8.0,
)
# Granite 4.0-H micro's kind: the shared MLP only, and rotary in the attention layer
_DEFAULTS["granitemoehybrid_dense"] = dict(
    _DEFAULTS["granitemoehybrid"], num_local_experts=0, position_embedding_type="rope"
)
# Bamba: Mamba-2 in layers 0 and 2, attention (half of each head rotating) in 1, Granite 4.0-H's Mamba shape
_MAMBA = {k: v for k, v in _DEFAULTS["granitemoehybrid"].items() if k.startswith("mamba_")}
_DEFAULTS["bamba"] = dict(_LLAMA, num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA)
# Nemotron-H: Mamba-2, MLP (squared ReLU), attention, Mamba-2 with head_dim 16 and the same Mamba shape (its
# config reads Granite's names for groups, conv and chunks as legacy ones). dt drawn from [0.001, 1]
# (transformers' default tops out at 0.1), and the Mamba output projections at the spread of the others (not
# rescaled), so that the states weigh on the tokens
_DEFAULTS["nemotron_h"] = dict(
    _LLAMA,
    num_hidden_layers=4,
    hybrid_override_pattern="M-*M",
    head_dim=16,
    mamba_num_heads=_MAMBA["mamba_n_heads"],
    mamba_head_dim=_MAMBA["mamba_d_head"],
    ssm_state_size=_MAMBA["mamba_d_state"],
    **{k: _MAMBA[k] for k in ("mamba_n_groups", "mamba_d_conv", "mamba_chunk_size")},
    time_step_max=1.0,
    rescale_prenorm_residual=False,
)
# Falcon-H1: attention and Mamba-2 side by side in both layers; head_dim 24 apart from hidden / heads, a Mamba
# inner width (mamba_d_ssm 48: 4 heads of 12 in 2 groups) apart from expand x hidden, chunks of 16 tokens so
# that prompts cross them, the gated norm after the gate, and every multiplier away from 1 (near the released
# 1.5B's, the logits' less shrunk so that greedy choices stay decisive)
_DEFAULTS["falcon_h1"] = dict(
    _LLAMA,
    head_dim=24,
    mamba_d_ssm=48,
    mamba_n_heads=4,
    mamba_d_head=12,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    mamba_rms_norm=True,
    mamba_norm_before_gate=False,
    projectors_bias=True,
    embedding_multiplier=5.6,
    lm_head_multiplier=0.5,
    key_multiplier=0.39,
    attention_in_multiplier=1.2,
    attention_out_multiplier=0.94,
    ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.24,
    mlp_multipliers=[0.88, 0.59],
    ssm_multipliers=[0.35, 0.25, 0.18, 0.5, 0.35],
)
# LFM2: short convs (3 taps, with biases: the released models have none) in layers 0, 1 and 3, attention with
# q/k norms in 2; the MLP's width adjusted as transformers does (128 x 2/3 = 85, x 1.3 = 110, rounded up to 128),
# tied embeddings
_DEFAULTS["lfm2"] = dict(
    _SIZES,
    num_hidden_layers=4,
    layer_types=["conv", "conv", "full_attention", "conv"],
    num_key_value_heads=2,
    intermediate_size=128,
    block_ffn_dim_multiplier=1.3,
    block_multiple_of=32,
    conv_L_cache=3,
    conv_bias=True,
    norm_eps=1e-5,
    initializer_range=0.15,
)
# LFM2-MoE: LFM2's layers (no biases), a dense MLP 96 wide (not adjusted) in layer 0, then 8 experts of 32
# (sigmoid top 2 with the expert bias in the choice, renormalised, times 1.5)
_DEFAULTS["lfm2_moe"] = dict(
    {k: v for k, v in _DEFAULTS["lfm2"].items() if not k.startswith(("block_", "conv_bias"))},
    intermediate_size=96,
    num_dense_layers=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
)
# LFM3: short convs (3 taps) in layers 0, 2 and 4, sliding attention (a window of 24, so the parity prompts
# cross it) in 1, full attention in 3; the released ropes (plain on the sliding layers, proportional on the
# full one: 4 of its 8 frequency pairs rotate), the attention's sigmoid gate and the sandwich norms, an MLP
# 96 wide (not adjusted), tied embeddings
_DEFAULTS["lfm3"] = dict(
    _SIZES,
    num_hidden_layers=5,
    layer_types=["conv", "sliding_attention", "conv", "full_attention", "conv"],
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    sliding_window=24,
    conv_L_cache=3,
    norm_eps=1e-5,
    initializer_range=0.15,
)
# OLMo Hybrid as released: Gated DeltaNet in layers 0-2 and OLMo attention without rotary (NoPE) in 3; 2 key
# heads feeding 4 value heads (16 wide for keys, 32 for values), beta in (0, 2) (negative eigenvalues); A
# drawn from (0, 1) and dt up to 1 (transformers' defaults: A up to 16, dt up to 0.1) so the decay keeps the
# states alive across chunks
_DEFAULTS["olmo_hybrid"] = dict(
    _LLAMA,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": None},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    linear_a_log_max=1.0,
    linear_dt_max=1.0,
)
# Kimi Linear: KDA in layers 0, 1 and 3 (4 heads of 16, per-channel decay), MLA without rotary in 2 (no q
# LoRA, latent 32, 8 k_pe features shared by the heads); a dense layer 0, then 8 experts (sigmoid top 2 of
# 2 groups, one group kept, correction bias) with a shared expert
_DEFAULTS["kimi_linear"] = dict(
    _LLAMA,
    num_hidden_layers=4,
    num_key_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
)
_TOKENIZERS = {"gpt_oss": (HARMONY_SPECIAL_TOKENS, HARMONY_CHAT_TEMPLATE)}
_UNMAPPED_CAUSAL_LMS = {"mistral4": "Mistral4ForCausalLM"}
"""Architectures whose causal LM class transformers' AutoModelForCausalLM does not map (5.24 maps Mistral 4
under AutoModelForImageTextToText only); `tiny_config` registers them, so that the checkpoints are built and
the references loaded as the others'."""
"""Architectures whose tokenizer has other special tokens and chat template than ChatML's."""


def make_tokenizer(
    vocab_size: int = 384,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
):
    """A byte-level BPE tokenizer trained on a fixed corpus: the special tokens (pad, bos, eos at 0-2), then
    256 bytes, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special_tokens[BOS_ID],
        eos_token=special_tokens[EOS_ID],
        pad_token=special_tokens[PAD_ID],
        chat_template=chat_template,
    )


def tiny_config(arch: str, vocab_size: int, **overrides: Any):
    """The transformers config of a tiny `arch` model; `overrides` replace any config field."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gpt2": transformers.GPT2Config,
        "opt": transformers.OPTConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "gemma4_text": transformers.Gemma4TextConfig,
        "gemma3n_text": transformers.Gemma3nTextConfig,
        "phi3": transformers.Phi3Config,
        "granite": transformers.GraniteConfig,
        "olmo2": transformers.Olmo2Config,
        "olmo3": transformers.Olmo3Config,
        "smollm3": transformers.SmolLM3Config,
        "seed_oss": transformers.SeedOssConfig,
        "exaone4": transformers.Exaone4Config,
        "starcoder2": transformers.Starcoder2Config,
        "cohere2": transformers.Cohere2Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gpt_oss": transformers.GptOssConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "deepseek_v32": transformers.DeepseekV32Config,
        "glm_moe_dsa": transformers.GlmMoeDsaConfig,
        "glm4": transformers.Glm4Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "llama4_text": transformers.Llama4TextConfig,
        "olmoe": transformers.OlmoeConfig,
        "granitemoe": transformers.GraniteMoeConfig,
        "ernie4_5_moe": transformers.Ernie4_5_MoeConfig,
        "minimax_m2": transformers.MiniMaxM2Config,
        "hunyuan_v1_moe": transformers.HunYuanMoEV1Config,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
        "granitemoehybrid": transformers.GraniteMoeHybridConfig,
        "granitemoehybrid_dense": transformers.GraniteMoeHybridConfig,
        "bamba": transformers.BambaConfig,
        "nemotron_h": transformers.NemotronHConfig,
        "olmo_hybrid": transformers.OlmoHybridConfig,
        "kimi_linear": transformers.KimiLinearConfig,
        "falcon_h1": transformers.FalconH1Config,
        "lfm2": transformers.Lfm2Config,
        "lfm2_moe": transformers.Lfm2MoeConfig,
        "lfm3": transformers.Lfm3Config,
        "ministral3": transformers.Ministral3Config,
        "mistral4": transformers.Mistral4Config,
    }[arch]
    fields = dict(
        _DEFAULTS[arch], vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    fields.update(overrides)
    if arch in _UNMAPPED_CAUSAL_LMS:
        model_cls = getattr(transformers, _UNMAPPED_CAUSAL_LMS[arch])
        transformers.AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    return config_cls(**fields)


def make_tiny_checkpoint(
    arch: str,
    tmp_path: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint (safetensors) and its tokenizer to `tmp_path/tiny-<arch>`.

    arch: one of ARCHS. `overrides` are config fields (e.g.
    tie_word_embeddings=True, sliding_window=8, rope_parameters={...}); vocab_size defaults to the
    tokenizer's size. `max_shard_size` (e.g. "40KB") writes a sharded checkpoint with an index json.
    """
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / f"tiny-{arch}"
    tokenizer = make_tokenizer(384, *_TOKENIZERS.get(arch, ()))
    overrides.setdefault("vocab_size", len(tokenizer))
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomise_vectors(model)
    model.to(dtype)
    model.config.dtype = dtype
    save = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save)
    tokenizer.save_pretrained(out)
    return out


def randomise_vectors(model: torch.nn.Module) -> None:
    """transformers initialises norm weights to 1 and biases to 0 (stacked experts' biases too, GPT-OSS's
    `gate_up_proj_bias` [E, 2I], and the routers' `e_score_correction_bias` buffer of DeepSeek-V3 and
    GLM-4.5, and Gemma 4's `layer_scalar` buffer, one per layer, and LFM2-MoE's `expert_bias` buffer); spread
    them so their loading is tested."""
    buffers = ("e_score_correction_bias", "layer_scalar", "expert_bias")
    corrections = [(n, b) for n, b in model.named_buffers() if n.endswith(buffers)]
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *corrections]:
            if param.dim() == 1 or name.endswith("_bias"):
                param.add_(torch.randn_like(param) * 0.1)


def write_bin_checkpoint(model_dir: str | os.PathLike, shards: int = 1) -> None:
    """Rewrite a safetensors checkpoint as pytorch_model.bin (or `shards` files with an index json)."""
    import json

    from safetensors.torch import load_file

    root = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        state.update(load_file(path))
        path.unlink()
    (root / "model.safetensors.index.json").unlink(missing_ok=True)
    if shards == 1:
        torch.save(state, root / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, root / file)
        weight_map.update(dict.fromkeys(part, file))
    (root / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# DeepSeek-V4: every attention kind (a window of 8 on every layer; layers 1 and 3 compressed-sparse at rate
# 4 with an indexer keeping the best 3 pooled rows; layer 2 heavily compressed at rate 8), so ~40-token
# prompts cross the window and several pooled rows of each rate;
# 4 hyper-connection streams, a grouped output projection of 2 groups, hash-routed experts on layer 0 and
# top-k ones after. 16 indexer heads keep exact-zero scores (every head's ReLU at 0) rare.
DEEPSEEK_V4 = dict(
    _SIZES,
    num_hidden_layers=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=24,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
    swiglu_limit=2.0,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    hc_mult=4,
    hc_sinkhorn_iters=5,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
)


def make_tiny_deepseek_v4(tmp_path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny DeepSeek-V4 checkpoint (`DEEPSEEK_V4`, `overrides` replacing fields) and its tokenizer in
    `tmp_path/tiny-deepseek_v4`. The hash router's token -> experts table (`tid2eid`, zeros as transformers
    initialises it) is drawn at random, two distinct experts per token, so that hash routing is tested."""
    import transformers

    out = Path(tmp_path) / "tiny-deepseek_v4"
    tokenizer = make_tokenizer(384)
    fields = dict(DEEPSEEK_V4, vocab_size=len(tokenizer), bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    config = transformers.DeepseekV4Config(**{**fields, "pad_token_id": PAD_ID, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise_vectors(model)
    experts, k = config.n_routed_experts, config.num_experts_per_tok
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.stack([torch.randperm(experts)[:k] for _ in range(buffer.shape[0])]))
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
