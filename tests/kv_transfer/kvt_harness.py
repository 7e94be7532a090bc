"""Helpers of the KV-transfer tests: engines over the tiny model, greedy requests run to their end."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagellm.core.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling.params import SamplingParams


def prompt_of(length: int, seed: int) -> list[int]:
    """Token ids 3..383 (past the tiny tokenizer's special tokens), different for each seed."""
    return [3 + (seed * 131 + i * 37) % 380 for i in range(length)]


BLOCK = 16
MAX_TOKENS = 8
NUM_BLOCKS = 64


def make_engine(model_dir: Path, kv: dict | None = None, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=128, enforce_eager=True)
    settings.update(overrides)
    return LLMEngine(
        EngineConfig(model=str(model_dir), kv_transfer_config=json.dumps(kv) if kv else None, **settings)
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine, prompt, max_tokens: int = MAX_TOKENS, others=(), **kwargs):
    """One request to its end; `others` (producers that must register what they hold) step in between."""
    request_id = engine.add_request(prompt, greedy(max_tokens), **kwargs)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
        for other in others:
            if other.has_unfinished_requests():
                other.step()
    raise AssertionError(f"request {request_id} did not finish")


def storage(role: str, path) -> dict:
    return {
        "kv_connector": "shared_storage",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def zmq(role: str, **extra) -> dict:
    return {"kv_connector": "zmq", "kv_role": role, "kv_connector_extra_config": extra}


PROMPTS = [prompt_of(n, seed) for seed, n in enumerate((12, 17, 40, 64, 90))]
LOADED = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]  # whole blocks before each prompt's last token
DECODE = {"do_remote_decode": True}
