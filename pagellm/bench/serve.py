"""W2 (online serving): the W1 requests sent to a pagellm server as streaming /v1/completions calls with
Poisson arrivals, measured from the client: TTFT, TPOT, inter-token latency, throughput, and whether the
server kept up with the offered rate.

Prompts go as token ids, with max_tokens = min_tokens = the request's output length and ignore_eos, so
every request generates exactly its output length (the usage chunk at the end of each stream counts it).

Definitions (all times from the client):
- TTFT: from sending a request to its first streamed token chunk.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1).
- ITL: the gaps between consecutive token chunks of a request, over all requests.
- request throughput: completed requests / duration (first send to last completion).
- offered rate: the arrival rate asked for, and the realized one ((n - 1) / span of the send times).
- served rate: the same estimator over the times requests got their first token. That is when a
  request leaves the queue for the running batch, so a server that keeps up serves as fast as requests
  arrive, and one that does not falls further behind with each request (its TTFT grows along the run:
  `ttft_ms_by_third` shows the trend).
- completion rate: the same estimator over completion times. It reads low even with no queue at all,
  because the last requests' own decoding stretches the span: `completion_rate_without_queue` is what a
  server with no queue would read, each request taking its TTFT plus its tokens at the run's median TPOT.

`main` is `pagellm bench serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagellm.bench.common import W1Args, echo, table, write_json
from pagellm.bench.floor import (
    Floor,
    Machine,
    ModelShape,
    format_floor,
    min_steps_for_intervals,
    workload_work,
)
from pagellm.bench.process import LoggedProcess, quiet_httpx
from pagellm.bench.workloads import Workload
from pagellm.core.config import EngineConfig
from pagellm.core.errors import PagellmError
from pagellm.engine.setup import load_hf_config, resolve_model_source


def poisson_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s, from the start) of a Poisson process at `rate` requests/s: the first request at 0,
    then exponential gaps drawn from RandomState(seed). An infinite rate sends everything at 0."""
    if num_requests == 0:
        return []
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.RandomState(seed).exponential(1.0 / rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass
class RequestRecord:
    prompt_len: int
    max_tokens: int
    offset_s: float  # when it was due to be sent, from the start
    sent_s: float = 0.0  # when it was sent, from the start
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    done_s: float | None = None  # when its stream ended
    output_tokens: int = 0  # the usage chunk's completion_tokens (else: chunks counted)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and self.output_tokens > 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return np.diff(self.chunk_s).tolist() if len(self.chunk_s) > 1 else []


def completion_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _send(client: Any, url: str, body: dict[str, Any], record: RequestRecord, t0: float) -> None:
    await asyncio.sleep(max(0.0, record.offset_s - (time.perf_counter() - t0)))
    record.sent_s = time.perf_counter() - t0
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))
                    break
                if event.get("choices"):
                    record.chunk_s.append(time.perf_counter() - t0)
                    chunks += 1
                if event.get("usage"):
                    record.output_tokens = int(event["usage"]["completion_tokens"])
        record.done_s = time.perf_counter() - t0
        if not record.output_tokens:
            record.output_tokens = chunks
    except Exception as exc:  # a failed request is reported, not fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"


async def _run(base_url: str, model: str, workload: Workload, offsets: list[float]) -> list[RequestRecord]:
    import httpx

    quiet_httpx()
    url = base_url.rstrip("/") + "/v1/completions"
    records = [
        RequestRecord(len(p), n, offset)
        for p, n, offset in zip(workload.prompts, workload.output_lens, offsets, strict=True)
    ]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                _send(client, url, completion_body(model, p, n), r, t0)
                for p, n, r in zip(workload.prompts, workload.output_lens, records, strict=True)
            )
        )
    return records


def send_requests(
    base_url: str, model: str, workload: Workload, rate: float, seed: int = 0
) -> list[RequestRecord]:
    """Send every request of `workload` at its Poisson arrival time; wait for all to finish."""
    offsets = poisson_offsets(workload.num_requests, rate, seed)
    return asyncio.run(_run(base_url, model, workload, offsets))


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def _rate(times: list[float]) -> float | None:
    times = sorted(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else None


def summarize(records: list[RequestRecord], rate: float) -> dict[str, Any]:
    """Throughput, latency statistics (ms) and rates of a finished run."""
    done = [r for r in records if r.ok]
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.done_s for r in done), default=start)
    duration = end - start
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    per = lambda metric: [v for v in (metric(r) for r in done) if v is not None]  # noqa: E731
    offered = _rate([r.sent_s for r in records])
    started = sorted((r for r in done if r.ttft_s is not None), key=lambda r: r.sent_s)
    served = _rate([r.sent_s + r.ttft_s for r in started])
    median_tpot = float(np.median(per(lambda r: r.tpot_s) or [0.0]))
    without_queue = [r.sent_s + r.ttft_s + (r.output_tokens - 1) * median_tpot for r in started]
    thirds = np.array_split(np.array([r.ttft_s * 1000 for r in started]), 3)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "exact_output_lengths": all(r.output_tokens == r.max_tokens for r in done),
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_tok_s": output_tokens / duration if duration > 0 else None,
        "total_tok_s": (input_tokens + output_tokens) / duration if duration > 0 else None,
        "request_rate": rate,
        "offered_rate": offered,
        "served_rate": served,
        "served_over_offered": served / offered if served and offered else None,
        "completion_rate": _rate([r.done_s for r in done]),
        "completion_rate_without_queue": _rate(without_queue),
        "ttft_ms_by_third": [float(part.mean()) if len(part) else None for part in thirds],
        "ttft_ms": _stats(per(lambda r: r.ttft_s)),
        "tpot_ms": _stats(per(lambda r: r.tpot_s)),
        "itl_ms": _stats([gap for r in done for gap in r.itl_s]),
        "e2e_ms": _stats(per(lambda r: r.e2e_s)),
    }


# -- the server ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args(config: EngineConfig) -> list[str]:
    """The `pagellm serve` flags that give `config` (settings left at their defaults are not passed)."""
    args: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


class ServerProcess(LoggedProcess):
    """`pagellm serve` with the bench's engine config, on a free localhost port, logging to a file."""

    tail_lines = 30

    def __init__(
        self,
        config: EngineConfig,
        log_path: str | None = None,
        start_timeout_s: float = 600.0,
        extra_args: Sequence[str] = (),
    ):
        """`extra_args`: more `pagellm serve` flags (those that are not engine settings, e.g. --lora-modules)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.temporary_log = log_path is None  # removed after a clean run
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="pagellm-bench-serve-", suffix=".log")
            os.close(fd)
        command = [sys.executable, "-m", "pagellm.cli", "--log-level", "INFO", "serve"]
        command += ["--port", str(self.port), "--disable-log-requests", *engine_args(config), *extra_args]
        super().__init__(command, log_path)
        self.wait_healthy(self.url, start_timeout_s)

    def start_failure(self, timeout_s: float) -> str:
        if self.process.poll() is not None:
            why = f"exited with {self.process.returncode}"
        else:
            why = f"did not answer /health within {timeout_s:.0f} s"
        return f"pagellm serve {why}; its log ({self.log_path}):\n{self.log_tail()}"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop()
        if exc_type is None and self.temporary_log:
            os.remove(self.log_path)


def served_model_name(base_url: str) -> str:
    """The first model a running server lists at /v1/models (its default name)."""
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def warm_up(base_url: str, model: str) -> None:
    """One short request, so one-time costs stay out of the run (token ids 1-16, below the workloads')."""
    body = completion_body(model, list(range(1, 17)), 4)
    records = asyncio.run(_run(base_url, model, Workload("warm-up", [body["prompt"]], [4]), [0.0]))
    if records[0].error:
        raise RuntimeError(f"the warm-up request failed: {records[0].error}")


def serve_floor(
    shape: ModelShape, records: list[RequestRecord], machine: Machine, duration_s: float
) -> dict[str, Any]:
    """The floor of the served work: every completed request's FLOPs and KV reads, and the weights once
    per step, with the steps estimated from the client side as the fewest consistent with the requests'
    [sent, done] intervals (requests that do not overlap in time cannot share a step)."""
    done = [r for r in records if r.ok]
    steps = min_steps_for_intervals([(r.sent_s, r.done_s, r.output_tokens) for r in done])
    work = workload_work(shape, [r.prompt_len for r in done], [r.output_tokens for r in done], steps)
    report = Floor(work, machine, extra={"steps_estimated": True}).report(
        duration_s, sum(r.output_tokens for r in done)
    )
    return report


# -- `pagellm bench serve` --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ServeArgs(W1Args):
    """`pagellm bench serve`: the arrivals, and the server (started with the engine settings, or given)."""

    request_rate: float = 2.0  # Poisson arrival rate, requests/s (inf: all at once)
    arrival_seed: int = 0
    base_url: str | None = None  # target this running server instead of starting `pagellm serve`
    server_log: str | None = None  # where the started server logs; None: a temporary file
    server_timeout: float = 600.0  # seconds to wait for it


class RequestsFailed(PagellmError):
    """Some requests of a `pagellm bench serve` run failed; `summary` is the run's summary."""

    def __init__(self, summary: dict[str, Any]):
        super().__init__(f"{summary['failed']} request(s) failed: {'; '.join(summary['errors'])}")
        self.summary = summary


_COLUMNS = (
    ("metric", "name", "{}"),
    ("mean", "mean", "{:.1f}"),
    ("p50", "p50", "{:.1f}"),
    ("p99", "p99", "{:.1f}"),
)


def main(args: ServeArgs) -> dict[str, Any]:
    """W2: the W1 requests as streaming /v1/completions calls with Poisson arrivals, against `pagellm serve`
    started with the engine settings (or `args.base_url`). Prints the summary and the floor, writes
    `args.output_json`, and returns the report's sections; raises RequestsFailed (after writing the report)
    if any request failed."""
    config = args.engine_config()
    hf_config = load_hf_config(resolve_model_source(config))
    requests = args.w1(hf_config.vocab_size)
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(config.dtype, torch.bfloat16)
    device = config.device if config.device in ("cpu", "cuda") else "cpu"
    base_url = args.base_url
    if config.device == "auto" and base_url is None and torch.cuda.is_available():
        device = "cuda"
    server = None
    with contextlib.ExitStack() as stack:
        if base_url is None:
            echo("starting pagellm serve ...", err=True)
            server = stack.enter_context(ServerProcess(config, args.server_log, args.server_timeout))
            base_url = server.url
            echo(f"pagellm serve is up at {base_url} (log: {server.log_path})", err=True)
        name = served_model_name(base_url)
        warm_up(base_url, name)
        machine = args.machine(dtype, device)
        echo(
            f"sending {requests.num_requests} requests at {args.request_rate:g} req/s (Poisson, seed "
            f"{args.arrival_seed}) ...",
            err=True,
        )
        records = send_requests(base_url, name, requests, args.request_rate, args.arrival_seed)
        if server is not None and any(r.error for r in records):
            server.temporary_log = False  # keep the server's log: it may say why
    summary = summarize(records, args.request_rate)
    floor = None
    try:
        shape = ModelShape.from_hf_config(hf_config, dtype)
    except ValueError as exc:
        echo(f"no floor: {exc}", err=True)
    else:
        if summary["completed"]:
            floor = serve_floor(shape, records, machine, summary["duration_s"])
            summary["floor"] = floor
    echo(format_summary(summary))
    if floor is not None:
        echo(format_floor(floor))
        echo(
            "(steps estimated from the client: the fewest consistent with the requests' timing; below "
            "capacity the arrivals, not the server, set the run's length)"
        )
    sections = {
        "workload": requests.describe(),
        "base_url": base_url,
        "results": summary,
        "floor": floor,
        "requests": [
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
        ],
    }
    write_json(args.output_json, "serve", config, **sections)
    if summary["failed"]:
        raise RequestsFailed(summary)
    return sections


def format_summary(s: dict[str, Any]) -> str:
    """`summarize`'s result as text: requests, rates, throughput, and a table of TTFT, TPOT, ITL and E2E."""

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
    return "\n".join([*lines, table(rows, _COLUMNS)])
