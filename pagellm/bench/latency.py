"""Latency of one batch: every engine step timed, split into prefill steps and decode steps.

A step counts as prefill while some request of the batch has not produced its first token yet; once all
have, every further step is a decode step. With a `Machine`, each phase gets its floor: the work of the
steps the engine ran in it (pagellm.bench.floor) against the measured matmul peak and read bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagellm.bench.floor import Machine
from pagellm.bench.steps import StepRecord, StepRecorder
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
    floor: dict[str, Any] = field(default_factory=dict)  # "decode", "prefill", "run": floor reports

    def as_dict(self) -> dict[str, Any]:
        decode_ms = np.array(self.decode_step_s or [float("nan")]) * 1000
        prefill_s = sum(self.prefill_step_s)
        out = {
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "prefill_steps": len(self.prefill_step_s),
            "prefill_s": prefill_s,
            "prefill_tok_s": self.batch_size * self.input_len / prefill_s if prefill_s else None,
            "decode_steps": len(self.decode_step_s),
            "decode_step_mean_ms": float(decode_ms.mean()),
            "decode_step_p50_ms": float(np.percentile(decode_ms, 50)),
            "decode_step_p99_ms": float(np.percentile(decode_ms, 99)),
            "e2e_s": self.e2e_s,
            "output_tok_s": self.batch_size * self.output_len / self.e2e_s,
        }
        if self.floor:
            out["floor"] = self.floor
        return out


def latency_prompts(vocab_size: int, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return rng.randint(100, vocab_size - 100, size=(batch_size, input_len)).tolist()


def run_batch(
    llm: LLM, prompts: list[list[int]], output_len: int
) -> tuple[list[StepRecord], list[bool], float]:
    """Queue the prompts, each generating `output_len`, and step the engine until all finish.

    Returns the recorded steps, whether each was a decode step, and the end-to-end time."""
    import time

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    is_decode: list[bool] = []
    with StepRecorder(engine) as recorder:
        start = time.perf_counter()
        ids = {engine.add_request({"prompt_token_ids": p}, params) for p in prompts}
        started: set[str] = set()
        while engine.has_unfinished_requests():
            decoding = started == ids
            outputs = engine.step()
            is_decode += [decoding] * (len(recorder.steps) - len(is_decode))
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
        e2e = time.perf_counter() - start
    return recorder.steps, is_decode, e2e


def run_latency(
    llm: LLM,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    machine: Machine | None = None,
    prompts: list[list[int]] | None = None,
) -> LatencyResult:
    """Queue `batch_size` random prompts of `input_len` tokens (or the `prompts` given; `input_len` is then
    their mean length), each generating `output_len`, and step the engine until all finish; with
    `machine`, the floor of each phase and of the whole run."""
    from pagellm.bench.throughput import floor_report

    if prompts is None:
        prompts = latency_prompts(llm.engine.setup.hf_config.vocab_size, batch_size, input_len, seed)
    else:
        batch_size, input_len = len(prompts), round(sum(map(len, prompts)) / len(prompts))
    steps, is_decode, e2e = run_batch(llm, prompts, output_len)
    prefill = [s for s, d in zip(steps, is_decode, strict=True) if not d]
    decode = [s for s, d in zip(steps, is_decode, strict=True) if d]
    result = LatencyResult(
        batch_size, input_len, output_len, [s.seconds for s in prefill], [s.seconds for s in decode], e2e
    )
    if machine is not None:
        result.floor["run"] = floor_report(llm, steps, machine, e2e, batch_size * output_len)
        if prefill:
            prefill_s = sum(s.seconds for s in prefill)
            report = floor_report(llm, prefill, machine, prefill_s)
            report["floor_prompt_tok_s"] = batch_size * input_len / report["floor_s"]
            result.floor["prefill"] = report
        if decode:
            report = floor_report(
                llm, decode, machine, sum(s.seconds for s in decode), len(decode) * batch_size
            )
            report["floor_step_ms"] = report["floor_s"] / len(decode) * 1000
            report["floor_step_ms_stepwise"] = report["floor_s_stepwise"] / len(decode) * 1000
            result.floor["decode"] = report
    return result
