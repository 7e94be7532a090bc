"""Multi-LoRA against peft: greedy outputs with an adapter equal peft's merge_and_unload() model, token for
token (ranks 4 and 16, with and without rslora, Llama and Qwen2 shapes); a mixed batch equals each request
alone; more adapters than slots still completes with the same outputs; adapters never share KV blocks;
unsupported adapters are refused."""

from __future__ import annotations

import json

import pytest
import torch
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.core.errors import ConfigError

MAX_TOKENS = 12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, out, rank, seed, rslora=False, targets=TARGETS, **extra):
    """A random PEFT LoRA adapter for `base` (B not zero, so it changes the outputs), and the merged model
    (peft's merge_and_unload) saved beside it for the oracle."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
        **extra,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5 / rank)
    peft_model.save_pretrained(out / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(out / "merged")
    return out / "adapter", out / "merged"


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def base(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def engine(path, **overrides):
    settings = dict(
        dtype="float32", num_kv_blocks=400, max_model_len=400, enable_lora=True, max_loras=2, max_lora_rank=16
    )
    settings.update(overrides)
    return LLM(str(path), **settings)


def generate(llm, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("rank, rslora", [(4, False), pytest.param(16, True, marks=pytest.mark.slow)])
def test_greedy_outputs_equal_peft_merged(base, tmp_path, rank, rslora):
    adapter, merged = make_adapter(base, tmp_path, rank, seed=rank, rslora=rslora)
    llm = engine(base)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = mixed_prompts(300)[:10]
    reference = Reference(merged, MAX_TOKENS)

    class WithAdapter:  # assert_greedy_parity with the adapter on every request
        def __init__(self, llm):
            self.engine = llm.engine

        def generate(self, prompts, params, use_tqdm=False):
            return llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora)

    assert_greedy_parity(WithAdapter(llm), reference, prompts)
    assert generate(llm, prompts[:3], None) != generate(llm, prompts[:3], lora)  # the adapter matters


def test_mixed_batches_and_more_adapters_than_slots(base, tmp_path):
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(make_adapter(base, tmp_path / f"a{i}", 4, seed=10 + i)[0]))
        for i in range(3)
    ]
    prompts = mixed_prompts(300, seed=5)[:9]
    alone_llm = engine(base, max_loras=1)
    alone = [
        generate(alone_llm, [p], [lora])[0] for p, lora in zip(prompts, [None, *adapters] * 3, strict=False)
    ]
    mixed_llm = engine(base, max_loras=2, max_cpu_loras=2)  # three adapters: slots and memory both swap
    loras = [[None, *adapters][i % 4] for i in range(len(prompts))]
    assert generate(mixed_llm, prompts, loras) == [alone[i] for i in range(len(prompts))]


def test_the_same_prompt_under_two_adapters_never_shares_kv(base, tmp_path):
    a = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", 4, seed=1)[0]))
    b = LoRARequest("b", 2, str(make_adapter(base, tmp_path / "b", 4, seed=2)[0]))
    llm = engine(base)
    prompt = list(range(10, 90))
    first = generate(llm, [prompt], [a])
    hits = llm.engine.stats().prefix_cache_hits
    under_b = generate(llm, [prompt], [b])
    assert llm.engine.stats().prefix_cache_hits == hits  # nothing of a's KV served b
    assert generate(engine(base), [prompt], [b]) == under_b  # and b's output is b's own
    assert generate(llm, [prompt], [a]) == first
    assert llm.engine.stats().prefix_cache_hits > hits  # a's own prefix is found again


def test_unsupported_adapters_are_refused(base, tmp_path):
    llm = engine(base, max_lora_rank=8)
    big = make_adapter(base, tmp_path / "big", 16, seed=3)[0]
    with pytest.raises(ConfigError, match="rank 16"):
        generate(llm, [[5, 6, 7]], [LoRARequest("big", 1, str(big))])
    dora = make_adapter(base, tmp_path / "dora", 4, seed=4)[0]
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA"):
        generate(llm, [[5, 6, 7]], [LoRARequest("dora", 2, str(dora))])
    with pytest.raises(ConfigError, match="LoRA is off"):
        generate(engine(base, enable_lora=False), [[5, 6, 7]], [LoRARequest("x", 3, str(big))])
    assert not llm.engine.has_unfinished_requests()


class WithAdapter:
    """`llm` running every request with `lora`, for `assert_greedy_parity`."""

    def __init__(self, llm, lora):
        self.engine, self.llm, self.lora = llm.engine, llm, lora

    def generate(self, prompts, params, use_tqdm=False):
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=self.lora)


@pytest.mark.slow
def test_a_hybrid_models_attention_and_mlp_take_adapters_and_its_recurrent_layers_refuse_them(tmp_path):
    """Qwen3.5: an adapter on the attention layers (whose q_proj carries the output gate too) and the MLPs
    equals peft's merge; one on the Gated DeltaNet projections is refused, naming the module."""
    base = make_tiny_checkpoint("qwen3_5_text", tmp_path)
    adapter, merged = make_adapter(base, tmp_path, 4, seed=4)
    llm = engine(base, max_num_seqs=4)
    lora = LoRARequest("a", 1, str(adapter))
    assert_greedy_parity(WithAdapter(llm, lora), Reference(merged, MAX_TOKENS), mixed_prompts(300)[:4])
    recurrent = make_adapter(base, tmp_path / "delta", 4, seed=5, targets=["in_proj_qkv", "out_proj"])[0]
    with pytest.raises(ConfigError, match="linear_attn.in_proj_qkv"):
        generate(llm, [[5, 6, 7]], [LoRARequest("delta", 2, str(recurrent))])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_olmo_hybrids_attention_and_mlp_take_adapters_and_its_delta_nets_refuse_them(tmp_path):
    """OLMo Hybrid: its delta nets' projections share the attention's names (q_proj, ..., o_proj), so an
    adapter must name the attention's (`self_attn.q_proj`) to leave them out; one that reaches them is
    refused, naming the module."""
    base = make_tiny_checkpoint("olmo_hybrid", tmp_path)
    attention_and_mlp = [f"self_attn.{t}" for t in TARGETS[:4]] + TARGETS[4:]
    adapter, merged = make_adapter(base, tmp_path, 4, seed=4, targets=attention_and_mlp)
    llm = engine(base, max_num_seqs=4)
    lora = LoRARequest("a", 1, str(adapter))
    assert_greedy_parity(WithAdapter(llm, lora), Reference(merged, MAX_TOKENS), mixed_prompts(300)[:4])
    everywhere = make_adapter(base, tmp_path / "delta", 4, seed=5)[0]
    with pytest.raises(ConfigError, match="linear_attn"):
        generate(llm, [[5, 6, 7]], [LoRARequest("delta", 2, str(everywhere))])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_kimi_linears_latent_attention_output_and_mlp_take_adapters_and_its_kda_layers_refuse_them(tmp_path):
    """Kimi Linear: an adapter on the latent attention's o_proj (layer 2, the tiny model's MLA layer) and the
    dense MLP (layer 0; the shared experts take none, as DeepSeek's) equals peft's merge; its KDA layers share
    the attention's names (`self_attn.q_proj`, ...), and an adapter that reaches them is refused, naming the
    module."""
    base = make_tiny_checkpoint("kimi_linear", tmp_path)
    targets = ["layers.2.self_attn.o_proj", *(f"layers.0.mlp.{t}" for t in TARGETS[4:])]
    adapter, merged = make_adapter(base, tmp_path, 4, seed=4, targets=targets)
    llm = engine(base, max_num_seqs=4)
    lora = LoRARequest("a", 1, str(adapter))
    assert_greedy_parity(WithAdapter(llm, lora), Reference(merged, MAX_TOKENS), mixed_prompts(300)[:4])
    everywhere = make_adapter(base, tmp_path / "kda", 4, seed=5, targets=["q_proj", "o_proj"])[0]
    with pytest.raises(ConfigError, match=r"layers\.0\.self_attn"):
        generate(llm, [[5, 6, 7]], [LoRARequest("kda", 2, str(everywhere))])
    assert not llm.engine.has_unfinished_requests()
