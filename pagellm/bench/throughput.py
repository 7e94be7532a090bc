"""Offline throughput of pagellm on a workload: every request queued at once, greedy, EOS ignored."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagellm.bench.floor import Floor, Machine, ModelShape
from pagellm.bench.steps import StepRecord, StepRecorder, records_work
from pagellm.bench.workloads import Workload
from pagellm.core.config import EngineConfig
from pagellm.engine.llm import LLM
from pagellm.lora.request import LoRARequest
from pagellm.models.loader import model_weight_bytes
from pagellm.sampling.params import SamplingParams, StructuredOutputsParams


@dataclass
class ThroughputResult:
    """One engine's run of a workload; `extra` holds what only some runs have (batch size, TTFT, hit rate)."""

    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
        }


def make_llm(config: EngineConfig) -> LLM:
    return LLM(**dataclasses.asdict(config))


def warm_up(llm: LLM) -> None:
    """One short request, so one-time costs (first kernel calls, allocations) stay out of the timing.

    Its token ids (1-16) are below the workloads' range (100 and up), so it never seeds the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 17))}], params, use_tqdm=False)


def run_pagellm(
    llm: LLM,
    workload: Workload,
    engine: str = "pagellm",
    machine: Machine | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    lora_requests: Sequence[LoRARequest] = (),
) -> ThroughputResult:
    """Generate every request of `workload` in one `LLM.generate` call and time it.

    Output tokens are counted from what came back, not from what was asked (a grammar may end a request
    early). With `lora_requests`, request i runs with adapter i mod their number. With `machine`, the result's extra["floor"] holds the run's floor (the work of the steps the
    engine ran) and its fraction of it."""
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=structured_outputs)
        for n in workload.output_lens
    ]
    loras = [lora_requests[i % len(lora_requests)] for i in range(len(prompts))] if lora_requests else None
    with StepRecorder(llm.engine) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics is not None]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = ThroughputResult(
        engine=engine,
        num_requests=len(outputs),
        input_tokens=workload.input_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        extra={
            "weights_mib": model_weight_bytes(llm.engine.runner.model) / 2**20,
            "attention_backend": llm.engine.setup.backend.name,
            "quantization": llm.engine.setup.quant_method.name if llm.engine.setup.quant_method else None,
            "steps": len(recorder.steps),
            **({"mean_ttft_s": sum(ttfts) / len(ttfts)} if ttfts else {}),
        },
    )
    if machine is not None:
        result.extra["floor"] = floor_report(llm, recorder.steps, machine, elapsed, output_tokens)
    return result


def floor_report(
    llm: LLM,
    steps: list[StepRecord],
    machine: Machine,
    measured_s: float | None = None,
    output_tokens: int | None = None,
) -> dict[str, Any]:
    """The floor of these recorded steps on `machine` (see pagellm.bench.floor), as a JSON-ready dict."""
    shape = ModelShape.from_llm(llm)
    report = Floor(records_work(shape, steps), machine).report(measured_s, output_tokens)
    # each step bounded on its own (prompt steps by compute, decode steps often by memory): a tighter floor
    report["floor_s_stepwise"] = sum(Floor(records_work(shape, [s]), machine).floor_s for s in steps)
    return report


def run_prefix_comparison(
    config: EngineConfig,
    workload: Workload,
    on_result: Callable[[ThroughputResult], None] | None = None,
    machine: Machine | Callable[[LLM], Machine] | None = None,
) -> list[ThroughputResult]:
    """Run `workload` with prefix caching on, then off, each on a fresh engine in this process.

    The hit rate is the share of prompt tokens the prefix cache served during the timed run; `on_result`
    sees each run's result as soon as it is measured. `machine` (or a function of the first engine that
    measures it) adds each run's floor."""
    results = []
    for caching in (True, False):
        llm = make_llm(config.replace(enable_prefix_caching=caching))
        warm_up(llm)
        if callable(machine):
            machine = machine(llm)
        before = llm.engine.stats()
        name = f"pagellm (prefix caching {'on' if caching else 'off'})"
        result = run_pagellm(llm, workload, engine=name, machine=machine)
        after = llm.engine.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        result.extra.update(
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
        )
        results.append(result)
        if on_result is not None:
            on_result(result)
        del llm
        gc.collect()
    return results
