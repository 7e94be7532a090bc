"""Offline throughput of pagellm on a workload: every request queued at once, greedy, EOS ignored.

`main` is `pagellm bench throughput`: W1 on pagellm and on the peers asked for (pagellm.bench.peers,
pagellm.bench.llama_cpp), with the run's floor."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.bench.common import (
    ThroughputResult,
    W1Args,
    echo,
    floor_row,
    progress,
    table,
    with_floor,
    write_json,
)
from pagellm.bench.floor import Floor, Machine, ModelShape, format_floor
from pagellm.bench.speculation import acceptance, format_acceptance
from pagellm.bench.steps import StepRecord, StepRecorder, records_work
from pagellm.bench.workloads import Workload
from pagellm.core.config import EngineConfig
from pagellm.engine.llm import LLM
from pagellm.engine.setup import cache_dir
from pagellm.lora.request import LoRARequest
from pagellm.models.loader import model_weight_bytes
from pagellm.sampling.params import SamplingParams, StructuredOutputsParams


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


# -- `pagellm bench throughput` ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class ThroughputArgs(W1Args):
    """`pagellm bench throughput`: W1 on pagellm, then on the peers asked for."""

    workload: str = "W1"
    compare: Sequence[str] = ()  # peers: "transformers", "llama.cpp"
    peer_batch_sizes: Sequence[int] = (8, 16, 64)  # transformers: static batch sizes; the best one counts
    peer_dtype: str | None = None  # transformers: the dtype to load it in; None: the run's
    llama_server: str | None = None  # llama.cpp: the llama-server executable; None: the peer is skipped
    llama_model: str | None = None  # llama.cpp: the GGUF; None: the run's model written as one, cached
    llama_slots: Sequence[int] = (8, 16, 32)  # llama.cpp: slot counts to try
    llama_flash_attn: Sequence[str] = ("on", "off")  # llama.cpp: flash attention settings to try
    llama_args: Sequence[str] = ()  # llama.cpp: extra llama-server arguments
    lora_modules: Sequence[tuple[str, str]] = ()  # (name, path): also run the requests over these adapters
    json_schema: dict[str, Any] | None = None  # also run the requests constrained to this JSON schema


def main(args: ThroughputArgs) -> dict[str, Any]:
    """Offline throughput: all requests queued at once, greedy, EOS ignored. Prints the table, the floor and
    the ratios to the peers, writes `args.output_json`, and returns the report's sections."""
    config = args.engine_config()
    adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules)]
    if adapters:
        config = config.replace(enable_lora=True, max_loras=len(adapters), max_lora_rank=64)
    llm = make_llm(config)
    requests = args.w1(llm.engine.setup.hf_config.vocab_size)
    warm_up(llm)
    machine = args.llm_machine(llm)
    before = llm.engine.stats()
    results = _run_pagellm_variants(llm, requests, args, adapters, machine)
    dtype, device = llm.engine.setup.dtype, llm.engine.runner.device
    speculation = acceptance(before, llm.engine.stats()) if config.speculative else None
    del llm
    gc.collect()
    if speculation is not None:  # the same run without it, for the speedup
        results["pagellm without speculation"] = _run_without_speculation(config, requests)
    skipped = _run_peers(config, requests, dtype, device, args, results)
    rows, floor, ratios = _echo_report(results, speculation, skipped)
    sections = {
        "workload": requests.describe(),
        "results": rows,
        "ratio": ratios.get("transformers"),
        "ratios": ratios,
        "skipped": skipped,
        "floor": floor,
        "speculation": speculation,
    }
    write_json(args.output_json, "throughput", config, **sections)
    return sections


def _run_pagellm_variants(
    llm: LLM, requests: Workload, args: ThroughputArgs, adapters: list[LoRARequest], machine: Machine
) -> dict[str, ThroughputResult]:
    """pagellm's run, then the same requests over the LoRA adapters and under the JSON schema where asked,
    each after a prefix-cache reset so it gets no head start from the runs before."""
    results = {"pagellm": run_pagellm(llm, requests, machine=machine)}
    progress(results["pagellm"])
    if adapters:  # the same requests spread over the adapters, for their cost
        llm.reset_prefix_cache()
        name = f"pagellm + {len(adapters)} LoRA adapters"
        results[name] = run_pagellm(llm, requests, name, lora_requests=adapters)
        progress(results[name])
    if args.json_schema:  # the same requests under a JSON-schema constraint, for its cost
        schema = StructuredOutputsParams(json=args.json_schema)
        llm.reset_prefix_cache()  # no head start from the first run's prompts
        results["pagellm + JSON schema"] = run_pagellm(
            llm, requests, "pagellm + JSON schema", structured_outputs=schema
        )
        progress(results["pagellm + JSON schema"])
    return results


def _run_without_speculation(config: EngineConfig, requests: Workload) -> ThroughputResult:
    """The same run on an engine without speculative decoding, built after the first one is freed: the
    baseline of speculation's speedup."""
    plain = make_llm(config.replace(speculative_config=None))
    warm_up(plain)
    result = run_pagellm(plain, requests)
    result.engine = "pagellm without speculation"
    progress(result)
    del plain
    gc.collect()
    return result


def _run_peers(
    config: EngineConfig,
    requests: Workload,
    dtype: Any,
    device: Any,
    args: ThroughputArgs,
    results: dict[str, ThroughputResult],
) -> dict[str, str]:
    """The peers in `args.compare`, their results added to `results`; returns the reasons of those
    skipped."""
    if "transformers" in args.compare:
        peer_dtype = getattr(torch, args.peer_dtype) if args.peer_dtype else dtype
        name = "transformers" if peer_dtype == dtype else f"transformers in {args.peer_dtype}"
        results["transformers"] = _run_transformers(
            config, requests, peer_dtype, device, args.peer_batch_sizes, name
        )
    skipped = {}
    if "llama.cpp" in args.compare:
        result, reason = _run_llama_cpp(config, requests, dtype, args)
        if result is None:
            skipped["llama.cpp"] = reason
            echo(f"llama.cpp peer skipped: {reason}", err=True)
        else:
            results["llama.cpp"] = result
    return skipped


def _echo_report(
    results: dict[str, ThroughputResult], speculation: dict[str, Any] | None, skipped: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, float]]:
    """Print the table, the floor, pagellm's ratio to every other run (speculation's speedup added to
    `speculation`), llama.cpp's every setting and the peers skipped; returns the rows, the floor and the
    ratios."""
    rows = {name: with_floor(r.as_dict()) for name, r in results.items()}
    floor = results["pagellm"].extra["floor"]
    echo(table([*rows.values(), floor_row(floor, rows["pagellm"])]))
    echo(format_floor(floor))
    ratios = {
        name: results["pagellm"].output_tok_s / r.output_tok_s
        for name, r in results.items()
        if name != "pagellm"
    }
    for name, ratio in ratios.items():
        echo(f"pagellm / {results[name].engine}: {ratio:.2f}x output tok/s")
    if speculation is not None:
        speculation["speedup"] = ratios["pagellm without speculation"]
        echo(format_acceptance(speculation))
    if "llama.cpp" in results:
        by_setting = results["llama.cpp"].extra["output_tok_s_by_setting"]
        echo(
            "llama.cpp, every setting: "
            + ", ".join(f"{k.removeprefix('llama.cpp ')} {v:.1f}" for k, v in by_setting.items())
            + " output tok/s"
        )
    for name, reason in skipped.items():
        echo(f"{name}: skipped ({reason})")
    return rows, floor, ratios


def _run_transformers(
    config: EngineConfig, requests: Workload, dtype: Any, device: Any, batch_sizes: Sequence[int], name: str
) -> ThroughputResult:
    """transformers' best static batch; `name` heads its rows (a peer in another dtype than pagellm's says
    so in every row)."""
    from pagellm.bench.peers import load_transformers_model, run_transformers  # peers import this module

    peer_model = load_transformers_model(config.model, config.gguf_file, dtype, device)
    result = run_transformers(peer_model, requests, list(batch_sizes), on_result=progress, name=name)
    del peer_model
    gc.collect()
    return result


def _run_llama_cpp(
    config: EngineConfig, requests: Workload, dtype: Any, args: ThroughputArgs
) -> tuple[ThroughputResult | None, str | None]:
    """The llama.cpp peer's best result, or (None, why it did not run)."""
    from pagellm.bench import llama_cpp  # llama_cpp imports this module

    if not args.llama_server:
        return (
            None,
            "no llama-server given; pass --llama-server PATH (build it from github.com/ggml-org/llama.cpp)",
        )
    path = llama_cpp.find_binary(args.llama_server)
    if path is None:
        return None, f"--llama-server {args.llama_server}: not an executable file, nor found on PATH"
    gguf = args.llama_model
    if gguf is None:
        gguf = llama_cpp.gguf_for(config, str(dtype).removeprefix("torch."), cache_dir())
    echo(f"llama.cpp runs {gguf}", err=True)
    result = llama_cpp.run_llama_cpp(
        path,
        gguf,
        requests,
        list(args.llama_slots),
        list(args.llama_flash_attn),
        torch.get_num_threads(),
        list(args.llama_args),
        on_result=progress,
    )
    return result, None
