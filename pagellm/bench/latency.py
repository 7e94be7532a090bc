"""Latency of one batch: every engine step timed, split into prefill steps and decode steps.

A step counts as prefill while some request of the batch has not produced its first token yet; once all
have, every further step is a decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagellm.engine.llm import LLM
from pagellm.sampling.params import SamplingParams


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_step_s: list[float]
    decode_step_s: list[float]
    e2e_s: float

    def as_dict(self) -> dict[str, Any]:
        decode_ms = np.array(self.decode_step_s or [float("nan")]) * 1000
        return {
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "prefill_steps": len(self.prefill_step_s),
            "prefill_s": sum(self.prefill_step_s),
            "decode_steps": len(self.decode_step_s),
            "decode_step_mean_ms": float(decode_ms.mean()),
            "decode_step_p50_ms": float(np.percentile(decode_ms, 50)),
            "decode_step_p99_ms": float(np.percentile(decode_ms, 99)),
            "e2e_s": self.e2e_s,
            "output_tok_s": self.batch_size * self.output_len / self.e2e_s,
        }


def run_latency(llm: LLM, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> LatencyResult:
    """Queue `batch_size` random prompts of `input_len` tokens, each generating `output_len`, and step
    the engine until all finish."""
    engine = llm.engine
    vocab = engine.setup.hf_config.vocab_size
    prompts = np.random.RandomState(seed).randint(100, vocab - 100, size=(batch_size, input_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = {engine.add_request({"prompt_token_ids": p}, params) for p in prompts}
    started: set[str] = set()
    prefill, decode = [], []
    while engine.has_unfinished_requests():
        is_decode = started == ids
        step_start = time.perf_counter()
        outputs = engine.step()
        (decode if is_decode else prefill).append(time.perf_counter() - step_start)
        started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    return LatencyResult(batch_size, input_len, output_len, prefill, decode, time.perf_counter() - start)
