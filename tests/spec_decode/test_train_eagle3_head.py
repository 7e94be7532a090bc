"""examples/train_eagle3_head.py end to end on a tiny target (a few seconds): it writes a head in the speculators layout that pagellm loads, and the engine's greedy tokens with that head
are its tokens without one."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.gguf_convert import convert_hf_checkpoint

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_eagle3_head.py"


@pytest.mark.parametrize("layout", ["directory", "gguf"])
def test_a_trained_head_loads_and_keeps_the_greedy_tokens(tmp_path, monkeypatch, capsys, layout):
    """From a checkpoint directory, or a GGUF file (as model S ships)."""
    target = make_tiny_checkpoint("llama", tmp_path, num_hidden_layers=4, seed=2)
    if layout == "gguf":
        target = convert_hf_checkpoint(target, tmp_path / "tiny.f32.gguf", "float32")
    out = tmp_path / "head"
    argv = [str(EXAMPLE), "--target", str(target), "--out", str(out), "--chat", "6", "--epochs", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-new-tokens", "24", "--depth", "3", "--draft-vocab", "64"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "accuracy per draft" in printed and f"saved to {out}" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    results = []
    for speculative in (spec, None):
        llm = LLM(str(target), dtype="float32", max_model_len=256, speculative_config=speculative)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if speculative:
            assert llm.engine.stats().spec_num_draft_tokens > 0
    assert results[0] == results[1]


def test_the_drafts_learn_only_what_the_proposer_is_asked_for():
    """Row i of step s answers token i + s + 1: not counted where that is the prompt's (or the chat
    template's) or the target's first output token, which no draft guesses, nor past the end."""
    draft_labels = runpy.run_path(str(EXAMPLE))["draft_labels"]
    tokens = torch.arange(10)  # a prompt of 4 tokens (0..3), then the target's outputs 4..9
    t2d_index = torch.arange(10) + 100  # every token in the draft vocabulary, as id + 100
    labels = draft_labels(tokens, 4, t2d_index, depth=2)
    # step 1: rows 0..8 answer tokens 2..10; tokens 2..4 are the prompt's or the first output, 10 past the end
    assert labels[0].tolist() == [-100, -100, -100, 105, 106, 107, 108, 109, -100]
    # step 2: answers 3..11
    assert labels[1].tolist() == [-100, -100, 105, 106, 107, 108, 109, -100, -100]
