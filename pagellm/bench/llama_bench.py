"""The llama.cpp peer of `pagellm bench latency`: llama.cpp's own benchmark tools on the same GGUF.

Batch 1: `llama-bench -m GGUF -p IN -n OUT -d 0,IN -b 2048 -ub 512 -t THREADS -o json`. Its JSON is one
record per test: a prompt test (n_prompt = IN, n_gen = 0) and a generation test (n_prompt = 0, n_gen = OUT)
at each depth. The prefill is the prompt test at depth 0 (prompt tok/s = its avg_ts); the decode step is the
generation test at depth IN (the prompt's tokens already in the KV cache, as in pagellm's decode steps), its
mean time per token = avg_ns / n_gen. 2048 / 512 are llama-bench's own -b / -ub defaults, given so the
command says them; llama-bench repeats each test (-r, 5 by default) after a warm-up.

Batch > 1: llama-bench runs one sequence, so `llama-batched-bench` (found beside llama-bench) runs BATCH
independent sequences: `-npp IN -ntg OUT -npl BATCH --output-format jsonl`, one run. Its line gives the
prompt phase's tokens/s (speed_pp, over all BATCH x IN tokens) and the generation phase's time t_tg over
OUT steps of BATCH tokens each, so a decode step is t_tg / OUT. shared/bench/build_llamacpp.sh does not
build it; without it the peer is skipped for batch > 1 and the report says why.

The GGUF (`gguf_for_latency`): --llama-model if given, else the one `bench throughput` gives llama.cpp
(pagellm.bench.llama_cpp.gguf_for).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagellm.bench.common import echo, peer_exit

LLAMA_BENCH_BATCH = 2048
"""llama-bench's default -b (logical batch): a prompt of up to this many tokens is one decode call."""

LLAMA_BENCH_UBATCH = 512
"""llama-bench's default -ub (physical batch); pagellm's CPU token budget is 512 too."""

BATCHED_BENCH = "llama-batched-bench"


def bench_command(
    binary: str, gguf: str, input_len: int, output_len: int, threads: int, extra_args: Sequence[str] = ()
) -> list[str]:
    """llama-bench on one sequence: prompt tests at depth 0 and IN, generation tests at both depths."""
    command = [binary, "-m", gguf, "-p", str(input_len), "-n", str(output_len), "-d", f"0,{input_len}"]
    command += ["-b", str(LLAMA_BENCH_BATCH), "-ub", str(LLAMA_BENCH_UBATCH), "-t", str(threads)]
    return [*command, "-o", "json", *extra_args]


def batched_command(
    binary: str,
    gguf: str,
    batch_size: int,
    input_len: int,
    output_len: int,
    threads: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """llama-batched-bench on `batch_size` independent sequences, with a context that holds them all."""
    ctx = -(-batch_size * (input_len + output_len) // 256) * 256
    command = [binary, "-m", gguf, "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(batch_size)]
    command += ["-c", str(ctx), "-b", str(LLAMA_BENCH_BATCH), "-ub", str(LLAMA_BENCH_UBATCH)]
    command += ["-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    return [*command, *extra_args]


def batched_bench_beside(llama_bench: str) -> str | None:
    """The llama-batched-bench executable in llama-bench's folder, or None."""
    path = Path(llama_bench).with_name(BATCHED_BENCH)
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def unavailable(llama_bench: str, batch_size: int) -> str | None:
    """Why llama.cpp cannot run this batch size here, or None."""
    if batch_size == 1 or batched_bench_beside(llama_bench) is not None:
        return None
    return (
        f"batch {batch_size}: llama-bench runs one sequence, and there is no {BATCHED_BENCH} beside "
        f"{llama_bench} to run a batch of them; build it with cmake --build build --target {BATCHED_BENCH}"
    )


def parse_bench_json(text: str, input_len: int, output_len: int) -> dict[str, Any]:
    """The prefill and decode numbers from llama-bench's `-o json` output (a list of test records; what
    follows the list is ignored)."""
    start = text.find("[")
    records = json.JSONDecoder().raw_decode(text, start)[0] if start >= 0 else []

    def find(n_prompt: int, n_gen: int, depths: Sequence[int]) -> dict[str, Any] | None:
        for depth in depths:  # the first depth that has a record
            for r in records:
                if (r.get("n_prompt"), r.get("n_gen"), r.get("n_depth", 0)) == (n_prompt, n_gen, depth):
                    return r
        return None

    pp = find(input_len, 0, [0])
    tg = find(0, output_len, [input_len, 0])  # a llama-bench without -d has only depth 0
    if pp is None or tg is None:
        raise ValueError(
            f"llama-bench's JSON has no pp{input_len} and tg{output_len} records: "
            f"{[(r.get('n_prompt'), r.get('n_gen'), r.get('n_depth')) for r in records]}"
        )
    step_ms = tg["avg_ns"] / tg["n_gen"] / 1e6 if tg.get("avg_ns") else 1000 / tg["avg_ts"]
    return {
        "decode_step_mean_ms": step_ms,
        "decode_tok_s": tg["avg_ts"],
        "decode_tok_s_stddev": tg.get("stddev_ts"),
        "decode_depth": tg.get("n_depth", 0),
        "prefill_tok_s": pp["avg_ts"],
        "prefill_tok_s_stddev": pp.get("stddev_ts"),
        "repetitions": len(tg.get("samples_ts") or []) or None,
        "records": records,
    }


def parse_batched_jsonl(text: str, batch_size: int, input_len: int, output_len: int) -> dict[str, Any]:
    """The prefill and decode numbers from llama-batched-bench's `--output-format jsonl` line."""
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and "speed_tg" in line):
            continue
        r = json.loads(line)
        if (r.get("pp"), r.get("tg"), r.get("pl")) == (input_len, output_len, batch_size):
            return {
                "decode_step_mean_ms": r["t_tg"] / output_len * 1000,
                "decode_tok_s": r["speed_tg"],
                "prefill_tok_s": r["speed_pp"],
                "repetitions": 1,
                "records": [r],
            }
    raise ValueError(
        f"llama-batched-bench printed no result for pp {input_len}, tg {output_len}, pl {batch_size} "
        "(a context too small for the batch is skipped silently)"
    )


def _run(command: list[str]) -> tuple[tuple[str, str] | None, str]:
    """(stdout, stderr), or None and why not."""
    name = os.path.basename(command[0])
    echo(f"llama.cpp: {shlex.join(command)}", err=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        return None, f"{name} did not start: {exc}"
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return None, f"{peer_exit(name, done.returncode, '--repack 0')}: {tail}"
    return (done.stdout, done.stderr), ""


def run_llama_bench(
    binary: str,
    gguf: str,
    batch_size: int,
    input_len: int,
    output_len: int,
    threads: int,
    extra_args: Sequence[str] = (),
) -> tuple[dict[str, Any] | None, str | None]:
    """llama.cpp's decode step and prefill rate for this batch shape, or (None, why it did not run)."""
    why = unavailable(binary, batch_size)
    if why is not None:
        return None, why
    if batch_size == 1:
        tool = os.path.basename(binary)
        command = bench_command(binary, gguf, input_len, output_len, threads, extra_args)
    else:
        tool = BATCHED_BENCH
        batched = str(batched_bench_beside(binary))
        command = batched_command(batched, gguf, batch_size, input_len, output_len, threads, extra_args)
    output, why = _run(command)
    if output is None:
        return None, why
    stdout, stderr = output
    try:
        if batch_size == 1:
            numbers = parse_bench_json(stdout, input_len, output_len)
        else:  # its results are log lines: on stdout, but stderr is read too
            numbers = parse_batched_jsonl(stdout + "\n" + stderr, batch_size, input_len, output_len)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return None, f"{tool}'s output not understood: {exc}"
    result = {
        "engine": "llama.cpp",
        "tool": tool,
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "threads": threads,
        "gguf": gguf,
        "command": command,
        **numbers,
    }
    return result, None


def gguf_for_latency(config: Any, llama_model: str | None, dtype_name: str, cache_root: str) -> str:
    """The GGUF llama.cpp runs: `llama_model`, else what `bench throughput` gives llama.cpp
    (pagellm.bench.llama_cpp.gguf_for: --model's own file where pagellm runs it as it is, else converted)."""
    if llama_model:
        return llama_model
    from pagellm.bench.llama_cpp import gguf_for

    return gguf_for(config, dtype_name, cache_root)
