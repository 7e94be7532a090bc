"""`pagellm bench`: the workloads follow shared/bench/README.md's recipe (docs/benchmarks.md), and each command
runs end to end on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bench_cli import ENGINE_ARGS, FLOOR_ARGS, SMALL_W1, run_bench

from pagellm.bench.workloads import make_byte_tokenizer, w1, w3


def test_w1_follows_the_readme_recipe():
    workload = w1(49152)
    rng = np.random.RandomState(0)
    input_lens = rng.randint(64, 513, size=64)
    output_lens = rng.randint(16, 257, size=64)
    first = rng.randint(100, 49152 - 100, size=input_lens[0])
    assert workload.num_requests == 64
    assert [len(p) for p in workload.prompts] == input_lens.tolist()
    assert workload.output_lens == output_lens.tolist()
    assert workload.prompts[0] == first.tolist()
    assert all(64 <= len(p) <= 512 for p in workload.prompts)
    assert all(16 <= n <= 256 for n in workload.output_lens)
    assert all(100 <= t < 49152 - 100 for p in workload.prompts for t in p)
    assert w1(49152).prompts == workload.prompts


def test_w1_custom_counts_and_lengths():
    workload = w1(384, num_prompts=5, input_len=(10, 12), output_len=(3, 3))
    assert workload.num_requests == 5
    assert all(10 <= len(p) <= 12 for p in workload.prompts)
    assert workload.output_lens == [3] * 5


def test_w3_shares_one_prefix_with_unique_suffixes():
    workload = w3(49152)
    assert workload.num_requests == 64
    assert all(len(p) == 1024 + 64 for p in workload.prompts)
    assert len({tuple(p[:1024]) for p in workload.prompts}) == 1
    assert len({tuple(p[1024:]) for p in workload.prompts}) == 64
    assert workload.output_lens == [64] * 64


def test_byte_tokenizer_covers_every_id():
    tokenizer = make_byte_tokenizer(5000)
    assert len(tokenizer) == 5000
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"
    assert tokenizer.decode([4999]).isprintable()


@pytest.mark.parametrize("peer_dtype", [None, "bfloat16"])
def test_throughput_against_transformers(tiny_model, tmp_path, peer_dtype):
    out = tmp_path / "result.json"
    args = ["throughput", "--model", tiny_model, *SMALL_W1]
    args += ["--compare", "transformers", "--peer-batch-sizes", "2", "--output-json", str(out), *ENGINE_ARGS]
    if peer_dtype:  # the peer in another dtype than the run's (float32) says so in its rows
        args += ["--peer-dtype", peer_dtype]
    result = run_bench([*args, *FLOOR_ARGS])
    assert "output tok/s" in result.output
    name = f"transformers in {peer_dtype}" if peer_dtype else "transformers"
    assert f"{name} (batch 2)" in result.output
    assert "of the floor" in result.output and "floor (" in result.output
    report = json.loads(out.read_text())
    pagellm, peer = report["results"]["pagellm"], report["results"]["transformers"]
    assert report["workload"]["num_requests"] == 4
    assert pagellm["output_tokens"] == peer["output_tokens"] == report["workload"]["output_tokens"]
    assert report["ratio"] == pytest.approx(pagellm["output_tok_s"] / peer["output_tok_s"])
    assert report["ratios"]["transformers"] == report["ratio"]
    assert report["config"]["dtype"] == "float32" and peer["extra"]["dtype"] == (peer_dtype or "float32")
    assert {"date", "versions"} <= set(report)
    floor = report["floor"]
    assert floor == pagellm["extra"]["floor"]
    assert (floor["peak_tflops"], floor["read_gb_s"], floor["measured"]) == (0.5, 20, False)
    assert floor["floor_s"] == max(floor["compute_s"], floor["memory_s"]) > 0
    assert floor["fraction_of_floor"] == pytest.approx(floor["floor_s"] / pagellm["elapsed_s"])
    assert floor["steps"] == pagellm["extra"]["steps"] >= max(report["workload"]["output_len_range"])
    assert floor["floor_output_tok_s"] == pytest.approx(pagellm["output_tokens"] / floor["floor_s"])


def test_latency(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    args = ["latency", "--model", tiny_model, "--batch-size", "3", "--input-len", "20", "--output-len", "5"]
    result = run_bench([*args, "--output-json", str(out), "--profile", *ENGINE_ARGS, *FLOOR_ARGS])
    assert "decode: 4 steps" in result.output
    assert "decode step floor:" in result.output and "prefill floor:" in result.output
    report = json.loads(out.read_text())
    latency = report["results"]["pagellm"]
    assert latency["prefill_steps"] >= 1
    assert latency["decode_step_p99_ms"] >= latency["decode_step_p50_ms"] > 0
    decode = report["floor"]["decode"]
    assert decode["steps"] == 4 and decode["floor_step_ms"] == pytest.approx(decode["floor_s"] / 4 * 1000)
    assert decode["kv_bytes"] > 0 and report["floor"]["prefill"]["floor_prompt_tok_s"] > 0
    # the profile: every part of a decode step, adding up to the step
    for part in ("attention", "linears", "lm_head", "sampling", "Python and other"):
        assert part in result.output
    profile = report["profile"]
    parts = ("attention", "linears", "lm_head", "sampling", "other_layers", "python")
    assert sum(profile["decode"][f"{p}_ms"] for p in parts) == pytest.approx(
        profile["decode"]["step_ms"], rel=0.05
    )
    assert profile["decode"]["attention_ms"] > 0 and profile["decode"]["linears_ms"] > 0
    assert profile["hook_calls"]["attention"] > 0 and profile["top_ops"]


def test_prefix_hit_rate_on_and_off(tiny_model, tmp_path):
    out = tmp_path / "prefix.json"
    args = ["prefix", "--model", tiny_model, "--num-prompts", "4", "--prefix-len", "64", "--suffix-len", "8"]
    args += [
        "--output-len",
        "3",
        "--max-num-batched-tokens",
        "72",
        "--max-num-seqs",
        "4",
        "--output-json",
        str(out),
        *ENGINE_ARGS,
        *FLOOR_ARGS,
    ]
    result = run_bench(args)
    assert "hit rate" in result.output
    assert "prefix caching on) floor" in result.output
    on, off = json.loads(out.read_text())["results"]
    assert on["extra"]["prefix_cache_hit_rate"] > 0
    assert off["extra"]["prefix_cache_hit_rate"] == 0
    assert on["extra"]["mean_ttft_s"] > 0
    # the prefix served from the cache costs no FLOPs: the run with caching on has less work to do
    assert on["extra"]["floor"]["linear_flops"] < off["extra"]["floor"]["linear_flops"]


def test_model_m_is_built_once_into_the_cache_dir(tmp_path, monkeypatch):
    from pagellm.bench import workloads

    small = dict(workloads.MODEL_M_CONFIG, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    monkeypatch.setattr(workloads, "MODEL_M_CONFIG", dict(small, intermediate_size=64, vocab_size=600))
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    path = workloads.resolve_model("M")
    assert path == str(tmp_path / "M")
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen2", 600, True)
    assert len(AutoTokenizer.from_pretrained(path)) == 600
    assert workloads.resolve_model("M") == path


def test_model_d_dense_is_model_d_without_its_indexer(tmp_path, monkeypatch):
    """D-dense is D's checkpoint as DeepSeek-V3: the same tensors but the indexers', so where every query
    reads all its tokens (a prompt within index_topk) the two give the same logits."""
    from safetensors.torch import load_file

    from pagellm import LLM, SamplingParams
    from pagellm.bench import workloads

    small = dict(workloads.MODEL_D_CONFIG, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    small.update(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8
    )
    small.update(v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=64, first_k_dense_replace=2)
    small.update(intermediate_size=64, vocab_size=600, max_position_embeddings=256)
    monkeypatch.setattr(workloads, "MODEL_D_CONFIG", small)
    sparse, dense = (workloads.random_model_path(name, tmp_path) for name in ("D", "D-dense"))
    tensors = {n: t for n, t in load_file(str(sparse / "model.safetensors")).items() if ".indexer." not in n}
    twin = load_file(str(dense / "model.safetensors"))
    assert tensors.keys() == twin.keys() and all(t.equal(twin[n]) for n, t in tensors.items())
    outputs = []
    for path in (sparse, dense):
        llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64)
        out = llm.generate(
            [{"prompt_token_ids": list(range(10, 40))}], SamplingParams(max_tokens=8, logprobs=3)
        )
        outputs.append(out[0].outputs[0])
    assert outputs[0].token_ids == outputs[1].token_ids
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_peer_loads_a_gguf_file_dequantized(monkeypatch):
    import torch
    import transformers

    from pagellm.bench.peers import load_transformers_model

    calls = []
    loaded = torch.nn.Linear(1, 1)
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **kw: calls.append((a, kw)) or loaded,
    )
    assert load_transformers_model("/models/s/model.Q4_1.gguf", None, torch.bfloat16) is loaded
    ((args, kwargs),) = calls
    assert args == ("/models/s",)
    assert kwargs["gguf_file"] == "model.Q4_1.gguf" and kwargs["dtype"] == torch.bfloat16
    assert kwargs["quantization_config"].dequantize


def test_the_transformers_peer_runs_on_the_engines_device(tiny_model):
    """On a GPU the peer must run there too, or the ratio compares a GPU with a CPU (issue 17): the model
    goes to the engine's device and every batch's inputs follow it."""
    import torch

    from pagellm.bench.peers import _generate, load_transformers_model

    model = load_transformers_model(str(tiny_model), None, torch.float32, "meta")
    assert model.device.type == "meta"

    class Stub:
        device = torch.device("meta")

        def generate(self, input_ids, attention_mask, **kwargs):
            assert input_ids.device.type == attention_mask.device.type == "meta"
            return input_ids

    _generate(Stub(), [[5, 6, 7], [8]], 2, 0)


@pytest.mark.parametrize(("name", "model_type"), [("E", "qwen3_moe"), ("M-gemma3", "gemma3_text")])
def test_random_models_are_built_from_their_configs(name, model_type, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from pagellm.bench import workloads

    config_name = workloads.RANDOM_MODELS[name][1]
    small = dict(getattr(workloads, config_name), hidden_size=32, num_hidden_layers=6, vocab_size=600)
    small.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    small.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64)
    if name == "E":
        small.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    else:
        small["layer_types"] = small["layer_types"][:6]
    monkeypatch.setattr(workloads, config_name, small)
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    path = workloads.resolve_model(name)
    config = AutoConfig.from_pretrained(path)
    assert (path, config.model_type, config.vocab_size) == (str(tmp_path / name), model_type, 600)


def test_images_runs_i1_on_model_v_beside_transformers(tmp_path, monkeypatch):
    """`pagellm bench images`: I1's requests on a (shrunk) model V, every image encoded once, TTFT and the
    encoder's share reported for pagellm, the same requests through transformers one at a time and batched,
    and the floor with the encoder's work in it."""
    from pagellm.bench import workloads

    small = dict(workloads.MODEL_V_CONFIG)
    small["text_config"] = dict(
        small["text_config"], hidden_size=64, num_hidden_layers=2, intermediate_size=128
    )
    small["vision_config"] = dict(small["vision_config"], hidden_size=32, intermediate_size=64, image_size=56)
    small["vision_config"].update(num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
    monkeypatch.setattr(workloads, "MODEL_V_CONFIG", small)
    model = workloads.random_model_path("V", tmp_path)
    out = tmp_path / "images.json"
    args = ["images", "--model", str(model), "--num-prompts", "3", "--compare", "transformers"]
    args += ["--peer-batch-sizes", "1,2"]
    result = run_bench([*args, "--output-json", str(out), *ENGINE_ARGS, *FLOOR_ARGS])
    assert "encoder share" in result.output and "pagellm floor" in result.output
    report = json.loads(out.read_text())
    assert report["workload"]["image_size"] == [56, 56]
    pagellm, one, two = report["results"]
    assert [one["engine"], two["engine"]] == ["transformers (batch 1)", "transformers (batch 2)"]
    assert pagellm["output_tokens"] == one["output_tokens"] == report["workload"]["output_tokens"]
    assert pagellm["extra"]["images_encoded"] == 3
    assert 0 < pagellm["extra"]["encoder_share"] < 1
    assert pagellm["input_tokens"] > 3 * 16  # each prompt holds its image's 16 tokens
    assert pagellm["extra"]["floor"]["linear_flops"] > 0 and 0 < pagellm["fraction_of_floor"]


def test_chat_prompts_are_the_same_every_run_and_differ_by_seed():
    from pagellm.bench.workloads import chat_questions

    assert chat_questions(20, seed=0) == chat_questions(20, seed=0)
    assert chat_questions(20, seed=0) != chat_questions(20, seed=1)
    assert all(q.endswith((".", "?")) and "{}" not in q for q in chat_questions(50))
    asked = chat_questions(64, seed=0)  # what bench latency --prompts chat asks, up to batch 64
    assert asked[:8] == chat_questions(8, seed=0)
    training = chat_questions(500, seed=1, avoid=asked)  # examples/train_eagle3_head.py --chat 500
    assert len(training) == 500 and not set(training) & set(asked)


def test_latency_with_speculation_counts_tokens_not_steps(tiny_model, tmp_path):
    """Chat prompts, and the decode time per token of a request: a verifying step may give a request
    several tokens, so the steps no longer count them."""
    from pagellm.bench.workloads import chat_prompts
    from pagellm.engine.tokenizer import load_tokenizer

    out = tmp_path / "latency.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    args = ["latency", "--model", tiny_model, "--batch-size", "2", "--output-len", "24", "--prompts", "chat"]
    args += ["--rounds", "2", "--speculative-config", spec, "--output-json", str(out), *ENGINE_ARGS]
    result = run_bench(args)
    report = json.loads(out.read_text())
    latency = report["results"]["pagellm"]
    prompts = chat_prompts(load_tokenizer(tiny_model), 4)  # two batches of two
    assert latency["input_len"] == round(sum(map(len, prompts)) / 4) and latency["rounds"] == 2
    assert "batch 2, input" in result.output and "2 batches one after another" in result.output
    assert latency["decode_tokens"] == 4 * 23  # every token but the first, which a prefill step gives
    per_token = latency["decode_step_mean_ms"] * latency["decode_steps"] * 2 / latency["decode_tokens"]
    assert latency["decode_ms_per_token"] == pytest.approx(per_token)
    plain = report["results"]["pagellm without speculation"]
    assert plain["decode_tokens"] == 4 * 23 and plain["decode_steps"] == 2 * 23
    assert plain["decode_ms_per_token"] == plain["decode_step_mean_ms"]
    speedup = plain["decode_ms_per_token"] / latency["decode_ms_per_token"]
    assert report["speculation"]["decode_speedup"] == pytest.approx(speedup)
    assert f"with: {speedup:.2f}x" in result.output
    accepted = report["speculation"]["num_accepted_tokens"]
    assert 2 * 23 - accepted <= latency["decode_steps"] <= 2 * 23
    assert ("decode per token of a request" in result.output) == (latency["decode_steps"] < 2 * 23)
