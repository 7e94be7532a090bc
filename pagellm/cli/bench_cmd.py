"""`pagellm bench throughput|latency|prefix|serve`: the workloads of shared/bench/README.md from the
command line.

Each prints a summary table and can write a JSON file with the engine config, the workload, the results,
the package versions and the date, so runs can be compared later. Runs default to bfloat16, as the
README asks; `--dtype` overrides it. Every run also prints its floor (pagellm.bench.floor): the work it
had to do against this machine's matmul peak and read bandwidth, measured on the spot.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform as pyplatform
from collections.abc import Callable
from typing import Any

import click

from pagellm.cli.options import config_from_options, engine_options

_COLUMNS = (
    ("engine", "engine", "{}"),
    ("requests", "num_requests", "{}"),
    ("input tokens", "input_tokens", "{}"),
    ("output tokens", "output_tokens", "{}"),
    ("elapsed s", "elapsed_s", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("weights MiB", "weights_mib", "{:.1f}"),
    ("of floor", "fraction_of_floor", "{:.0%}"),
)


def _common_options(command: Callable) -> Callable:
    command = engine_options(skip=("model",))(command)
    command = click.option(
        "--read-gb-s",
        type=float,
        default=None,
        help="DRAM read bandwidth (GB/s) for the floor. [default: measured on the spot]",
    )(command)
    command = click.option(
        "--peak-tflops",
        type=float,
        default=None,
        help="Matmul peak (TFLOP/s, in the run's dtype) for the floor. [default: measured on the spot]",
    )(command)
    command = click.option(
        "--output-json",
        "--output",
        "output_json",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the results here.",
    )(command)
    return click.option(
        "--model",
        default="S",
        show_default=True,
        help="S (the embedded SmolLM2-135M), M (random Qwen2 shaped like Qwen2.5-0.5B) or a model path.",
    )(command)


def workload_options(command: Callable) -> Callable:
    """The W1 workload's size: --num-prompts and the ranges of input and output lengths."""
    for option in reversed(
        (
            click.option("--num-prompts", type=int, default=64, show_default=True),
            click.option("--input-len-min", type=int, default=64, show_default=True),
            click.option("--input-len-max", type=int, default=512, show_default=True),
            click.option("--output-len-min", type=int, default=16, show_default=True),
            click.option("--output-len-max", type=int, default=256, show_default=True),
        )
    ):
        command = option(command)
    return command


def _config(model: str, options: dict[str, Any]):
    from pagellm.bench.workloads import resolve_model

    return config_from_options(options, model=resolve_model(model), dtype=options.get("dtype") or "bfloat16")


def _machine(dtype, device, peak_tflops: float | None, read_gb_s: float | None):
    """This machine's matmul peak and read bandwidth (measured once per process unless both are given)."""
    from pagellm.bench.floor import measure_machine

    if peak_tflops is None or read_gb_s is None:
        click.echo("measuring the matmul peak and the read bandwidth for the floor ...", err=True)
    machine = measure_machine(dtype, device, peak_tflops, read_gb_s)
    click.echo(
        f"machine: {machine.dtype} matmul peak {machine.peak_flops / 1e12:.2f} TFLOP/s, read "
        f"{machine.read_bytes_s / 1e9:.1f} GB/s, {machine.threads} threads"
        f" ({'measured now' if machine.measured else 'given'})",
        err=True,
    )
    return machine


def _llm_machine(llm, options: dict[str, Any]):
    return _machine(
        llm.engine.setup.dtype, llm.engine.runner.device, options.pop("peak_tflops"), options.pop("read_gb_s")
    )


def _with_floor(row: dict[str, Any]) -> dict[str, Any]:
    floor = row.get("extra", {}).get("floor")
    return {**row, "fraction_of_floor": floor["fraction_of_floor"]} if floor else row


def _floor_row(floor: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A table row for the floor itself: its time and rates for the same tokens."""
    return {
        "engine": f"floor ({floor['bound']}-bound)",
        "num_requests": template["num_requests"],
        "input_tokens": template["input_tokens"],
        "output_tokens": template["output_tokens"],
        "elapsed_s": floor["floor_s"],
        "output_tok_s": template["output_tokens"] / floor["floor_s"],
        "total_tok_s": (template["input_tokens"] + template["output_tokens"]) / floor["floor_s"],
        "fraction_of_floor": 1.0,
    }


def _cell(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def _table(rows: list[dict[str, Any]], columns=_COLUMNS) -> str:
    cells = [[title for title, _, _ in columns]]
    cells += [
        [_cell(fmt, row.get(key, row.get("extra", {}).get(key))) for _, key, fmt in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _progress(result) -> None:
    """One line on stderr as each run ends, so a long benchmark shows its numbers before the table."""
    click.echo(
        f"{result.engine}: {result.output_tok_s:.1f} output tok/s, {result.total_tok_s:.1f} total tok/s "
        f"({result.elapsed_s:.1f} s)",
        err=True,
    )


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"python": pyplatform.python_version()}
    for name in ("pagellm", "torch", "transformers", "tokenizers", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _write_json(path: str | None, command: str, config, **sections: Any) -> None:
    if path is None:
        return
    import torch

    report = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "machine": {
            "platform": pyplatform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "config": dataclasses.asdict(config),
        **sections,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(f"wrote {path}")


@click.group()
def bench() -> None:
    """Measure pagellm's speed on the benchmark workloads (W1, W3) and against transformers."""


def _peer_list(values: tuple[str, ...]) -> list[str]:
    peers = [v.strip() for value in values for v in value.split(",") if v.strip()]
    unknown = sorted(set(peers) - {"transformers", "llama.cpp"})
    if unknown:
        raise click.BadParameter(f"unknown peer(s) {', '.join(unknown)}; choose transformers, llama.cpp")
    return peers


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


@bench.command()
@click.option("--workload", type=click.Choice(["W1"]), default="W1", show_default=True)
@workload_options
@click.option(
    "--compare",
    multiple=True,
    help="Also run this peer: transformers, llama.cpp (repeat the option or separate with commas).",
)
@click.option(
    "--peer-batch-sizes",
    default="8,16,64",
    show_default=True,
    help="transformers: static batch sizes; the best one counts.",
)
@click.option(
    "--llama-server",
    default=None,
    help="llama.cpp: the llama-server executable (a path or a name on PATH); without it the peer is skipped.",
)
@click.option(
    "--llama-model",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="llama.cpp: the GGUF to serve. [default: the run's model written as a GGUF in the run's dtype, cached]",
)
@click.option("--llama-slots", default="8,16,32", show_default=True, help="llama.cpp: slot counts to try.")
@click.option(
    "--llama-flash-attn",
    default="on,off",
    show_default=True,
    help="llama.cpp: flash attention settings to try.",
)
@click.option("--llama-args", default="", help="llama.cpp: extra llama-server arguments (one string).")
@click.option(
    "--lora-modules",
    multiple=True,
    help="Also run the requests spread over these LoRA adapters (NAME=PATH, repeatable; turns on "
    "--enable-lora with --max-loras their number), for the cost against the base model.",
)
@click.option(
    "--json-schema",
    default=None,
    help="Also run the same requests constrained to this JSON schema (structured output), for its cost.",
)
@_common_options
def throughput(
    workload,
    num_prompts,
    input_len_min,
    input_len_max,
    output_len_min,
    output_len_max,
    compare,
    peer_batch_sizes,
    llama_server,
    llama_model,
    llama_slots,
    llama_flash_attn,
    llama_args,
    lora_modules,
    json_schema,
    model,
    output_json,
    **options,
) -> None:
    """Offline throughput: all requests queued at once, greedy, EOS ignored."""
    import gc
    import json

    from pagellm.bench.floor import format_floor
    from pagellm.bench.speculation import acceptance, format_acceptance
    from pagellm.bench.throughput import make_llm, run_pagellm, warm_up
    from pagellm.bench.workloads import w1
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling.params import StructuredOutputsParams

    peers = _peer_list(compare)
    flash_attn = [v.strip() for v in llama_flash_attn.split(",") if v.strip()]
    if set(flash_attn) - {"on", "off"}:
        raise click.BadParameter("give on, off or on,off", param_hint="--llama-flash-attn")
    config = _config(model, options)
    adapters = [
        LoRARequest(m.partition("=")[0], i + 1, m.partition("=")[2]) for i, m in enumerate(lora_modules)
    ]
    if adapters:
        config = config.replace(enable_lora=True, max_loras=len(adapters), max_lora_rank=64)
    llm = make_llm(config)
    requests = w1(
        llm.engine.setup.hf_config.vocab_size,
        num_prompts,
        (input_len_min, input_len_max),
        (output_len_min, output_len_max),
    )
    warm_up(llm)
    machine = _llm_machine(llm, options)
    before = llm.engine.stats()
    results = {"pagellm": run_pagellm(llm, requests, machine=machine)}
    _progress(results["pagellm"])
    if adapters:  # the same requests spread over the adapters, for their cost
        llm.reset_prefix_cache()
        name = f"pagellm + {len(adapters)} LoRA adapters"
        results[name] = run_pagellm(llm, requests, name, lora_requests=adapters)
        _progress(results[name])
    if json_schema:  # the same requests under a JSON-schema constraint, for its cost
        schema = StructuredOutputsParams(json=json.loads(json_schema))
        llm.reset_prefix_cache()  # no head start from the first run's prompts
        results["pagellm + JSON schema"] = run_pagellm(
            llm, requests, "pagellm + JSON schema", structured_outputs=schema
        )
        _progress(results["pagellm + JSON schema"])
    dtype, device = llm.engine.setup.dtype, llm.engine.runner.device
    speculation = acceptance(before, llm.engine.stats()) if config.speculative else None
    del llm
    gc.collect()
    if speculation is not None:  # the same run without it, for the speedup
        plain = make_llm(config.replace(speculative_config=None))
        warm_up(plain)
        results["pagellm without speculation"] = run_pagellm(plain, requests)
        results["pagellm without speculation"].engine = "pagellm without speculation"
        _progress(results["pagellm without speculation"])
        del plain
        gc.collect()
    if "transformers" in peers:
        from pagellm.bench.peers import load_transformers_model, run_transformers

        peer_model = load_transformers_model(config.model, config.gguf_file, dtype, device)
        results["transformers"] = run_transformers(
            peer_model, requests, _ints(peer_batch_sizes), on_result=_progress
        )
        del peer_model
        gc.collect()
    skipped = {}
    if "llama.cpp" in peers:
        result, reason = _run_llama_cpp(
            config, requests, dtype, llama_server, llama_model, _ints(llama_slots), flash_attn, llama_args
        )
        if result is None:
            skipped["llama.cpp"] = reason
            click.echo(f"llama.cpp peer skipped: {reason}", err=True)
        else:
            results["llama.cpp"] = result
    rows = {name: _with_floor(r.as_dict()) for name, r in results.items()}
    floor = results["pagellm"].extra["floor"]
    click.echo(_table([*rows.values(), _floor_row(floor, rows["pagellm"])]))
    click.echo(format_floor(floor))
    ratios = {
        name: results["pagellm"].output_tok_s / r.output_tok_s
        for name, r in results.items()
        if name != "pagellm"
    }
    for name, ratio in ratios.items():
        click.echo(f"pagellm / {results[name].engine}: {ratio:.2f}x output tok/s")
    if speculation is not None:
        speculation["speedup"] = ratios["pagellm without speculation"]
        click.echo(format_acceptance(speculation))
    if "llama.cpp" in results:
        by_setting = results["llama.cpp"].extra["output_tok_s_by_setting"]
        click.echo(
            "llama.cpp, every setting: "
            + ", ".join(f"{k.removeprefix('llama.cpp ')} {v:.1f}" for k, v in by_setting.items())
            + " output tok/s"
        )
    for name, reason in skipped.items():
        click.echo(f"{name}: skipped ({reason})")
    _write_json(
        output_json,
        "throughput",
        config,
        workload=requests.describe(),
        results=rows,
        ratio=ratios.get("transformers"),
        ratios=ratios,
        skipped=skipped,
        floor=floor,
        speculation=speculation,
    )


def _run_llama_cpp(config, requests, dtype, binary, gguf, slots, flash_attn, extra_args):
    """The llama.cpp peer's best result, or (None, why it did not run)."""
    import shlex

    import torch

    from pagellm.bench import llama_cpp

    if not binary:
        return (
            None,
            "no llama-server given; pass --llama-server PATH (build it from github.com/ggml-org/llama.cpp)",
        )
    path = llama_cpp.find_binary(binary)
    if path is None:
        return None, f"--llama-server {binary}: not an executable file, nor found on PATH"
    if gguf is None:
        from pagellm.engine.setup import cache_dir

        click.echo("llama.cpp: writing the model as a GGUF in the run's dtype (once; cached) ...", err=True)
        gguf = llama_cpp.gguf_for(config, str(dtype).removeprefix("torch."), cache_dir())
    result = llama_cpp.run_llama_cpp(
        path,
        gguf,
        requests,
        slots,
        flash_attn,
        torch.get_num_threads(),
        shlex.split(extra_args),
        on_result=_progress,
    )
    return result, None


@bench.command()
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--input-len", type=int, default=256, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option(
    "--prompts",
    "prompt_kind",
    type=click.Choice(["random", "copy"]),
    default="random",
    show_default=True,
    help="random: token ids drawn at random (--input-len each); copy: requests to edit a piece of code, "
    "whose answers copy much of the prompt (what n-gram speculation is for; --input-len is ignored).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Then run the batch once more with timing hooks: a decode (and prefill) step split into "
    "attention, linears, lm_head, sampling, other layers and Python, and torch.profiler's top ops.",
)
@_common_options
def latency(batch_size, input_len, output_len, prompt_kind, profile, model, output_json, **options) -> None:
    """Latency of one batch: prefill steps, decode step mean/p50/p99 and end-to-end time, each against its
    floor. With --speculative-config, the same batch runs first without speculation, for the speedup."""
    import gc

    from pagellm.bench.floor import format_floor
    from pagellm.bench.latency import latency_prompts, run_latency
    from pagellm.bench.speculation import acceptance, format_acceptance
    from pagellm.bench.throughput import make_llm, warm_up
    from pagellm.bench.workloads import copy_prompts

    config = _config(model, options)

    def prompts_for(llm):
        return copy_prompts(llm.engine.tokenizer, batch_size) if prompt_kind == "copy" else None

    baseline = None
    if config.speculative is not None:
        click.echo("the batch without speculative decoding first, for the speedup ...", err=True)
        plain = make_llm(config.replace(speculative_config=None))
        warm_up(plain)
        baseline = run_latency(plain, batch_size, input_len, output_len, prompts=prompts_for(plain)).as_dict()
        del plain
        gc.collect()
    llm = make_llm(config)
    warm_up(llm)
    machine = _llm_machine(llm, options)
    before = llm.engine.stats()
    prompts = prompts_for(llm)
    result = run_latency(llm, batch_size, input_len, output_len, machine=machine, prompts=prompts).as_dict()
    batch_size, input_len = result["batch_size"], result["input_len"]
    lines = [
        f"batch {batch_size}, input {input_len}, output {output_len}",
        f"prefill: {result['prefill_steps']} steps, {result['prefill_s'] * 1000:.1f} ms",
        f"decode: {result['decode_steps']} steps, mean {result['decode_step_mean_ms']:.1f} ms, "
        f"p50 {result['decode_step_p50_ms']:.1f} ms, p99 {result['decode_step_p99_ms']:.1f} ms",
        f"end to end: {result['e2e_s']:.2f} s ({result['output_tok_s']:.1f} output tok/s)",
    ]
    floor = result.get("floor", {})
    if "decode" in floor:
        d = floor["decode"]
        n = result["decode_steps"]
        lines.append(
            f"decode step floor: {d['floor_step_ms']:.2f} ms (compute {d['compute_s'] / n * 1000:.2f} ms, "
            f"memory {d['memory_s'] / n * 1000:.2f} ms: weights {d['weight_bytes'] / n / 1e6:.0f} MB + "
            f"KV {d['kv_bytes'] / n / 1e6:.0f} MB per step; {d['bound']}-bound); mean step "
            f"{result['decode_step_mean_ms']:.1f} ms = {d['fraction_of_floor']:.0%} of the floor "
            f"({result['decode_step_mean_ms'] / d['floor_step_ms']:.1f}x it)"
        )
    if "prefill" in floor:
        p = floor["prefill"]
        lines.append(
            f"prefill floor: {p['floor_s'] * 1000:.1f} ms, {p['floor_prompt_tok_s']:.0f} prompt tok/s "
            f"({p['bound']}-bound); measured {result['prefill_tok_s']:.0f} prompt tok/s = "
            f"{p['fraction_of_floor']:.0%} of the floor"
        )
    if "run" in floor:
        lines.append(format_floor(floor["run"], "run floor"))
    sections: dict[str, Any] = {"results": {"pagellm": result}, "floor": floor}
    if baseline is not None:
        report = acceptance(before, llm.engine.stats())
        report["speedup"] = baseline["e2e_s"] / result["e2e_s"]
        lines.append(format_acceptance(report))
        lines.append(
            f"without speculation: {baseline['e2e_s']:.2f} s end to end ({baseline['output_tok_s']:.1f} output "
            f"tok/s); with it {result['e2e_s']:.2f} s: speedup {report['speedup']:.2f}x"
        )
        sections["results"]["pagellm without speculation"] = baseline
        sections["speculation"] = report
    click.echo("\n".join(lines))
    if profile:
        from pagellm.bench.profile import format_profile, profile_latency

        click.echo("profiling: the same batch shape again (new prompts), with timing hooks ...", err=True)
        prompts = latency_prompts(llm.engine.setup.hf_config.vocab_size, batch_size, input_len, seed=1)
        breakdown = profile_latency(llm, prompts, output_len)
        click.echo(format_profile(breakdown))
        if "op_table" in breakdown:
            click.echo(f"top ops over {breakdown['op_table_steps']} decode steps (torch.profiler):")
            click.echo(breakdown["op_table"])
        sections["profile"] = {k: v for k, v in breakdown.items() if k != "op_table"}
    _write_json(output_json, "latency", config, **sections)


@bench.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--prefix-len", type=int, default=1024, show_default=True)
@click.option("--suffix-len", type=int, default=64, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@_common_options
def prefix(num_prompts, prefix_len, suffix_len, output_len, model, output_json, **options) -> None:
    """W3: requests sharing one prefix, with prefix caching on and then off."""
    from pagellm.bench.floor import format_floor
    from pagellm.bench.throughput import run_prefix_comparison
    from pagellm.bench.workloads import w3
    from pagellm.engine.setup import resolve_engine

    peak_tflops, read_gb_s = options.pop("peak_tflops"), options.pop("read_gb_s")
    config = _config(model, options)
    vocab = resolve_engine(config).hf_config.vocab_size
    requests = w3(vocab, num_prompts, prefix_len, suffix_len, output_len)

    def machine(llm):
        return _machine(llm.engine.setup.dtype, llm.engine.runner.device, peak_tflops, read_gb_s)

    results = run_prefix_comparison(config, requests, on_result=_progress, machine=machine)
    rows = [_with_floor(r.as_dict()) for r in results]
    columns = (
        *_COLUMNS,
        ("mean TTFT s", "mean_ttft_s", "{:.3f}"),
        ("hit rate", "prefix_cache_hit_rate", "{:.1%}"),
    )
    click.echo(_table(rows, columns))
    for result in results:
        click.echo(format_floor(result.extra["floor"], f"{result.engine} floor"))
    _write_json(output_json, "prefix", config, workload=requests.describe(), results=rows)


_SERVE_COLUMNS = (
    ("metric", "name", "{}"),
    ("mean", "mean", "{:.1f}"),
    ("p50", "p50", "{:.1f}"),
    ("p99", "p99", "{:.1f}"),
)


@bench.command()
@workload_options
@click.option(
    "--request-rate",
    type=float,
    default=2.0,
    show_default=True,
    help="Poisson arrival rate, requests/s (inf: all at once).",
)
@click.option(
    "--arrival-seed", type=int, default=0, show_default=True, help="Seed of the Poisson arrival times."
)
@click.option(
    "--base-url",
    default=None,
    help="Target this running server (e.g. http://127.0.0.1:8000) instead of starting `pagellm serve`; "
    "--model should name the model it serves (for the prompts' vocabulary and the floor).",
)
@click.option(
    "--server-log",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where the started server logs. [default: a temporary file]",
)
@click.option(
    "--server-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for it."
)
@_common_options
def serve(
    num_prompts,
    input_len_min,
    input_len_max,
    output_len_min,
    output_len_max,
    request_rate,
    arrival_seed,
    base_url,
    server_log,
    server_timeout,
    model,
    output_json,
    **options,
) -> None:
    """W2: the W1 requests as streaming /v1/completions calls with Poisson arrivals, against `pagellm serve`
    started with these engine flags (or --base-url): TTFT, TPOT, ITL, throughput, offered vs served rate."""
    import contextlib

    import torch

    from pagellm.bench import serve as w2
    from pagellm.bench.floor import ModelShape, format_floor
    from pagellm.bench.workloads import w1
    from pagellm.engine.setup import load_hf_config, resolve_model_source

    peak_tflops, read_gb_s = options.pop("peak_tflops"), options.pop("read_gb_s")
    config = _config(model, options)
    hf_config = load_hf_config(resolve_model_source(config))
    requests = w1(
        hf_config.vocab_size, num_prompts, (input_len_min, input_len_max), (output_len_min, output_len_max)
    )
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(config.dtype, torch.bfloat16)
    device = config.device if config.device in ("cpu", "cuda") else "cpu"
    if config.device == "auto" and base_url is None and torch.cuda.is_available():
        device = "cuda"
    server = None
    with contextlib.ExitStack() as stack:
        if base_url is None:
            click.echo("starting pagellm serve ...", err=True)
            server = stack.enter_context(w2.ServerProcess(config, server_log, server_timeout))
            base_url = server.url
            click.echo(f"pagellm serve is up at {base_url} (log: {server.log_path})", err=True)
        name = w2.served_model_name(base_url)
        w2.warm_up(base_url, name)
        machine = _machine(dtype, device, peak_tflops, read_gb_s)
        click.echo(
            f"sending {requests.num_requests} requests at {request_rate:g} req/s (Poisson, seed {arrival_seed}) ...",
            err=True,
        )
        records = w2.send_requests(base_url, name, requests, request_rate, arrival_seed)
        if server is not None and any(r.error for r in records):
            server.temporary_log = False  # keep the server's log: it may say why
    summary = w2.summarize(records, request_rate)
    floor = None
    try:
        shape = ModelShape.from_hf_config(hf_config, dtype)
    except ValueError as exc:
        click.echo(f"no floor: {exc}", err=True)
    else:
        if summary["completed"]:
            floor = w2.serve_floor(shape, records, machine, summary["duration_s"])
            summary["floor"] = floor
    click.echo(_serve_report(summary))
    if floor is not None:
        click.echo(format_floor(floor))
        click.echo(
            "(steps estimated from the client: the fewest consistent with the requests' timing; below "
            "capacity the arrivals, not the server, set the run's length)"
        )
    per_request = [
        {
            "prompt_len": r.prompt_len,
            "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens,
            "sent_s": r.sent_s,
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
            "e2e_s": r.e2e_s,
            "error": r.error,
        }
        for r in records
    ]
    _write_json(
        output_json,
        "serve",
        config,
        workload=requests.describe(),
        base_url=base_url,
        results=summary,
        floor=floor,
        requests=per_request,
    )
    if summary["failed"]:
        raise click.ClickException(f"{summary['failed']} request(s) failed: {'; '.join(summary['errors'])}")


def _serve_report(s: dict[str, Any]) -> str:
    def num(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    lines = [
        f"requests: {s['completed']}/{s['num_requests']} completed in {s['duration_s']:.2f} s"
        + ("" if s["exact_output_lengths"] else " (some output lengths differ from those asked)"),
        f"request rate: offered {num(s['request_rate'], '{:g}')} req/s (realized {num(s['offered_rate'])}), "
        f"served {num(s['served_rate'])} req/s (served/offered {num(s['served_over_offered'], '{:.1%}')}; "
        f"first tokens), mean TTFT by thirds of the run {' / '.join(num(t, '{:.0f}') for t in s['ttft_ms_by_third'])} ms",
        f"completion rate {num(s['completion_rate'])} req/s (with no queue at this run's median TPOT: "
        f"{num(s['completion_rate_without_queue'])})",
        f"request throughput: {num(s['request_throughput'])} req/s; output {num(s['output_tok_s'], '{:.1f}')} "
        f"tok/s; total {num(s['total_tok_s'], '{:.1f}')} tok/s",
    ]
    rows = [
        {"name": title, **s[key]}
        for title, key in (
            ("TTFT ms", "ttft_ms"),
            ("TPOT ms", "tpot_ms"),
            ("ITL ms", "itl_ms"),
            ("E2E ms", "e2e_ms"),
        )
    ]
    return "\n".join([*lines, _table(rows, _SERVE_COLUMNS)])
