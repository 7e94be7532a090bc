"""`pagellm bench throughput|latency|prefix|images|serve|soak`: the workloads of shared/bench/README.md from the
command line.

Each command declares its options and hands them to its `pagellm.bench.<command>.main`, which runs it,
prints a summary table and its floor (pagellm.bench.floor), and can write a JSON report.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from collections.abc import Callable
from typing import Any

import click

from pagellm.bench import images as images_bench
from pagellm.bench import latency as latency_bench
from pagellm.bench import prefix as prefix_bench
from pagellm.bench import serve as serve_bench
from pagellm.bench import soak as soak_bench
from pagellm.bench import throughput as throughput_bench
from pagellm.bench.common import BenchArgs
from pagellm.cli.options import (
    comma_choices,
    comma_ints,
    engine_options,
    json_object,
    name_path_pairs,
)


def _common_options(command: Callable, default_model: str = "S") -> Callable:
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
        default=default_model,
        show_default=True,
        help="S (the embedded SmolLM2-135M), M (random Qwen2 shaped like Qwen2.5-0.5B), E (random Qwen3-MoE "
        "shaped like a small Qwen3-30B-A3B), H (random Qwen3.5 text hybrid: Gated DeltaNet and attention), "
        "M-gemma3 (M's sizes in Gemma 3's layout), V (random LLaVA of a tiny width, for images) or a model "
        "path.",
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


def bench_args(cls: type[BenchArgs], params: dict[str, Any]) -> Any:
    """`cls` from a bench command's parameters: each of its fields from the parameter of the same name, and
    the engine options in its `engine`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(
        **{k: v for k, v in params.items() if k in names},
        engine={k: v for k, v in params.items() if k not in names},
    )


def server_options(base_url_help: str, log_default: str) -> Callable[[Callable], Callable]:
    """--base-url, --server-log and --server-timeout: a bench command that starts `pagellm serve` or targets
    one already running."""

    def decorate(command: Callable) -> Callable:
        command = click.option(
            "--server-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for it."
        )(command)
        command = click.option(
            "--server-log",
            type=click.Path(dir_okay=False),
            default=None,
            help=f"Where the started server logs. [default: {log_default}]",
        )(command)
        return click.option("--base-url", default=None, help=base_url_help)(command)

    return decorate


@click.group()
def bench() -> None:
    """Measure pagellm's speed on the benchmark workloads (W1, W3) and against transformers."""


@bench.command()
@click.option("--workload", type=click.Choice(["W1"]), default="W1", show_default=True)
@workload_options
@click.option(
    "--compare",
    multiple=True,
    callback=comma_choices("peer", "transformers", "llama.cpp"),
    help="Also run this peer: transformers, llama.cpp (repeat the option or separate with commas).",
)
@click.option(
    "--peer-batch-sizes",
    default="8,16,64",
    show_default=True,
    callback=comma_ints,
    help="transformers: static batch sizes; the best one counts.",
)
@click.option(
    "--peer-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="transformers: load it in this dtype (its fastest on a CPU without bfloat16 instructions is "
    "float32). [default: the run's dtype]",
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
    help="llama.cpp: the GGUF to serve. [default: --model's own GGUF where pagellm runs it as it is "
    "(--quantization gguf, or matrices in the run's dtype), else the run's model written as a GGUF in the "
    "run's dtype, cached]",
)
@click.option(
    "--llama-slots",
    default="8,16,32",
    show_default=True,
    callback=comma_ints,
    help="llama.cpp: slot counts to try.",
)
@click.option(
    "--llama-flash-attn",
    default="on,off",
    show_default=True,
    callback=comma_choices("setting", "on", "off"),
    help="llama.cpp: flash attention settings to try.",
)
@click.option(
    "--llama-args",
    default="",
    callback=lambda ctx, param, value: tuple(shlex.split(value)),
    help="llama.cpp: extra llama-server arguments (one string).",
)
@click.option(
    "--lora-modules",
    multiple=True,
    callback=name_path_pairs,
    help="Also run the requests spread over these LoRA adapters (NAME=PATH, repeatable; turns on "
    "--enable-lora with --max-loras their number), for the cost against the base model.",
)
@click.option(
    "--json-schema",
    default=None,
    callback=json_object,
    help="Also run the same requests constrained to this JSON schema (structured output), for its cost.",
)
@_common_options
def throughput(**params) -> None:
    """Offline throughput: all requests queued at once, greedy, EOS ignored."""
    throughput_bench.main(bench_args(throughput_bench.ThroughputArgs, params))


@bench.command()
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--input-len", type=int, default=256, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option(
    "--prompts",
    "prompt_kind",
    type=click.Choice(["random", "copy", "chat"]),
    default="random",
    show_default=True,
    help="random: token ids drawn at random (--input-len each); copy: requests to edit a piece of code, "
    "whose answers copy much of the prompt (what n-gram speculation is for); chat: a chat user's questions "
    "drawn with a fixed seed (what an EAGLE-3 head is measured on). copy and chat ignore --input-len.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run this many batches one after another, each with its own prompts (random: the next seed; "
    "chat: the next questions), and report the steps of all: a sample of more than one batch's prompts "
    "(what speculative decoding's acceptance varies with).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Then run the batch once more with timing hooks: a decode (and prefill) step split into "
    "attention, linears, lm_head, sampling, other layers and Python, and torch.profiler's top ops.",
)
@click.option(
    "--compare",
    multiple=True,
    callback=comma_choices("peer", "llama.cpp"),
    help="Also run llama.cpp's own benchmark on the same batch shape and GGUF: llama-bench for batch 1, "
    "llama-batched-bench (beside llama-bench) for larger batches.",
)
@click.option(
    "--llama-bench",
    default=None,
    help="llama.cpp: the llama-bench executable (a path or a name on PATH); --compare llama.cpp needs it.",
)
@click.option(
    "--llama-model",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="llama.cpp: the GGUF to run. [default: as for bench throughput's --llama-model]",
)
@click.option(
    "--llama-args",
    default="",
    callback=lambda ctx, param, value: tuple(shlex.split(value)),
    help="llama.cpp: extra llama-bench (or llama-batched-bench) arguments (one string).",
)
@_common_options
def latency(**params) -> None:
    """Latency of one batch: prefill steps, decode step mean/p50/p99 and end-to-end time, each against its
    floor. With --speculative-config, the same batch runs first without speculation, for the speedup. With
    --compare llama.cpp, llama.cpp's decode step and prefill rate on the same shape, and the ratios."""
    latency_bench.main(bench_args(latency_bench.LatencyArgs, params))


@bench.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option(
    "--compare",
    multiple=True,
    callback=comma_choices("peer", "transformers"),
    help="Also run transformers' generate on the same requests.",
)
@click.option(
    "--peer-batch-sizes",
    default="1,8",
    show_default=True,
    callback=comma_ints,
    help="transformers: static batch sizes (1: one request at a time).",
)
@functools.partial(_common_options, default_model="V")
def images(**params) -> None:
    """I1: one image and a W1-like text per request on a vision-language model (default V), all queued at
    once: requests/s, TTFT and the vision encoder's share of step time."""
    images_bench.main(bench_args(images_bench.ImagesArgs, params))


@bench.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--prefix-len", type=int, default=1024, show_default=True)
@click.option("--suffix-len", type=int, default=64, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@_common_options
def prefix(**params) -> None:
    """W3: requests sharing one prefix, with prefix caching on and then off."""
    prefix_bench.main(bench_args(prefix_bench.PrefixArgs, params))


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
@server_options(
    "Target this running server (e.g. http://127.0.0.1:8000) instead of starting `pagellm serve`; --model "
    "should name the model it serves (for the prompts' vocabulary and the floor).",
    "a temporary file",
)
@_common_options
def serve(**params) -> None:
    """W2: the W1 requests as streaming /v1/completions calls with Poisson arrivals, against `pagellm serve`
    started with these engine flags (or --base-url): TTFT, TPOT, ITL, throughput, offered vs served rate."""
    serve_bench.main(bench_args(serve_bench.ServeArgs, params))


@bench.command()
@click.option("--duration", type=float, default=600.0, show_default=True, help="Seconds of load.")
@click.option(
    "--request-rate",
    type=float,
    default=None,
    help="Poisson arrival rate, requests/s. [default: --overload times the rate calibration measures]",
)
@click.option("--overload", type=float, default=1.5, show_default=True, help="Offered over served rate.")
@click.option("--calibration-s", type=float, default=30.0, show_default=True, help="Calibration's length.")
@click.option(
    "--calibration-concurrency",
    type=int,
    default=64,
    show_default=True,
    help="Clients sending back to back during calibration.",
)
@click.option(
    "--warmup-s",
    type=float,
    default=None,
    help="The memory check's reference: resident memory this long into the load. [default: a fifth of "
    "--duration, at most 60]",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="After the load, the open requests run to their end unless none ends for this many seconds.",
)
@click.option("--sample-interval", type=float, default=5.0, show_default=True, help="Seconds per sample.")
@click.option("--traffic-seed", type=int, default=0, show_default=True, help="Seed of the traffic mix.")
@click.option("--output-len-min", type=int, default=16, show_default=True, help="Fewest max_tokens.")
@click.option("--output-len-max", type=int, default=128, show_default=True, help="Most max_tokens.")
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the samples here (time, rss_mib, running, waiting, kv_usage, completed, ttft_p50_ms, ...).",
)
@server_options(
    "Target this running server instead of starting `pagellm serve` (its memory is then not measured; it "
    "should serve 2 LoRA adapters and bound its queue).",
    "a temporary file, kept when a check fails",
)
@engine_options(skip=("model",))
@click.option(
    "--output-json",
    "--output",
    "output_json",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the results here.",
)
@click.option("--model", default="S", show_default=True, help="S, M, ... or a model path (as `bench serve`).")
def soak(**params) -> None:
    """Mixed traffic with faults at --overload times what the server serves, for --duration s, then a
    drain: prints memory and throughput over time and PASS/FAIL per check (nothing held, memory flat,
    no 5xx but 503, every request answered once); exits non-zero when a check fails."""
    soak_bench.main(bench_args(soak_bench.SoakArgs, params))
