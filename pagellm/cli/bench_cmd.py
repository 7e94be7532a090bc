"""`pagellm bench throughput|latency|prefix`: the workloads of shared/bench/README.md from the command line.

Each prints a summary table and can write a JSON file with the engine config, the workload, the results,
the package versions and the date, so runs can be compared later. Runs default to bfloat16, as the
README asks; `--dtype` overrides it.
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
)


def _common_options(command: Callable) -> Callable:
    command = engine_options(skip=("model",))(command)
    command = click.option(
        "--output-json", type=click.Path(dir_okay=False), default=None, help="Write the results here."
    )(command)
    return click.option(
        "--model",
        default="S",
        show_default=True,
        help="S (the embedded SmolLM2-135M), M (random Qwen2 shaped like Qwen2.5-0.5B) or a model path.",
    )(command)


def _config(model: str, options: dict[str, Any]):
    from pagellm.bench.workloads import resolve_model

    return config_from_options(options, model=resolve_model(model), dtype=options.get("dtype") or "bfloat16")


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


@bench.command()
@click.option("--workload", type=click.Choice(["W1"]), default="W1", show_default=True)
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--input-len-min", type=int, default=64, show_default=True)
@click.option("--input-len-max", type=int, default=512, show_default=True)
@click.option("--output-len-min", type=int, default=16, show_default=True)
@click.option("--output-len-max", type=int, default=256, show_default=True)
@click.option("--compare", type=click.Choice(["transformers"]), default=None, help="Also run this peer.")
@click.option(
    "--peer-batch-sizes",
    default="8,16,64",
    show_default=True,
    help="Static batch sizes; the best one counts.",
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
    model,
    output_json,
    **options,
) -> None:
    """Offline throughput: all requests queued at once, greedy, EOS ignored."""
    import gc

    from pagellm.bench.throughput import make_llm, run_pagellm, warm_up
    from pagellm.bench.workloads import w1

    config = _config(model, options)
    llm = make_llm(config)
    requests = w1(
        llm.engine.setup.hf_config.vocab_size,
        num_prompts,
        (input_len_min, input_len_max),
        (output_len_min, output_len_max),
    )
    warm_up(llm)
    results = [run_pagellm(llm, requests)]
    _progress(results[0])
    dtype = llm.engine.setup.dtype
    del llm
    gc.collect()
    ratio = None
    if compare == "transformers":
        from pagellm.bench.peers import load_transformers_model, run_transformers

        peer_model = load_transformers_model(config.model, config.gguf_file, dtype)
        sizes = [int(s) for s in peer_batch_sizes.split(",") if s.strip()]
        results.append(run_transformers(peer_model, requests, sizes, on_result=_progress))
        ratio = results[0].output_tok_s / results[1].output_tok_s
    rows = [r.as_dict() for r in results]
    click.echo(_table(rows))
    if ratio is not None:
        click.echo(f"pagellm / {results[1].engine}: {ratio:.2f}x output tok/s")
    _write_json(
        output_json,
        "throughput",
        config,
        workload=requests.describe(),
        results={"pagellm": rows[0], **({"transformers": rows[1]} if ratio is not None else {})},
        ratio=ratio,
    )


@bench.command()
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--input-len", type=int, default=256, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@_common_options
def latency(batch_size, input_len, output_len, model, output_json, **options) -> None:
    """Latency of one batch: prefill steps, decode step mean/p50/p99 and end-to-end time."""
    from pagellm.bench.latency import run_latency
    from pagellm.bench.throughput import make_llm, warm_up

    config = _config(model, options)
    llm = make_llm(config)
    warm_up(llm)
    result = run_latency(llm, batch_size, input_len, output_len).as_dict()
    click.echo(
        f"batch {batch_size}, input {input_len}, output {output_len}\n"
        f"prefill: {result['prefill_steps']} steps, {result['prefill_s'] * 1000:.1f} ms\n"
        f"decode: {result['decode_steps']} steps, mean {result['decode_step_mean_ms']:.1f} ms, "
        f"p50 {result['decode_step_p50_ms']:.1f} ms, p99 {result['decode_step_p99_ms']:.1f} ms\n"
        f"end to end: {result['e2e_s']:.2f} s ({result['output_tok_s']:.1f} output tok/s)"
    )
    _write_json(output_json, "latency", config, results={"pagellm": result})


@bench.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--prefix-len", type=int, default=1024, show_default=True)
@click.option("--suffix-len", type=int, default=64, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@_common_options
def prefix(num_prompts, prefix_len, suffix_len, output_len, model, output_json, **options) -> None:
    """W3: requests sharing one prefix, with prefix caching on and then off."""
    from pagellm.bench.throughput import run_prefix_comparison
    from pagellm.bench.workloads import w3
    from pagellm.engine.setup import resolve_engine

    config = _config(model, options)
    vocab = resolve_engine(config).hf_config.vocab_size
    requests = w3(vocab, num_prompts, prefix_len, suffix_len, output_len)
    rows = [r.as_dict() for r in run_prefix_comparison(config, requests, on_result=_progress)]
    columns = (
        *_COLUMNS,
        ("mean TTFT s", "mean_ttft_s", "{:.3f}"),
        ("hit rate", "prefix_cache_hit_rate", "{:.1%}"),
    )
    click.echo(_table(rows, columns))
    _write_json(output_json, "prefix", config, workload=requests.describe(), results=rows)
