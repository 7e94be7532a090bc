"""Fixtures of the server tests: one tiny random-weight checkpoint, and one AsyncLLM over it for the in-process
tests, for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import make_tiny_checkpoint

from pagellm import AsyncLLM


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def llm(tiny_model_dir):
    """128 tokens of context, 128 KV blocks of 16 tokens: 2032 tokens of KV cache. On a thread, so tests can
    reach into `llm.engine`; tests/server/test_engine_process.py covers the engine process."""
    llm = AsyncLLM(
        str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=128, engine_process=False
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def pooling_llm(tiny_model_dir):
    """The same checkpoint as an embedding model (`runner="pooling"`, LAST pooling, normalized), on a thread."""
    llm = AsyncLLM(
        str(tiny_model_dir),
        runner="pooling",
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=128,
        engine_process=False,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def gpt_oss_llm(tmp_path_factory):
    """A tiny random GPT-OSS (harmony chat template and special tokens) with the `openai_gptoss` reasoning
    parser, on a thread: 1024 tokens of context, for harmony prompts with tools (the tiny tokenizer spends
    about a token a character)."""
    model_dir = make_tiny_checkpoint(
        "gpt_oss", tmp_path_factory.mktemp("harmony"), max_position_embeddings=1024
    )
    llm = AsyncLLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=192,
        max_model_len=1024,
        engine_process=False,
        reasoning_parser="openai_gptoss",
    )
    yield llm
    llm.shutdown()
