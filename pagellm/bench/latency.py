"""Latency of one batch: every engine step timed, split into prefill steps and decode steps.

A step counts as prefill while some request of the batch has not produced its first token yet; once all
have, every further step is a decode step. With a `Machine`, each phase gets its floor: the work of the
steps the engine ran in it (pagellm.bench.floor) against the measured matmul peak and read bandwidth.
`main` is `pagellm bench latency`; with `--compare llama.cpp` it runs llama.cpp's own benchmark on the same
batch shape and GGUF (pagellm.bench.llama_bench) and prints its decode step and prefill rate beside pagellm's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from pagellm.bench import llama_bench
from pagellm.bench.common import BenchArgs, echo, table, write_json
from pagellm.bench.floor import Machine, format_floor
from pagellm.bench.profile import format_profile, profile_latency
from pagellm.bench.speculation import acceptance, format_acceptance
from pagellm.bench.steps import StepRecord, StepRecorder
from pagellm.bench.throughput import floor_report, make_llm, warm_up
from pagellm.bench.workloads import chat_prompts, copy_prompts
from pagellm.core.errors import ConfigError
from pagellm.engine.llm import LLM
from pagellm.engine.setup import cache_dir
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
    # the tokens the decode steps gave, all requests together (more than one a step and request with
    # speculative decoding); None: one a step and request
    decode_tokens: int | None = None
    rounds: int = 1  # batches run one after another (new prompts each), the steps of all of them

    def as_dict(self) -> dict[str, Any]:
        decode_ms = np.array(self.decode_step_s or [float("nan")]) * 1000
        steps = len(self.decode_step_s)
        tokens = self.decode_tokens if self.decode_tokens is not None else steps * self.batch_size
        prefill_s = sum(self.prefill_step_s)
        out = {
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "prefill_steps": len(self.prefill_step_s),
            "prefill_s": prefill_s,
            "rounds": self.rounds,
            "prefill_tok_s": self.rounds * self.batch_size * self.input_len / prefill_s
            if prefill_s
            else None,
            "decode_steps": len(self.decode_step_s),
            "decode_step_mean_ms": float(decode_ms.mean()),
            "decode_step_p50_ms": float(np.percentile(decode_ms, 50)),
            "decode_step_p99_ms": float(np.percentile(decode_ms, 99)),
            # a request's time per token in the decode steps (the step where each decodes one): what
            # llama.cpp's generation step is compared with
            "decode_ms_per_token": float(decode_ms.mean()) * steps * self.batch_size / tokens
            if tokens
            else float("nan"),
            "decode_tokens": tokens,
            "e2e_s": self.e2e_s,
            "output_tok_s": self.rounds * self.batch_size * self.output_len / self.e2e_s,
        }
        if self.floor:
            out["floor"] = self.floor
        return out


def latency_prompts(vocab_size: int, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return rng.randint(100, vocab_size - 100, size=(batch_size, input_len)).tolist()


def run_batch(
    llm: LLM, prompts: list[list[int]], output_len: int
) -> tuple[list[StepRecord], list[bool], float, int]:
    """Queue the prompts, each generating `output_len`, and step the engine until all finish.

    Returns the recorded steps, whether each was a decode step (every request has its first token), the
    end-to-end time, and the tokens the decode steps gave."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    is_decode: list[bool] = []
    with StepRecorder(engine) as recorder:
        start = time.perf_counter()
        ids = {engine.add_request({"prompt_token_ids": p}, params) for p in prompts}
        started: set[str] = set()
        tokens: dict[str, int] = {}  # each request's output tokens so far
        before_decode = 0  # all requests' when every one had started
        while engine.has_unfinished_requests():
            decoding = started == ids
            outputs = engine.step()
            is_decode += [decoding] * (len(recorder.steps) - len(is_decode))
            tokens.update((o.request_id, len(o.outputs[0].token_ids)) for o in outputs)
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
            if not decoding and started == ids:
                before_decode = sum(tokens.values())
        e2e = time.perf_counter() - start
    return recorder.steps, is_decode, e2e, len(prompts) * output_len - before_decode


def run_latency(
    llm: LLM,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    machine: Machine | None = None,
    prompts: list[list[int]] | None = None,
    rounds: int = 1,
) -> LatencyResult:
    """Queue `batch_size` random prompts of `input_len` tokens (or the `prompts` given, `rounds` batches of
    them; `input_len` is then their mean length), each generating `output_len`, and step the engine until
    all finish; `rounds` times, one batch after another (random prompts of seeds `seed`, `seed` + 1, ...);
    with `machine`, the floor of each phase and of the whole run."""
    if prompts is None:
        vocab = llm.engine.setup.hf_config.vocab_size
        prompts = [p for r in range(rounds) for p in latency_prompts(vocab, batch_size, input_len, seed + r)]
    else:
        batch_size, input_len = len(prompts) // rounds, round(sum(map(len, prompts)) / len(prompts))
    steps, is_decode, e2e, decode_tokens = [], [], 0.0, 0
    for r in range(rounds):
        batch = run_batch(llm, prompts[r * batch_size : (r + 1) * batch_size], output_len)
        steps += batch[0]
        is_decode += batch[1]
        e2e += batch[2]
        decode_tokens += batch[3]
    prefill = [s for s, d in zip(steps, is_decode, strict=True) if not d]
    decode = [s for s, d in zip(steps, is_decode, strict=True) if d]
    result = LatencyResult(
        batch_size,
        input_len,
        output_len,
        [s.seconds for s in prefill],
        [s.seconds for s in decode],
        e2e,
        decode_tokens=decode_tokens,
        rounds=rounds,
    )
    if machine is not None:
        result.floor["run"] = floor_report(llm, steps, machine, e2e, rounds * batch_size * output_len)
        if prefill:
            prefill_s = sum(s.seconds for s in prefill)
            report = floor_report(llm, prefill, machine, prefill_s)
            report["floor_prompt_tok_s"] = rounds * batch_size * input_len / report["floor_s"]
            result.floor["prefill"] = report
        if decode:
            report = floor_report(
                llm, decode, machine, sum(s.seconds for s in decode), len(decode) * batch_size
            )
            report["floor_step_ms"] = report["floor_s"] / len(decode) * 1000
            report["floor_step_ms_stepwise"] = report["floor_s_stepwise"] / len(decode) * 1000
            result.floor["decode"] = report
    return result


# -- `pagellm bench latency` ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LatencyArgs(BenchArgs):
    """`pagellm bench latency`: one batch's shape, its prompts, and whether to profile it."""

    batch_size: int = 8
    input_len: int = 256
    output_len: int = 64
    # copy: requests to edit code; chat: a chat user's questions (both ignore --input-len)
    prompt_kind: Literal["random", "copy", "chat"] = "random"
    rounds: int = 1  # batches one after another, each its own prompts (copy: its instructions in turn)
    profile: bool = False  # then the batch once more with timing hooks and torch.profiler
    compare: Sequence[str] = ()  # peers: "llama.cpp"
    llama_bench: str | None = None  # llama.cpp: the llama-bench executable (a path or a name on PATH)
    llama_model: str | None = None  # llama.cpp: the GGUF; None: --model if a GGUF, else it written as one
    llama_args: Sequence[str] = ()  # llama.cpp: extra llama-bench (llama-batched-bench) arguments


def main(args: LatencyArgs) -> dict[str, Any]:
    """Latency of one batch: prefill steps, decode step mean/p50/p99 and end-to-end time, each against its
    floor; with speculative decoding, the same batch first without it, for the speedup. Prints the
    summary, writes `args.output_json`, and returns the report's sections."""
    llama_binary = _llama_bench_binary(args) if "llama.cpp" in args.compare else None
    config = args.engine_config()
    batch_size, input_len, output_len = args.batch_size, args.input_len, args.output_len
    llama_skipped = llama_bench.unavailable(llama_binary, batch_size) if llama_binary else None
    if llama_skipped:
        echo(f"llama.cpp peer will be skipped: {llama_skipped}", err=True)

    def prompts_for(llm):
        kinds = {"copy": copy_prompts, "chat": chat_prompts}
        make = kinds.get(args.prompt_kind)
        return make(llm.engine.tokenizer, batch_size * args.rounds) if make is not None else None

    baseline = None
    if config.speculative is not None:
        echo("the batch without speculative decoding first, for the speedup ...", err=True)
        plain = make_llm(config.replace(speculative_config=None))
        warm_up(plain)
        baseline = run_latency(
            plain, batch_size, input_len, output_len, prompts=prompts_for(plain), rounds=args.rounds
        ).as_dict()
        del plain
        gc.collect()
    llm = make_llm(config)
    warm_up(llm)
    machine = args.llm_machine(llm)
    before = llm.engine.stats()
    prompts = prompts_for(llm)
    result = run_latency(
        llm, batch_size, input_len, output_len, machine=machine, prompts=prompts, rounds=args.rounds
    ).as_dict()
    batch_size, input_len = result["batch_size"], result["input_len"]
    lines = _summary(result)
    floor = result.get("floor", {})
    sections: dict[str, Any] = {"results": {"pagellm": result}, "floor": floor}
    if baseline is not None:
        report = acceptance(before, llm.engine.stats())
        lines += _speculation_lines(report, baseline, result)
        sections["results"]["pagellm without speculation"] = baseline
        sections["speculation"] = report
    echo("\n".join(lines))
    if args.profile:
        echo("profiling: the same batch shape again (new prompts), with timing hooks ...", err=True)
        prompts = latency_prompts(llm.engine.setup.hf_config.vocab_size, batch_size, input_len, seed=1)
        breakdown = profile_latency(llm, prompts, output_len)
        echo(format_profile(breakdown))
        if "op_table" in breakdown:
            echo(f"top ops over {breakdown['op_table_steps']} decode steps (torch.profiler):")
            echo(breakdown["op_table"])
        sections["profile"] = {k: v for k, v in breakdown.items() if k != "op_table"}
    if llama_skipped:
        sections["skipped"] = {"llama.cpp": llama_skipped}
        echo(f"llama.cpp: skipped ({llama_skipped})")
    elif llama_binary is not None:
        dtype_name = str(llm.engine.setup.dtype).removeprefix("torch.")
        del llm  # its memory back before the peer runs
        gc.collect()
        gguf = llama_bench.gguf_for_latency(config, args.llama_model, dtype_name, str(cache_dir()))
        peer, why = llama_bench.run_llama_bench(
            llama_binary, gguf, batch_size, input_len, output_len, torch.get_num_threads(), args.llama_args
        )
        if peer is None:
            sections["skipped"] = {"llama.cpp": why}
            echo(f"llama.cpp: skipped ({why})")
        else:
            sections["results"]["llama.cpp"] = peer
            sections["ratios"] = {"llama.cpp": _ratios(result, peer)}
            echo("\n".join(_peer_lines(result, peer, sections["ratios"]["llama.cpp"])))
    write_json(args.output_json, "latency", config, **sections)
    return sections


def _speculation_lines(report: dict[str, Any], baseline: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """The acceptance and the speedups over the same batch without speculation (into `report`)."""
    report["speedup"] = baseline["e2e_s"] / result["e2e_s"]
    report["decode_speedup"] = baseline["decode_ms_per_token"] / result["decode_ms_per_token"]
    return [
        format_acceptance(report),
        f"without speculation: {baseline['e2e_s']:.2f} s end to end ({baseline['output_tok_s']:.1f} output "
        f"tok/s); with it {result['e2e_s']:.2f} s: speedup {report['speedup']:.2f}x; decode per token of a "
        f"request {baseline['decode_ms_per_token']:.2f} ms without, {result['decode_ms_per_token']:.2f} ms "
        f"with: {report['decode_speedup']:.2f}x",
    ]


def _llama_bench_binary(args: LatencyArgs) -> str:
    """The llama-bench to run, checked before anything else runs."""
    from pagellm.bench.llama_cpp import find_binary

    if not args.llama_bench:
        raise ConfigError(
            "--compare llama.cpp needs --llama-bench PATH (llama.cpp's llama-bench; build it from "
            "github.com/ggml-org/llama.cpp, e.g. with shared/bench/build_llamacpp.sh)"
        )
    path = find_binary(args.llama_bench)
    if path is None:
        raise ConfigError(f"--llama-bench {args.llama_bench}: not an executable file, nor found on PATH")
    return path


def _ratios(result: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """Both above 1 where pagellm is faster: llama.cpp's step over pagellm's, pagellm's prefill rate over
    llama.cpp's."""
    prefill = result["prefill_tok_s"]
    return {
        "decode_step": peer["decode_step_mean_ms"] / result["decode_ms_per_token"],
        "prefill_tok_s": prefill / peer["prefill_tok_s"] if prefill else None,
    }


PEER_COLUMNS = (
    ("engine", "engine", "{}"),
    ("decode step mean ms", "decode_step_mean_ms", "{:.2f}"),
    ("p50 ms", "decode_step_p50_ms", "{:.2f}"),
    ("p99 ms", "decode_step_p99_ms", "{:.2f}"),
    ("prefill tok/s", "prefill_tok_s", "{:.1f}"),
)


def _peer_lines(result: dict[str, Any], peer: dict[str, Any], ratios: dict[str, float | None]) -> list[str]:
    """pagellm's and llama.cpp's numbers side by side, and the ratios."""
    runs = "one run" if peer["repetitions"] == 1 else f"mean of {peer['repetitions'] or '?'} runs"
    rows = [{**result, "engine": "pagellm"}, {**peer, "engine": f"llama.cpp ({peer['tool']}, {runs})"}]
    lines = [table(rows, PEER_COLUMNS)]
    speculating = result["decode_ms_per_token"] != result["decode_step_mean_ms"]
    lines.append(
        f"decode step{', per token of a request (several a step with the drafts)' if speculating else ''}: "
        f"llama.cpp {peer['decode_step_mean_ms']:.2f} ms / pagellm {result['decode_ms_per_token']:.2f} ms = "
        f"{ratios['decode_step']:.2f}x (above 1: pagellm is faster)"
    )
    if ratios["prefill_tok_s"] is not None:
        lines.append(
            f"prefill: pagellm {result['prefill_tok_s']:.1f} / llama.cpp {peer['prefill_tok_s']:.1f} prompt "
            f"tok/s = {ratios['prefill_tok_s']:.2f}x (above 1: pagellm is faster)"
        )
    lines.append(f"llama.cpp ran {peer['gguf']}")
    return lines


def _summary(result: dict[str, Any]) -> list[str]:
    """The lines that report a `LatencyResult.as_dict()`: the batch, its steps and their floors."""
    lines = [
        f"batch {result['batch_size']}, input {result['input_len']}, output {result['output_len']}"
        + (f", {result['rounds']} batches one after another" if result["rounds"] > 1 else ""),
        f"prefill: {result['prefill_steps']} steps, {result['prefill_s'] * 1000:.1f} ms",
        f"decode: {result['decode_steps']} steps, mean {result['decode_step_mean_ms']:.1f} ms, "
        f"p50 {result['decode_step_p50_ms']:.1f} ms, p99 {result['decode_step_p99_ms']:.1f} ms",
        f"end to end: {result['e2e_s']:.2f} s ({result['output_tok_s']:.1f} output tok/s)",
    ]
    if result["decode_ms_per_token"] != result["decode_step_mean_ms"]:
        lines.insert(
            3,
            f"decode per token of a request: {result['decode_ms_per_token']:.2f} ms "
            f"({result['decode_tokens']} tokens in {result['decode_steps']} steps)",
        )
    floor = result.get("floor", {})
    if "decode" in floor:
        d = floor["decode"]
        n = result["decode_steps"]
        experts = (
            f"experts {d['expert_bytes'] / n / 1e6:.0f} MB (expected picks) + " if d["expert_bytes"] else ""
        )
        state = f" + recurrent state {d['state_bytes'] / n / 1e6:.0f} MB" if d.get("state_bytes") else ""
        lines.append(
            f"decode step floor: {d['floor_step_ms']:.2f} ms (compute {d['compute_s'] / n * 1000:.2f} ms, "
            f"memory {d['memory_s'] / n * 1000:.2f} ms: weights {d['weight_bytes'] / n / 1e6:.0f} MB + "
            f"{experts}KV {d['kv_bytes'] / n / 1e6:.0f} MB{state} per step; {d['bound']}-bound); mean step "
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
    return lines
