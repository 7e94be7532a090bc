"""DeepSeek-V4 against transformers on a tiny checkpoint (tests/models/tiny.py `DEEPSEEK_V4`): a sliding
window of 8 on every layer, a compressed-sparse layer (pooled rows per 4 tokens over overlapping windows,
an indexer keeping the best 3), a heavily compressed one (a pooled row per 8 tokens), 4 hyper-connection
streams, the grouped output projection, sinks, hash-routed then top-k experts. ~40-token prompts cross
the window and several pooled rows of each rate. Checked: logits through chunked prefill and decode, greedy
tokens through the engine under chunked prefill, prefix hits and preemption, n-gram drafts, the indexer
dropping rows, DeepSeek's and transformers' checkpoint names, and what is refused at start-up.

The indexer's top k can tie (exact zeros after its ReLU tie easily in tiny models): `v4_indexer_near_ties`
(sparse_ties.py) takes transformers' indexer scores along each sequence and names every query whose k-th and (k+1)-th
scores among its finished pooled rows are within `NEAR_TIE`; the parity tests name them in their failure
message and warn about them when they pass, so a tie is reported, never absorbed by a tolerance."""

from __future__ import annotations

import warnings

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference, assert_greedy_parity, chunked_llm, mixed_prompts
from sparse_ties import v4_indexer_near_ties
from tiny import DEEPSEEK_V4, make_tiny_deepseek_v4

from pagellm import LLM
from pagellm.core.config import EngineConfig
from pagellm.core.errors import BackendUnsupportedError, ConfigError
from pagellm.engine.setup import resolve_engine
from pagellm.models.deepseek_v4 import checkpoint_name

ATOL = 1e-4
MAX_TOKENS = 16
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33, 11, 19, 250, 3, 90, 180, 44, 8, 310]
PROMPT = PROMPT + PROMPT[::-1][:18]  # 40 tokens: 10 pooled rows at rate 4, 5 at rate 8


def assert_parity_reporting_ties(llm: LLM, reference: Reference, prompts: list[list[int]]) -> None:
    """Greedy parity (a failure names the indexer's near-ties along transformers' tokens: parity.py reads
    sparse_ties.indexer_ties_note), and a warning naming any near-tie when the tokens agree anyway."""
    assert_greedy_parity(llm, reference, prompts)
    ties = [
        f"prompt of {len(prompt)} tokens, {tie}"
        for prompt in prompts
        for tie in v4_indexer_near_ties(reference.model, prompt + reference.generate(prompt))
    ]
    if ties:
        warnings.warn(
            f"{len(ties)} indexer near-ties, greedy tokens equal anyway: {'; '.join(ties[:5])}", stacklevel=2
        )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_deepseek_v4(tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Reference(checkpoint, MAX_TOKENS)


def test_prefill_and_decode_match_transformers(checkpoint, reference):
    """Two sequences in one paged batch: one prefilled in chunks that split pooling windows, then decoded
    across window ends, beside the other's prefill chunks."""
    ref = reference.model
    runner = PagedRunner(load_pagellm(checkpoint), num_seqs=2)
    ids, other = list(PROMPT), PROMPT[::-1]
    assert not v4_indexer_near_ties(ref, ids + [1, 2, 3, 4, 5, 6])
    first = runner.step({0: ids[:13], 1: other[:2]})  # 2 tokens: no pooling window finished yet
    torch.testing.assert_close(first[1], reference_logits(ref, other[:2]), atol=ATOL, rtol=0)
    got = torch.cat([first[0], runner.step({0: ids[13:], 1: other[2:9]})[0]])
    torch.testing.assert_close(got, reference_logits(ref, ids), atol=ATOL, rtol=0)
    for i in range(6):  # decodes beside the other sequence's prefill chunks
        ids.append(int(got[-1].argmax()))
        both = runner.step({0: ids[-1:], 1: other[9 + 3 * i : 12 + 3 * i]})
        got = both[0]
        torch.testing.assert_close(got[-1], reference_logits(ref, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], reference_logits(ref, other[:27])[24:], atol=ATOL, rtol=0)


def test_engine_matches_transformers_under_chunking_prefix_hits_and_preemption(checkpoint, reference):
    """The default engine with 48-token steps over a KV cache of one request and 15 blocks: prompts up to
    370 tokens (a 40-token prefix shared) go in chunks, hit the prefix cache and preempt each other."""
    llm = chunked_llm(checkpoint, 400, 48)
    prompts = mixed_prompts(300, seed=1, shared_prefix=40)
    assert_parity_reporting_ties(llm, reference, prompts[:1])  # the first request fills the cache
    short = mixed_prompts(300, seed=4)[:3]  # 1, 2 and 7 tokens: no pooled row, or one at rate 4
    assert_parity_reporting_ties(llm, reference, prompts[1:] + short)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_every_attention_kind_and_router_is_built(checkpoint):
    """The tiny model has what the parity tests claim to cover: one row width per attention kind (K; K and
    the pooled series; K, the overlapping series and the indexer's), hash and top-k routers."""
    model = load_pagellm(checkpoint)
    widths = [layer.self_attn.attn.spec.head_size for layer in model.model.layers]
    assert widths == [32, 32 + 4 * 32 + 4 * 16, 3 * 32, 32 + 4 * 32 + 4 * 16]
    assert [layer.mlp.gate.hashed for layer in model.model.layers] == [True, False, False, False]
    tables = [layer.mlp.gate.tid2eid for layer in model.model.layers[:1]]
    assert tables[0].max() > 0 and (tables[0][:, 0] != tables[0][:, 1]).all()  # the random table loaded


def test_checkpoint_names_from_deepseek_and_transformers():
    """DeepSeek's names (what save_pretrained writes, with or without `model.`) and transformers' own."""
    assert checkpoint_name("layers.1.attn.indexer.compressor.ape") == (
        "model.layers.1.self_attn.compressor.indexer.position_bias"
    )
    assert checkpoint_name("model.layers.1.attn.indexer.weights_proj.weight") == (
        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
    )
    assert (
        checkpoint_name("layers.2.attn.compressor.norm.weight")
        == "model.layers.2.self_attn.compressor.kv_norm.weight"
    )
    assert checkpoint_name("layers.0.hc_ffn_fn") == "model.layers.0.ffn_hc.fn"
    assert checkpoint_name("hc_head_scale") == "model.hc_head.hc_scale"
    assert checkpoint_name("head.weight") == "lm_head.weight"
    assert checkpoint_name("embed.weight") == "model.embed_tokens.weight"
    assert checkpoint_name("norm.weight") == "model.norm.weight"
    assert checkpoint_name("layers.3.ffn.gate.bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert (
        checkpoint_name("layers.0.ffn.shared_experts.w3.weight")
        == "model.layers.0.mlp.shared_experts.up_proj.weight"
    )
    for name in (
        "model.layers.0.self_attn.kv_norm.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "lm_head.weight",
    ):
        assert checkpoint_name(name) == name


def test_unsupported_settings_are_refused_at_start_up(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="are plain torch layers"):
        resolve_engine(EngineConfig(model=str(checkpoint), dtype="float32", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="pooling gates"):
        LLM(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=16, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="no layers LoRA can target"):
        LLM(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=16, enable_lora=True)
    with pytest.raises(BackendUnsupportedError, match="no sparse attention"):
        resolve_engine(EngineConfig(model=str(checkpoint), dtype="float32", attention_backend="CPU_ATTN"))
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ConfigError, match="not 'deepseek_v4'"):
        LLM(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=64, speculative_config=mtp)
    bad = make_tiny_deepseek_v4(tmp_path, index_head_dim=4)
    with pytest.raises(ConfigError, match="index_head_dim 4 is smaller than the rope part 8"):
        resolve_engine(EngineConfig(model=str(bad), dtype="float32"))


@pytest.mark.slow
def test_selection_drops_pooled_rows(checkpoint, reference):
    """With index_topk 3 the later queries of a 40-token prompt read 3 of up to 10 pooled rows:
    transformers' logits differ from the same weights reading every row (index_topk 64), and pagellm's
    equal the sparse ones."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, index_topk=64).eval()
    sparse = reference_logits(reference.model, PROMPT)
    dense_logits = reference_logits(dense.to(sparse.device), PROMPT)
    torch.testing.assert_close(sparse[:15], dense_logits[:15], atol=ATOL, rtol=0)  # at most 3 rows finished
    assert (sparse[16:] - dense_logits[16:]).abs().max() > 1e-2
    ours = PagedRunner(load_pagellm(checkpoint), num_seqs=1).step({0: PROMPT})[0]
    torch.testing.assert_close(ours, sparse, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_ngram_speculative_decoding_matches_transformers(checkpoint, reference):
    """Verification steps of k + 1 query tokens per request pool and select per query as prefill chunks do;
    rejected drafts' rows are overwritten at the same slots later."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(
        str(checkpoint), dtype="float32", max_model_len=400, num_kv_blocks=200, speculative_config=ngram
    )
    starts = mixed_prompts(300, seed=2)[2:10]
    prompts = [p + reference.generate(p) + p for p in starts]  # the n-grams propose the continuation again
    assert_parity_reporting_ties(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0


@pytest.mark.slow
def test_yarn_compressed_rope_and_other_shapes_match_transformers(tmp_path):
    """YaRN on the compressed layers' rope (attention factor 1, as transformers sets it), sigmoid scoring,
    3 streams, one group, every layer compressed-sparse or heavily compressed."""
    path = make_tiny_deepseek_v4(
        tmp_path,
        seed=3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        scoring_func="sigmoid",
        hc_mult=3,
        o_groups=1,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    )
    ref = load_reference(path)
    assert ref.config.rope_parameters["compress"]["rope_type"] == "yarn"
    runner = PagedRunner(load_pagellm(path), num_seqs=1)
    got = torch.cat([runner.step({0: PROMPT[:21]})[0], runner.step({0: PROMPT[21:]})[0]])
    torch.testing.assert_close(got, reference_logits(ref, PROMPT), atol=ATOL, rtol=0)
    assert not v4_indexer_near_ties(ref, PROMPT)


def test_tiny_config_covers_every_kind():
    kinds = set(DEEPSEEK_V4["layer_types"])
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert set(DEEPSEEK_V4["mlp_layer_types"]) == {"hash_moe", "moe"}


@pytest.mark.slow
def test_compiled_engine_matches_transformers(checkpoint, reference):
    """The compiled forward (minutes on a cold inductor cache): the attention and the experts are opaque
    ops (`pagellm::compressed_attention`, `pagellm::v4_experts`), the rest inductor's."""
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=400, num_kv_blocks=200, enforce_eager=False)
    assert llm.engine.runner.forward is not llm.engine.runner.model  # compiled, not the eager fallback
    prompts = mixed_prompts(300, seed=5)
    assert_parity_reporting_ties(llm, reference, prompts[:3] + prompts[9:12])
