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
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "granitemoehybrid",
    "granitemoehybrid_dense",
    "bamba",
    "nemotron_h",
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
    "phi3": dict(_LLAMA),
    "granite": dict(
        _LLAMA,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=8.0,
    ),
    "olmo2": dict(_LLAMA),
    "smollm3": dict(_LLAMA, num_hidden_layers=4),  # no_rope_layers: every fourth layer without rotary
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
_TOKENIZERS = {"gpt_oss": (HARMONY_SPECIAL_TOKENS, HARMONY_CHAT_TEMPLATE)}
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
        "phi3": transformers.Phi3Config,
        "granite": transformers.GraniteConfig,
        "olmo2": transformers.Olmo2Config,
        "smollm3": transformers.SmolLM3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gpt_oss": transformers.GptOssConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
        "granitemoehybrid": transformers.GraniteMoeHybridConfig,
        "granitemoehybrid_dense": transformers.GraniteMoeHybridConfig,
        "bamba": transformers.BambaConfig,
        "nemotron_h": transformers.NemotronHConfig,
    }[arch]
    fields = dict(
        _DEFAULTS[arch], vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    fields.update(overrides)
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
    GLM-4.5); spread them so their loading is tested."""
    corrections = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
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
