"""Multi-token prediction with the MTP layer of tiny DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5
checkpoints (written here: transformers saves no MTP weights): greedy tokens equal transformers', and the drafts made through
chunked prefill, prefix-cache hits and preemption equal those of an engine that prefills each sequence
whole (so the MTP layer's KV stays right); a checkpoint without MTP weights is refused at start-up."""

from __future__ import annotations

import json

import pytest
import torch
from parity import Reference, assert_greedy_parity, mixed_prompts, small_kv_cache
from safetensors.torch import load_file, save_file
from test_eagle import recorded_drafts
from test_spec_engine import copy_friendly_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core.errors import ConfigError

MAX_TOKENS = 16
K = 3


def copy_layer_shapes(tensors: dict, source: str, target: str, g: torch.Generator) -> None:
    """Every tensor under `source` again under `target`, random (vectors about their mean, e.g. norms)."""
    for name, tensor in list(tensors.items()):
        if name.startswith(source):
            noise = torch.randn(tensor.shape, generator=g) * tensor.float().std().clamp(min=0.05)
            fresh = (tensor.float().mean() + noise) if tensor.dim() == 1 else noise
            tensors[target + name[len(source) :]] = fresh.to(tensor.dtype)


def add_mtp_layer(path, seed: int = 0) -> None:
    """Write layer N = num_hidden_layers in the released layout: the last decoder layer's tensors' shapes
    (random, fixed seed) under `model.layers.N.`, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
    `shared_head.head` and `embed_tokens` (the target's table, as released)."""
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    copy_layer_shapes(tensors, f"model.layers.{n - 1}.", f"model.layers.{n}.", g)
    mtp = f"model.layers.{n}."
    tensors[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    tensors[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "shared_head.head.weight"] = torch.randn(config["vocab_size"], h, generator=g)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def target(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    reference = Reference(path, MAX_TOKENS)  # before the MTP layer exists: transformers does not read it
    add_mtp_layer(path)
    return path, reference


def engine(path, **overrides) -> LLM:
    settings = dict(
        dtype="float32", num_kv_blocks=400, max_model_len=400,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )  # fmt: skip
    settings.update(overrides)
    return LLM(str(path), **settings)


def test_greedy_tokens_and_drafts_hold_through_chunking_caching_and_preemption(target):
    path, reference = target
    prompts = mixed_prompts(300, seed=1, shared_prefix=17) + copy_friendly_prompts(300, seed=1)
    tight = engine(path, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=30, max_model_len=368)
    records = recorded_drafts(tight)
    assert_greedy_parity(tight, reference, prompts)
    assert_greedy_parity(tight, reference, prompts[:6])  # again, from the prefix cache
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_num_draft_tokens > 0
    assert_first_drafts_as_whole_prefills_give(path, records, 12)


def assert_first_drafts_as_whole_prefills_give(path, records: list, samples: int) -> None:
    """About `samples` of the recorded (tokens, drafts) with K drafts: an engine that prefills the same
    sequence whole, one at a time, makes the same first drafts (so the MTP layer's KV stayed right)."""
    checked = [r for r in records[:: max(1, len(records) // samples)] if len(r[1]) == K]
    whole = engine(path)
    fresh = recorded_drafts(whole)
    for tokens, drafts in checked:
        fresh.clear()
        whole.generate(
            [{"prompt_token_ids": tokens[:-1]}],
            SamplingParams(temperature=0, max_tokens=K + 2),
            use_tqdm=False,
        )
        assert fresh[0] == (tokens, drafts), len(tokens)
    assert len(checked) >= samples // 2


def test_a_checkpoint_without_mtp_layers_is_refused_at_start_up(tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="no MTP layers"):
        engine(path)
    llama = make_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ConfigError, match="mtp runs the MTP layers of"):
        engine(llama)


def add_qwen_mtp_layer(path, seed: int = 0) -> None:
    """Write Qwen3-Next's / Qwen3.5's `mtp.*` tensors as released: the last full-attention layer's tensors'
    shapes (random, fixed seed) under `mtp.layers.0.`, with `fc`, `pre_fc_norm_embedding`,
    `pre_fc_norm_hidden` and `norm` ((1 + w) norms, so weights near 0)."""
    config = json.loads((path / "config.json").read_text())
    h = config["hidden_size"]
    tensors = load_file(str(path / "model.safetensors"))
    full = max(i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    g = torch.Generator().manual_seed(seed)
    copy_layer_shapes(tensors, f"model.layers.{full}.", "mtp.layers.0.", g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=g)
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen_mtp_layers_keep_greedy_tokens_and_drafts_through_chunking_and_preemption(arch, tmp_path):
    """Qwen3-Next's and Qwen3.5's `mtp.*` layer drafts for a target with Gated DeltaNet layers (their states
    put back after each rejection): greedy tokens equal transformers', and the drafts made through chunked
    prefill and preemption equal those of an engine that prefills each sequence whole."""
    path = make_tiny_checkpoint(arch, tmp_path)
    reference = Reference(path, MAX_TOKENS)
    add_qwen_mtp_layer(path)
    prompts = mixed_prompts(300, seed=2)[:12] + copy_friendly_prompts(300, seed=2)
    blocks = small_kv_cache(path, 368, 48, spare=2)
    tight = engine(path, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=blocks, max_model_len=368)
    records = recorded_drafts(tight)
    assert_greedy_parity(tight, reference, prompts)
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0, stats
    assert_first_drafts_as_whole_prefills_give(path, records, 10)


def test_a_qwen_checkpoint_without_mtp_tensors_is_refused_at_start_up(tmp_path):
    path = make_tiny_checkpoint("qwen3_5_text", tmp_path)
    with pytest.raises(ConfigError, match="no mtp.. tensors"):
        engine(path)
