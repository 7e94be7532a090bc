"""DeepSeek-V3.2 (DeepSeek Sparse Attention: the lightning indexer in front of MLA) against transformers on
tiny checkpoints whose index_topk (8) is smaller than the prompts, so the indexer drops tokens: logits
through prefill and decode, greedy tokens through the engine under chunked prefill, prefix hits and
preemption, the two KV-cache groups, the attention reading the selected latent rows only, and what is
refused at start-up.

The indexer's top-k can tie (exact zeros after its ReLU tie easily in tiny models): `indexer_near_ties`
recomputes transformers' indexer scores along each sequence and finds every query whose k-th and (k+1)-th
visible scores are within `NEAR_TIE` of each other; the parity tests name those ties in their failure
message and warn about them when they pass, so a tie is reported, never absorbed by a tolerance."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import assert_greedy_parity, mixed_prompts, small_kv_cache, tiny_model_and_reference
from sparse_ties import indexer_near_ties
from tiny import make_tiny_checkpoint, tiny_config

from pagellm import LLM, SamplingParams
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionBatch
from pagellm.core.config import EngineConfig
from pagellm.core.errors import BackendUnsupportedError, ConfigError
from pagellm.engine.setup import resolve_engine
from pagellm.models.base import ModelInit
from pagellm.models.deepseek_v32 import DeepseekV32ForCausalLM
from pagellm.models.layers.sparse_attention import SparseParams, sparse_mla_forward

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33, 11, 19, 250, 3, 90, 180]
MAX_TOKENS = 16
SPARSE_ARCHS = ["deepseek_v32", "glm_moe_dsa"]
"""DeepSeek-V3.2, and GLM-5 (the indexer's rope in pairs; layers 1 and 2 reading layer 0's choice)."""


def assert_parity_reporting_ties(llm: LLM, reference, prompts: list[list[int]]) -> None:
    """Greedy parity; the indexer's near-ties along transformers' outputs named on failure and warned on
    success (a divergence is never accepted for them)."""
    ties = []
    for prompt in prompts:
        tokens = prompt + reference.generate(prompt)
        ties += [f"prompt of {len(prompt)} tokens, {t}" for t in indexer_near_ties(reference.model, tokens)]
    try:
        assert_greedy_parity(llm, reference, prompts)
    except AssertionError as e:
        found = "\n".join(ties) or "none"
        raise AssertionError(
            f"{e}\nindexer near-ties at the k-th score along transformers' tokens: {found}"
        ) from e
    if ties:
        shown = "; ".join(ties[:5])
        warnings.warn(f"{len(ties)} indexer near-ties, greedy tokens equal anyway: {shown}", stacklevel=2)


@pytest.mark.parametrize("arch", SPARSE_ARCHS)
def test_prefill_and_decode_match_transformers(arch, tmp_path):
    path = make_tiny_checkpoint(arch, tmp_path)
    reference = load_reference(path)
    runner = PagedRunner(load_pagellm(path), num_seqs=2)
    ids, other = list(PROMPT), PROMPT[::-1]
    assert not indexer_near_ties(reference, ids + [1, 2, 3, 4])
    got = runner.step({0: ids, 1: other[:5]})
    torch.testing.assert_close(got[0], reference_logits(reference, ids), atol=ATOL, rtol=0)
    for i in range(4):  # decodes beside the other sequence's prefill chunks
        ids.append(int(got[0][-1].argmax()))
        got = runner.step({0: ids[-1:], 1: other[5 + 3 * i : 8 + 3 * i]})
        torch.testing.assert_close(got[0][-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], reference_logits(reference, other[:17])[14:], atol=ATOL, rtol=0)


def test_a_chunk_runs_in_query_slices_with_the_same_logits(tmp_path, monkeypatch):
    """A long prefill chunk over a long context scores and attends a slice of its queries at a time
    (`SLICE_ELEMENTS`); here one query a slice, every logit still transformers'."""
    from pagellm.models.layers import sparse_attention

    path = make_tiny_checkpoint("deepseek_v32", tmp_path)
    slices = []
    real = sparse_attention._query_slices
    monkeypatch.setattr(sparse_attention, "SLICE_ELEMENTS", 1)
    monkeypatch.setattr(sparse_attention, "_query_slices", lambda n, per: slices.append(n) or real(n, per))
    got = PagedRunner(load_pagellm(path), num_seqs=1).step({0: PROMPT})[0]
    torch.testing.assert_close(got, reference_logits(load_reference(path), PROMPT), atol=ATOL, rtol=0)
    assert len(real(len(PROMPT), 64)) == len(PROMPT) and len(PROMPT) in slices


def test_selection_drops_tokens(tmp_path):
    """With index_topk 8 the 19-token prompt's later queries read 8 tokens: transformers' logits differ from
    the same weights reading every token (index_topk 64), and pagellm's equal the sparse ones."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint("deepseek_v32", tmp_path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, index_topk=64).eval()
    sparse = reference_logits(load_reference(path), PROMPT)
    dense_logits = reference_logits(dense.to(sparse.device), PROMPT)
    torch.testing.assert_close(sparse[:8], dense_logits[:8], atol=ATOL, rtol=0)  # fewer than k visible
    assert (sparse[8:] - dense_logits[8:]).abs().max() > 1e-2
    ours = PagedRunner(load_pagellm(path), num_seqs=1).step({0: PROMPT})[0]
    torch.testing.assert_close(ours, sparse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", SPARSE_ARCHS)
def test_engine_matches_transformers_under_chunking_prefix_hits_and_preemption(arch, tmp_path):
    """The default engine's way (compiled unless PAGELLM_ENFORCE_EAGER), as tests/engine/test_family_parity.py
    runs every family, with the indexer's ties reported."""
    path, reference = tiny_model_and_reference(arch, tmp_path, MAX_TOKENS)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=400,
        num_kv_blocks=small_kv_cache(path, 400, 48),
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    prompts = mixed_prompts(300, seed=1, shared_prefix=40)
    assert_parity_reporting_ties(llm, reference, prompts[:1])  # the first request fills the cache
    assert_parity_reporting_ties(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_ngram_speculative_decoding_matches_transformers(tmp_path):
    """Verification steps of k + 1 query tokens per request select per query as prefill chunks do; rejected
    drafts' latent rows and indexer keys are overwritten at the same slots later."""
    path, reference = tiny_model_and_reference("deepseek_v32", tmp_path, MAX_TOKENS)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(path), dtype="float32", max_model_len=400, num_kv_blocks=200, speculative_config=ngram)
    starts = mixed_prompts(300, seed=2)[2:10]
    # each prompt twice with transformers' continuation between: the n-grams propose it again
    prompts = [p + reference.generate(p) + p for p in starts]
    assert_parity_reporting_ties(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0


def test_lora_on_the_attention_output_matches_peft(tmp_path):
    """LoRA as on V3: an adapter on o_proj (outside the sparse op) against peft's merged model."""
    from parity import Reference
    from peft_adapters import assert_adapter_changes_outputs, lora_engine

    path = make_tiny_checkpoint("deepseek_v32", tmp_path)
    engine = lora_engine(path, tmp_path, ["o_proj"])
    reference = Reference(tmp_path / "merged", MAX_TOKENS)
    prompts = mixed_prompts(300, seed=3)[5:12]
    assert_parity_reporting_ties(engine, reference, prompts)
    assert_adapter_changes_outputs(engine, prompts)


def test_mtp_drafting_is_refused(tmp_path):
    """The `mtp` method builds V3's dense MTP head; V3.2's MTP layer has an indexer of its own."""
    path = make_tiny_checkpoint("deepseek_v32", tmp_path, num_nextn_predict_layers=1)
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ConfigError, match="not 'deepseek_v32'"):
        LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, speculative_config=mtp)


def test_indexer_keys_are_a_kv_cache_group_of_their_own(tmp_path):
    path = make_tiny_checkpoint("deepseek_v32", tmp_path)
    setup = resolve_engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256))
    layout = setup.kv_layout
    assert setup.backend_choice.backend is TorchSDPABackend
    assert layout.num_groups == 2 and [g.layers for g in layout.groups] == [(0, 1), (2, 3)]
    assert [g.spec.row_size for g in layout.groups] == [40, 16]  # [c_kv, k_pe] and the indexer's key
    llm = LLM(str(path), dtype="float32", num_kv_blocks=40, max_model_len=256)
    caches = llm.engine.runner.kv_caches
    assert [tuple(c.shape) for c in caches] == [(1, 40, 16, 1, 40)] * 2 + [(1, 40, 16, 1, 16)] * 2
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert caches[2].abs().sum() > 0 and caches[3].abs().sum() > 0  # the indexer's keys were stored


def test_glm5_shared_layers_keep_no_indexer_cache(tmp_path):
    """Indexers on layers 0 and 3 only: two indexer caches (layer_idx 4 and 5), the four latent layers in two
    groups of two beside them; layers 1 and 2 read layer 0's choice."""
    path = make_tiny_checkpoint("glm_moe_dsa", tmp_path)
    layout = resolve_engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256)).kv_layout
    assert [g.layers for g in layout.groups] == [(0, 2), (1, 3), (4, 5)]
    assert [g.spec.row_size for g in layout.groups] == [40, 40, 16]
    model = load_pagellm(path)
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    assert [i is not None for i in indexers] == [True, False, False, True]
    assert [indexers[0].cache.layer_idx, indexers[3].cache.layer_idx] == [4, 5]
    assert [int(model.model.layers[i].self_attn.source_index) for i in (1, 2)] == [0, 0]


def test_attention_reads_only_the_selected_latent_rows():
    """NaN in every latent row but the chosen ones: the output stays finite, and it equals attention over
    the chosen rows computed here; a dense read of the cache would spread the NaN."""
    torch.manual_seed(0)
    tokens, heads, row, rank, dim, topk, block = 12, 2, 6, 4, 8, 3, 4
    mla_cache = torch.full((1, 4, block, 1, row), float("nan"))
    index_cache = torch.zeros(1, 4, block, 1, dim)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)  # positions 0-3 in block 2, 4-7 in 0, 8-11 in 3
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor([3 * block + 3]),
        query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([tokens], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=tokens,
    )
    meta = TorchSDPABackend.build_metadata(batch)
    keys = torch.randn(tokens, dim)
    slots = [int(table[0, p // block]) * block + p % block for p in range(tokens)]
    index_cache.view(-1, dim)[slots[:-1]] = keys[:-1]
    q, index_q = torch.randn(1, heads, row), torch.randn(1, 2, dim)
    weights, latent = torch.rand(1, 2), torch.randn(1, row)
    chosen_rows = torch.randn(tokens, row)
    scores = (weights @ torch.relu(index_q[0] @ keys.t())).squeeze(0)
    chosen = scores.topk(topk).indices
    for p in chosen.tolist():
        mla_cache.view(-1, row)[slots[p]] = chosen_rows[p]
    ctx = SimpleNamespace(kv_caches=[mla_cache, index_cache], metadata_of=lambda i: meta, memo={})
    params = SparseParams(scale=0.5, v_size=rank, index_scale=1.0, topk=topk)
    out = sparse_mla_forward(q, latent, index_q, keys[-1:], weights, (0, 1), params, ctx)
    rows = torch.cat([chosen_rows[:-1], latent])[chosen]  # the step's own row is stored first
    probs = (torch.einsum("hd,kd->hk", q[0], rows) * 0.5).softmax(-1)
    torch.testing.assert_close(out[0], probs @ rows[:, :rank])


def test_unsupported_settings_are_refused_at_start_up(tmp_path):
    path = make_tiny_checkpoint("deepseek_v32", tmp_path)
    with pytest.raises(ConfigError, match="the sparse attention's indexer is not split"):
        resolve_engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))
    with pytest.raises(BackendUnsupportedError, match="no sparse attention"):
        resolve_engine(EngineConfig(model=str(path), dtype="float32", attention_backend="CPU_ATTN"))
    config = tiny_config("deepseek_v32", vocab_size=384, index_head_dim=4)
    with pytest.raises(ConfigError, match="index_head_dim 4 is smaller than qk_rope_head_dim 8"):
        DeepseekV32ForCausalLM(ModelInit(config, torch.float32, TorchSDPABackend))
    init = ModelInit(tiny_config("deepseek_v32", vocab_size=384), torch.float32, TorchSDPABackend)
    with pytest.raises(ConfigError, match="int8 KV cache"):
        DeepseekV32ForCausalLM(dataclasses.replace(init, kv_cache_dtype=torch.int8))


def test_context_slots_are_worked_out_once_a_step_per_group():
    """A group's layers share its block tables: the first layer of a step works a request's slots out, the
    others read them (`ForwardContext.memo`, new every step)."""
    from pagellm.models.context import ForwardContext
    from pagellm.models.layers.sparse_attention import context_slots, step_context_slots

    tables = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    groups = [SimpleNamespace(batch=SimpleNamespace(block_tables=t)) for t in (tables, tables.flip(0))]
    step = ForwardContext(None, [], layer_metadata=groups)
    first = step_context_slots(step, 0, 0, 20, 16)
    assert torch.equal(first, torch.cat([torch.arange(48, 64), torch.arange(16, 20)]))
    assert step_context_slots(step, 0, 0, 20, 16) is first  # the next layer of the step
    assert torch.equal(step_context_slots(step, 1, 0, 5, 16), context_slots(tables[1], 5, 16))  # its group's
    assert torch.equal(step_context_slots(step, 0, 1, 5, 16), context_slots(tables[1], 5, 16))
    tables[0, 0] = 2  # the next step's tables
    assert torch.equal(
        step_context_slots(ForwardContext(None, [], layer_metadata=groups), 0, 0, 20, 16)[:16],
        torch.arange(32, 48),
    )
