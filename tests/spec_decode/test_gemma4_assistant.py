"""Gemma 4's MTP drafters (`*-assistant` checkpoints, `Gemma4AssistantForCausalLM`) on a tiny Gemma 4 whose
sliding layers' windows (32) the prompts cross: greedy tokens equal transformers' through chunked prefill,
prefix-cache hits and preemption, and every sampled round's drafts equal those transformers' assistant
makes from the target's KV and hidden state of the whole sequence (its candidate generator's first round:
the drafter at the newest token's position over the target's KV before it), for an assistant with the
clustered vocabulary (E2B/E4B's) and one with the plain tied head (26B/31B's)."""

from __future__ import annotations

import json

import pytest
import torch
from parity import Reference, assert_greedy_parity, mixed_prompts, small_kv_cache
from test_eagle import recorded_drafts
from tiny import make_tiny_checkpoint, randomise_vectors, tiny_config

from pagellm import LLM
from pagellm.core.errors import ConfigError

MAX_TOKENS = 16
K = 3
CLUSTERS = 16  # of the 384-token vocabulary, 4 scored per draft


def make_assistant(target_path, out, ordered: bool, seed: int = 0, **overrides):
    """A random two-layer assistant (sliding, then full) for the target at `target_path`, as
    `save_pretrained` writes it: queries only, heads the shapes of the target's KV."""
    import transformers

    target = json.loads((target_path / "config.json").read_text())
    text = tiny_config(
        "gemma4_text",
        vocab_size=target["vocab_size"],
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        use_double_wide_mlp=False,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    settings = dict(backbone_hidden_size=target["hidden_size"], use_ordered_embeddings=ordered)
    if ordered:
        settings.update(num_centroids=CLUSTERS, centroid_intermediate_top_k=4)
    settings.update(overrides)
    config = transformers.Gemma4AssistantConfig(text_config=text.to_dict(), **settings)
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config)
    randomise_vectors(model)
    if ordered:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(config.text_config.vocab_size))
    model.save_pretrained(out)
    return out


class ReferenceDrafts:
    """transformers' target and assistant: the drafts for a sequence, as `Gemma4AssistantCandidateGenerator`
    makes them after the target's forward over all but the newest token."""

    def __init__(self, target_path, assistant_path):
        import transformers

        load = transformers.AutoModelForCausalLM.from_pretrained
        self.target = load(str(target_path), dtype=torch.float32).eval()
        self.assistant = load(str(assistant_path), dtype=torch.float32).eval()

    @torch.no_grad()
    def __call__(self, tokens: list[int], k: int) -> list[int]:
        out = self.target(
            input_ids=torch.tensor([tokens[:-1]]),
            output_hidden_states=True,
            return_shared_kv_states=True,
            use_cache=False,
        )
        hidden, token = out.hidden_states[-1][:, -1:], torch.tensor([[tokens[-1]]])
        position, mask = torch.tensor([[len(tokens) - 1]]), torch.ones(1, len(tokens), dtype=torch.long)
        drafts = []
        for _ in range(k):
            embeds = torch.cat([self.target.get_input_embeddings()(token), hidden], dim=-1)
            step = self.assistant(
                inputs_embeds=embeds,
                attention_mask=mask,
                position_ids=position,
                shared_kv_states=out.shared_kv_states,
            )
            token, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
            drafts.append(int(token))
        return drafts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_checkpoint("gemma4_text", tmp_path_factory.mktemp("gemma4"))
    return path, Reference(path, MAX_TOKENS)


def engine(path, assistant, **overrides) -> LLM:
    settings = dict(
        dtype="float32", num_kv_blocks=400, max_model_len=400,
        speculative_config={"method": "mtp", "model": str(assistant), "num_speculative_tokens": K},
    )  # fmt: skip
    settings.update(overrides)
    return LLM(str(path), **settings)


@pytest.mark.parametrize("ordered", [True, False], ids=["clustered-vocabulary", "tied-head"])
def test_greedy_tokens_and_drafts_match_transformers_through_chunking_caching_and_preemption(
    target, ordered, tmp_path
):
    path, reference = target
    assistant = make_assistant(path, tmp_path / "assistant", ordered)
    prompts = mixed_prompts(300, seed=3, shared_prefix=17)
    blocks = small_kv_cache(path, 368, 48, spare=4)
    tight = engine(path, assistant, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=blocks,
                   max_model_len=368)  # fmt: skip
    records = recorded_drafts(tight)
    assert_greedy_parity(tight, reference, prompts)
    assert_greedy_parity(tight, reference, prompts[:6])  # again, from the prefix cache
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_num_draft_tokens > 0
    drafts = ReferenceDrafts(path, assistant)
    checked = records[:: max(1, len(records) // 16)]
    longest = max(len(tokens) for tokens, _ in checked)
    assert longest > 33 + 16, "some sampled round must reach past the sliding layers' window"
    for tokens, made in checked:
        assert made == drafts(tokens, len(made)), len(tokens)


def test_an_assistant_for_another_target_or_none_is_refused_at_start_up(target, tmp_path):
    path, _ = target
    with pytest.raises(ConfigError, match="Gemma 4 ships its MTP drafter as a checkpoint of its own"):
        LLM(str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    wider = make_assistant(path, tmp_path / "wider", False, backbone_hidden_size=96)
    with pytest.raises(ConfigError, match="hidden states of width 96, the target's are 64"):
        engine(path, wider)
    llama = make_tiny_checkpoint("llama", tmp_path)
    assistant = make_assistant(path, tmp_path / "assistant", False)
    with pytest.raises(ConfigError, match="mtp takes a model only for a Gemma 4 target"):
        engine(llama, assistant)


def test_the_sliding_layers_keep_the_token_the_assistant_reads_past_their_window(target, tmp_path):
    """The assistant's sliding layers read the 33 tokens before the newest, one more than the target's next
    query: the KV cache manager keeps blocks for windows of 33 there."""
    path, _ = target
    plain = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=256)
    windows = plain.engine.scheduler.kv_cache_manager.windows
    assert sorted(windows, key=str) == [32, 32, 32, 32, None]
    drafting = engine(path, make_assistant(path, tmp_path / "assistant", True), max_model_len=256)
    assert drafting.engine.scheduler.kv_cache_manager.windows == tuple(
        None if w is None else w + 1 for w in windows
    )
