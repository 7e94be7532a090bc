"""Every architecture against transformers on the same tiny checkpoint: prefill, then decode steps."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from tiny import make_tiny_checkpoint

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "gpt2": ("gpt2", {}),
    "opt": ("opt", {}),
    "opt-post-norm": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    reference = load_reference(path)
    runner = PagedRunner(load_pagellm(path), num_seqs=1)

    ids = list(PROMPT)
    got = runner.step({0: ids})[0]
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)
    for _ in range(3):
        ids.append(int(got[-1].argmax()))
        got = runner.step({0: ids[-1:]})[0]
        torch.testing.assert_close(got[-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)


def test_flat_batch_of_two_requests_prefill_chunk_and_decode(tmp_path):
    """Two requests in one flat batch: a prefill next to a chunked prefill, then both decode together."""
    path = make_tiny_checkpoint("qwen3", tmp_path)
    reference = load_reference(path)
    runner = PagedRunner(load_pagellm(path))
    a, b = PROMPT[:9], PROMPT[3:]
    runner.step({1: b[:4]})
    out = runner.step({0: a, 1: b[4:]})
    torch.testing.assert_close(out[0], reference_logits(reference, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], reference_logits(reference, b)[4:], atol=ATOL, rtol=0)
    a, b = a + [int(out[0][-1].argmax())], b + [int(out[1][-1].argmax())]
    out = runner.step({0: a[-1:], 1: b[-1:]})
    torch.testing.assert_close(out[0][0], reference_logits(reference, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1][0], reference_logits(reference, b)[-1], atol=ATOL, rtol=0)


def test_llama3_rope_scaling_changes_the_output(tmp_path):
    """The llama3 variant above would pass trivially if scaling were a no-op at these positions."""
    scaled = VARIANTS["llama3-rope"][1]
    plain = load_pagellm(make_tiny_checkpoint("llama", tmp_path / "plain"))
    llama3 = load_pagellm(make_tiny_checkpoint("llama", tmp_path / "scaled", **scaled))
    a = PagedRunner(plain, num_seqs=1).step({0: PROMPT})[0]
    b = PagedRunner(llama3, num_seqs=1).step({0: PROMPT})[0]
    assert (a - b).abs().max() > 1e-2


def test_greedy_choices_are_decisive(tmp_path):
    """Tiny models must not hinge on near-ties, or engine tests comparing greedy outputs would flake."""
    path = make_tiny_checkpoint("llama", tmp_path)
    logits = reference_logits(load_reference(path), PROMPT)
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_bfloat16_model_stays_close_to_transformers_bfloat16(arch, tmp_path):
    path = make_tiny_checkpoint(arch, tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    got = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert got.dtype == torch.bfloat16  # the model's dtype: the sampler widens where it computes
    got = got.float()
    expected = reference_logits(load_reference(path, torch.bfloat16), PROMPT)
    torch.testing.assert_close(got, expected, atol=0.15, rtol=0)
