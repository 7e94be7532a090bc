"""`pagellm bench soak`: mixed traffic at more than the server can serve, with faults, for a long time; then
a drain, and checks that the server let go of everything and answered every request it accepted once.

The server (`pagellm serve`, started here unless `--base-url` names one) runs with prefix caching, n-gram
speculative decoding, two LoRA adapters made here (random PEFT weights for the model's architecture,
seeded) and a queue bound (`--max-waiting-requests`), so overload answers 503.

The run:
1. Calibration (unless `--request-rate` is given): `--calibration-concurrency` clients send valid traffic
   back to back for `--calibration-s`; the completions per second are what the server serves.
2. Load: Poisson arrivals at `--overload` times that rate (or at `--request-rate`) for `--duration` s, the
   kinds drawn per request from `--traffic-seed` (`Mix`): streaming or not, chat or completions, n = 2, a
   JSON schema (`response_format`, one of 1000 variants: clients send their own), tool calls (`tools` +
   `tool_choice`), one of the adapters, one of a few long shared prefixes; 10% of streams closed by the
   client after a few events, 5% malformed bodies (must get 400) and 1% prompts past max_model_len (must
   get 400).
3. Drain: no more requests; the open ones run to their end, as long as one ends at least every
   `--drain-timeout` s (a server over its capacity holds hundreds: draining takes minutes, a stall does
   not), then the server must be idle.

Every `--sample-interval` s a sample: /metrics (running, waiting, KV usage, the LoRA and grammar gauges),
the server's resident memory (its process and its children, e.g. the engine process), how long /metrics took
to answer, and the client's counts, throughput and TTFT over the last interval; `--csv` writes them, and a
table shows them.

Warm-up, for the memory check: the first `--warmup-s` s of the load (default: a fifth of it, at most 60 s).
The memory check passes when the resident memory after the drain is at most 5% above the memory at the end
of the warm-up (less is no leak).

`kv_cache_usage_perc` counts the blocks requests hold: a block only the prefix cache keeps is free
(`BlockPool.num_free_blocks` counts the cached free blocks), so after the drain it must be 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import itertools
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.bench.common import BenchArgs, cpu_features, cpu_line, echo, table, write_json
from pagellm.bench.process import quiet_httpx
from pagellm.bench.serve import ServerProcess
from pagellm.core.config import EngineConfig
from pagellm.core.errors import PagellmError
from pagellm.engine.setup import load_hf_config, resolve_model_source

MEMORY_TOLERANCE = 0.05  # resident memory after the drain: at most this much above the warm-up's
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MAX_WAITING = 64  # --max-waiting-requests when not given
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIXES = 3  # distinct long shared prefixes

WORDS = (
    "the a of and to in is was for on that with as by at from it his an were are which this be or had not "
    "but first one their its new after who they two her she been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made"
).split()

SCHEMA_VARIANTS = 1000  # clients send schemas of their own: each variant is another grammar to compile


def schema(variant: int) -> dict[str, Any]:
    """The JSON schema of `response_format` requests, one of SCHEMA_VARIANTS."""
    return {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", f"c{variant}"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    }


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


# -- the traffic -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """The fraction of requests of each kind; each is drawn independently per request."""

    malformed: float = 0.05  # a body that is not JSON, or has fields of the wrong type: must get 400
    huge: float = 0.01  # a prompt past max_model_len: must get 400
    stream: float = 0.6
    drop: float = 0.10  # of the streams: the client closes them after a few events
    chat: float = 0.5  # else /v1/completions
    n2: float = 0.1  # n = 2
    json_schema: float = 0.1  # response_format json_schema
    tools: float = 0.1  # of chat requests: tools with tool_choice "required" or a named function
    lora: float = 0.3  # under one of the adapters (evenly)
    shared_prefix: float = 0.4  # starts with one of PREFIXES long prefixes


@dataclass(frozen=True)
class Planned:
    """One request of the run, as drawn."""

    index: int
    kind: str  # valid, malformed or huge
    chat: bool
    stream: bool = False
    drop_after: int | None = None  # a stream the client closes after this many events with choices
    n: int = 1
    structured: str | None = None  # json_schema or tools
    adapter: int | None = None  # index of the adapter, None: the base model
    prefix: int | None = None  # index of the shared prefix
    own_chars: int = 0  # length of the request's own text
    max_tokens: int = 16
    seed: int = 0  # of the request's own text and of a malformed body

    @property
    def label(self) -> str:
        """What the request was, for the counts by kind."""
        if self.kind != "valid":
            return self.kind
        parts = ["chat" if self.chat else "completions"]
        if self.stream:
            parts.append("stream")
        if self.structured:
            parts.append(self.structured)
        return " ".join(parts)


def plan_requests(
    seed: int, mix: Mix, num_adapters: int, own_chars: tuple[int, int], max_tokens: tuple[int, int]
) -> Iterator[Planned]:
    """The run's requests, drawn one after another from `seed` (endless)."""
    rng = random.Random(seed)
    for index in itertools.count():
        chat = rng.random() < mix.chat
        roll = rng.random()
        seed_i = rng.randrange(2**31)
        if roll < mix.malformed:
            yield Planned(index, "malformed", chat, seed=seed_i)
            continue
        if roll < mix.malformed + mix.huge:
            yield Planned(index, "huge", chat, seed=seed_i)
            continue
        stream = rng.random() < mix.stream
        drop_after = rng.randint(1, 3) if stream and rng.random() < mix.drop else None
        structured_roll = rng.random()
        structured = None
        if structured_roll < mix.json_schema:
            structured = "json_schema"
        elif chat and structured_roll < mix.json_schema + mix.tools:
            structured = "tools"
        adapter = rng.randrange(num_adapters) if num_adapters and rng.random() < mix.lora else None
        prefix = rng.randrange(PREFIXES) if rng.random() < mix.shared_prefix else None
        yield Planned(
            index,
            "valid",
            chat,
            stream=stream,
            drop_after=drop_after,
            n=2 if rng.random() < mix.n2 else 1,
            structured=structured,
            adapter=adapter,
            prefix=prefix,
            own_chars=rng.randint(*own_chars),
            max_tokens=rng.randint(*max_tokens),
            seed=seed_i,
        )


def text_of(chars: int, seed: int) -> str:
    """About `chars` characters of words drawn from `seed` (ASCII: a byte-level tokenizer gives at most one
    token per character, so `chars` bounds the tokens)."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


@dataclass(frozen=True)
class Target:
    """The server as the requests need it: its model names and context length."""

    base_url: str
    model: str
    adapters: tuple[str, ...]
    max_model_len: int
    prefixes: tuple[str, ...] = ()

    def body(self, plan: Planned) -> bytes:
        """The request's body (JSON, unless it is a malformed one)."""
        if plan.kind == "malformed":
            return malformed_body(plan, self.model)
        model = self.model if plan.adapter is None else self.adapters[plan.adapter]
        if plan.kind == "huge":
            if plan.chat:
                content = "hello " * (2 * self.max_model_len)
                return _json({"model": model, "messages": [{"role": "user", "content": content}]})
            return _json({"model": model, "prompt": [100] * (self.max_model_len + 8), "max_tokens": 4})
        own = text_of(plan.own_chars, plan.seed)
        prefix = self.prefixes[plan.prefix] if plan.prefix is not None else None
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": plan.max_tokens,
            "n": plan.n,
            "temperature": 0.8,
            "seed": plan.seed,
            "stream": plan.stream,
        }
        if plan.stream:
            body["stream_options"] = {"include_usage": True}
        if plan.chat:
            messages = [{"role": "system", "content": prefix}] if prefix else []
            body["messages"] = [*messages, {"role": "user", "content": own}]
        else:
            body["prompt"] = f"{prefix} {own}" if prefix else own
        if plan.structured == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema(plan.seed % SCHEMA_VARIANTS)},
            }
        elif plan.structured == "tools":
            body["tools"] = TOOLS
            body["tool_choice"] = (
                "required" if plan.seed % 2 else {"type": "function", "function": {"name": "get_weather"}}
            )
        return _json(body)

    def path(self, plan: Planned) -> str:
        return "/v1/chat/completions" if plan.chat else "/v1/completions"


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def malformed_body(plan: Planned, model: str) -> bytes:
    """A body its endpoint must refuse with 400: broken JSON, or a field of the wrong type."""
    broken = [b'{"model": "' + model.encode() + b'", "stream": tr', b"[1, 2, 3]"]
    if plan.chat:
        user = [{"role": "user", "content": "hi"}]
        wrong = [
            {"model": model, "messages": "hello"},
            {"model": model, "messages": user, "n": "two"},
            {"model": model, "messages": user, "max_tokens": "lots"},
            {"model": model, "messages": [{"role": "user", "content": {"text": "hi"}}]},
        ]
    else:
        wrong = [
            {"model": model, "prompt": "hi", "max_tokens": "lots"},
            {"model": model, "prompt": "hi", "temperature": "hot"},
            {"model": model, "prompt": {"text": "hi"}},
            {"model": model, "prompt": "hi", "stream": [1]},
        ]
    cases = broken + [_json(body) for body in wrong]
    return cases[plan.seed % len(cases)]


# -- one request's outcome -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the client saw of one request."""

    plan: Planned
    sent_s: float = 0.0  # from the start of the run
    status: int | None = None  # None: no HTTP answer (the connection failed, or still open at the end)
    retry_after: bool = False  # a Retry-After header came
    first_s: float | None = None  # the first stream event with choices
    done_s: float | None = None
    dropped: bool = False  # the client closed the stream before its end
    finishes: Counter = field(default_factory=Counter)  # choice index -> finish_reasons seen
    done_events: int = 0  # `data: [DONE]` lines
    events_after_done: int = 0
    answers: int = 0  # non-streaming: JSON answers with choices
    choices: int = 0  # non-streaming: choices with a finish_reason
    output_tokens: int = 0
    error: str | None = None  # an exception, or an error event in the stream

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


# categories of `judge`
ANSWERED, DROPPED, REJECTED, REFUSED = "answered", "dropped", "rejected", "refused"


def judge(o: Outcome) -> tuple[str, str | None]:
    """(category, problem): answered, dropped (by the client), rejected (a valid request's 503 for overload,
    with Retry-After), refused (400 for a malformed or huge request), or "failed" with what was wrong."""
    plan = o.plan
    if plan.kind != "valid":  # never runnable: 400 even when the queue is full (a 503 would be retried)
        if o.status == 400:
            return REFUSED, None
        return "failed", f"a {plan.kind} request got {o.status or o.error}, not 400"
    if o.status == 503:
        return (REJECTED, None) if o.retry_after else ("failed", "503 without Retry-After")
    if o.status != 200:
        return "failed", f"HTTP {o.status}: {o.error}" if o.status else f"no answer: {o.error}"
    if o.error is not None:
        return "failed", f"error after 200: {o.error}"
    if o.dropped:
        return DROPPED, None
    if plan.stream:
        wanted = Counter({i: 1 for i in range(plan.n)})
        if o.finishes != wanted:
            return "failed", f"finish_reasons by choice {dict(o.finishes)}, not one per choice of {plan.n}"
        if o.done_events != 1 or o.events_after_done:
            return "failed", f"{o.done_events} [DONE] and {o.events_after_done} events after it"
        return ANSWERED, None
    if o.answers != 1 or o.choices != plan.n:
        return "failed", f"{o.answers} answers with {o.choices} finished choices, not 1 with {plan.n}"
    return ANSWERED, None


async def drain(tasks: Sequence[asyncio.Task], stall_s: float) -> set[asyncio.Task]:
    """Wait for `tasks` while they make progress; the ones still open when none ended for `stall_s`."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        done, pending = await asyncio.wait(pending, timeout=stall_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
    return pending


async def send(client: Any, target: Target, plan: Planned, o: Outcome, t0: float) -> None:
    """Send one request and record what came back in `o` (never raises, but for cancellation)."""
    url = target.base_url + target.path(plan)
    o.sent_s = time.perf_counter() - t0
    headers = {"content-type": "application/json"}
    try:
        async with client.stream("POST", url, content=target.body(plan), headers=headers) as response:
            o.status = response.status_code
            o.retry_after = "retry-after" in response.headers
            if response.status_code != 200:
                o.error = (await response.aread()).decode(errors="replace")[:200]
            elif plan.stream:
                await _read_stream(response, plan, o, t0)
            else:
                answer = json.loads(await response.aread())
                o.answers += bool(answer.get("choices"))
                o.choices = sum(c.get("finish_reason") is not None for c in answer.get("choices", []))
                o.output_tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
        o.done_s = time.perf_counter() - t0
    except Exception as exc:  # the run goes on; `judge` reports it
        o.error = f"{type(exc).__name__}: {exc}"


async def _read_stream(response: Any, plan: Planned, o: Outcome, t0: float) -> None:
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if o.done_events:
            o.events_after_done += 1
        if data == "[DONE]":
            o.done_events += 1
            continue
        event = json.loads(data)
        if "error" in event:
            o.error = str(event["error"].get("message", event["error"]))[:200]
            continue
        if event.get("usage"):
            o.output_tokens = int(event["usage"].get("completion_tokens") or 0)
        for choice in event.get("choices") or ():
            if choice.get("finish_reason") is not None:
                o.finishes[choice.get("index", 0)] += 1
        if event.get("choices"):
            events += 1
            if o.first_s is None:
                o.first_s = time.perf_counter() - t0
            if plan.drop_after is not None and events >= plan.drop_after and not o.finishes:
                o.dropped = True  # leaving the `stream` block closes the connection
                return


# -- the run's accounting --------------------------------------------------------------------------------------


def tally(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by category, the problems found, and the rejected and refused requests by kind."""
    categories: Counter = Counter()
    problems: list[str] = []
    by_kind: dict[str, Counter] = {REJECTED: Counter(), REFUSED: Counter()}
    for o in outcomes:
        category, problem = judge(o)
        categories[category] += 1
        if problem:
            problems.append(f"#{o.plan.index} ({o.plan.label}): {problem}")
        if category in by_kind:
            by_kind[category][o.plan.label] += 1
    return {
        "counts": dict(categories),
        "accepted": sum(o.status == 200 for o in outcomes),  # the server took them: each must finish once
        "problems": problems,
        "rejected_by_kind": dict(by_kind[REJECTED]),
        "refused_by_kind": dict(by_kind[REFUSED]),
        "server_errors": sum(o.status is not None and o.status >= 500 and o.status != 503 for o in outcomes),
    }


def cross_check(client: dict[str, Any], server_finished: dict[str, float]) -> str | None:
    """None when the server's finished requests (pagellm:request_success by reason, over the run) agree
    with the client: as many as it accepted (200), none failed with an error, and no more aborted than the
    client dropped (a dropped stream the server finished before it noticed counts as stop or length)."""
    total = sum(server_finished.values())
    aborted = server_finished.get("abort", 0)
    dropped = client["counts"].get(DROPPED, 0)
    if total != client["accepted"]:
        return f"the server finished {total:g} requests, the client had {client['accepted']} accepted"
    if server_finished.get("error", 0):
        return f"the server failed {server_finished['error']:g} requests"
    if aborted > dropped:
        return f"the server aborted {aborted:g} requests, the client dropped only {dropped}"
    return None


def memory_check(warm_mib: float | None, after_mib: float | None) -> tuple[bool | None, str]:
    """(passed, detail): the resident memory after the drain at most MEMORY_TOLERANCE above the warm-up's;
    None when either was not measured."""
    if warm_mib is None or after_mib is None:
        return None, "not measured"
    change = after_mib / warm_mib - 1
    detail = f"{warm_mib:.0f} MiB after warm-up, {after_mib:.0f} MiB after the drain ({change:+.1%})"
    return change <= MEMORY_TOLERANCE, detail


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    a = np.asarray(values) * 1000
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


# -- the server's side: /metrics and memory -------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name or name{label="value"} (labels but model_name): value}, samples of the same
    key summed."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        kept = [part for part in labels.rstrip("}").split(",") if part and not part.startswith("model_name=")]
        key = f"{name}{{{','.join(kept)}}}" if kept else name
        values[key] = values.get(key, 0.0) + float(value)
    return values


def finished_by_reason(values: dict[str, float]) -> dict[str, float]:
    prefix = 'pagellm:request_success_total{finished_reason="'
    return {k[len(prefix) : -2]: v for k, v in values.items() if k.startswith(prefix)}


class Memory:
    """The resident memory of a process and its children (the engine process), in MiB."""

    def __init__(self, pid: int):
        import psutil

        self.process = psutil.Process(pid)

    def rss_mib(self) -> float:
        import psutil

        total = 0
        for p in [self.process, *self.process.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total / 2**20


# -- samples over time ---------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "time_s",
    "phase",
    "rss_mib",
    "running",
    "waiting",
    "kv_usage",
    "lora_requests_running",
    "grammar_matchers_live",
    "preemptions",
    "sent",
    "completed",
    "rejected",
    "failed",
    "completed_per_s",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "metrics_ms",
)


class Progress:
    """The client's side as the run goes: requests sent, and those that ended in the order they ended, with
    running counts by `judge`'s category, so a sample reads only the last interval's."""

    def __init__(self) -> None:
        self.sent = 0
        self.ended: list[Outcome] = []
        self.categories: Counter = Counter()

    def end(self, o: Outcome) -> None:
        self.ended.append(o)
        self.categories[judge(o)[0]] += 1

    def since(self, start: float) -> list[Outcome]:
        """Those that ended after `start` (s from the start of the run)."""
        recent = []
        for o in reversed(self.ended):
            if (o.done_s if o.done_s is not None else float("inf")) <= start:
                break
            recent.append(o)
        return recent


def sample_row(
    now: float, phase: str, metrics: dict[str, float], rss: float | None, progress: Progress, window: float
) -> dict[str, Any]:
    """One sample: the server's gauges, its memory, and the client's counts (all so far), and the rates and
    TTFT of the requests answered in the last `window` s."""
    recent = [o for o in progress.since(now - window) if judge(o)[0] == ANSWERED]
    ttfts = [o.ttft_s for o in recent if o.ttft_s is not None]
    return {
        "time_s": round(now, 1),
        "phase": phase,
        "rss_mib": None if rss is None else round(rss, 1),
        "running": metrics.get("pagellm:num_requests_running"),
        "waiting": metrics.get("pagellm:num_requests_waiting"),
        "kv_usage": metrics.get("pagellm:kv_cache_usage_perc"),
        "lora_requests_running": metrics.get("pagellm:lora_requests_running"),
        "grammar_matchers_live": metrics.get("pagellm:grammar_matchers_live"),
        "preemptions": metrics.get("pagellm:num_preemptions_total"),  # since the server started
        "sent": progress.sent,
        "completed": progress.categories[ANSWERED],
        "rejected": progress.categories[REJECTED],
        "failed": progress.categories["failed"],
        "completed_per_s": len(recent) / window,
        "output_tok_s": sum(o.output_tokens for o in recent) / window,
        **{f"ttft_{k}_ms": v for k, v in percentiles(ttfts).items()},
    }


_TABLE = (
    ("time s", "time_s", "{:.0f}"),
    ("phase", "phase", "{}"),
    ("RSS MiB", "rss_mib", "{:.0f}"),
    ("running", "running", "{:.0f}"),
    ("waiting", "waiting", "{:.0f}"),
    ("KV use", "kv_usage", "{:.0%}"),
    ("preempted", "preemptions", "{:.0f}"),
    ("done", "completed", "{}"),
    ("503", "rejected", "{}"),
    ("req/s", "completed_per_s", "{:.2f}"),
    ("out tok/s", "output_tok_s", "{:.0f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("/metrics ms", "metrics_ms", "{:.0f}"),
)


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


# -- LoRA adapters -------------------------------------------------------------------------------------------


def make_adapters(model_source: Any, out: Path, count: int = 2, seed: int = 0) -> list[Path]:
    """`count` random PEFT LoRA adapters (rank LORA_RANK) for the model's architecture, seeded: made on a
    randomly initialised copy of the model (an adapter's weights depend only on the shapes)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(model_source)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in names]
    paths = []
    for i in range(count):
        torch.manual_seed(seed + 1 + i)
        config = LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=targets, init_lora_weights=False
        )
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        paths.append(out / f"adapter-{i}")
        peft_model.save_pretrained(paths[-1])
        model = peft_model.unload()  # the base model again, for the next adapter
    return paths


# -- `pagellm bench soak` --------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SoakArgs(BenchArgs):
    """`pagellm bench soak`: the load, the traffic, and the server (started, or given)."""

    duration: float = 600.0  # seconds of load
    request_rate: float | None = None  # requests/s; None: --overload times the calibrated rate
    overload: float = 1.5
    calibration_s: float = 30.0
    calibration_concurrency: int = 64
    warmup_s: float | None = None  # None: a fifth of the duration, at most 60 s
    drain_timeout: float = 120.0
    sample_interval: float = 5.0
    traffic_seed: int = 0
    output_len_min: int = 16
    output_len_max: int = 128
    csv_path: str | None = None
    base_url: str | None = None
    server_log: str | None = None
    server_timeout: float = 600.0

    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration / 5)


class SoakFailed(PagellmError):
    """Some checks of a soak failed."""


def soak_config(config: EngineConfig, given: Mapping[str, Any]) -> EngineConfig:
    """The started server's engine: n-gram speculation, LoRA with 2 slots and a queue bound, unless the
    command line set them."""
    defaults = {
        "speculative_config": json.dumps(NGRAM),
        "enable_lora": True,
        "max_loras": 2,
        "max_waiting_requests": MAX_WAITING,
    }
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if given.get(k) is None})


def discover(base_url: str) -> Target:
    """The served model, its adapters (models with a parent) and max_model_len, from /v1/models."""
    import httpx

    models = httpx.get(base_url + "/v1/models", timeout=30).json()["data"]
    base = next(m for m in models if not m.get("parent"))
    adapters = tuple(m["id"] for m in models if m.get("parent"))[:2]
    return Target(base_url, base["id"], adapters, int(base["max_model_len"]))


def with_prefixes(target: Target, max_tokens: int, seed: int) -> tuple[Target, tuple[int, int]]:
    """The target with its shared prefixes, and the range of the requests' own text lengths, within the
    context: prefix + own text + max_tokens + a chat template's tokens fit max_model_len."""
    budget = target.max_model_len - max_tokens - 64
    if budget < 32:
        raise PagellmError(f"max_model_len {target.max_model_len} leaves no room for prompts")
    prefix_chars = min(2000, budget // 2)
    own = (min(32, budget // 4), min(800, budget - prefix_chars))
    prefixes = tuple(text_of(prefix_chars, seed * 1000 + i) for i in range(PREFIXES))
    return dataclasses.replace(target, prefixes=prefixes), own


async def _calibrate(client: Any, target: Target, plans: Iterator[Planned], args: SoakArgs) -> float:
    """Requests/s the server completes with `calibration_concurrency` clients sending valid traffic back to
    back (no drops) for `calibration_s`."""
    t0 = time.perf_counter()
    done: list[float] = []

    async def worker() -> None:
        while time.perf_counter() - t0 < args.calibration_s:
            plan = next(p for p in plans if p.kind == "valid")
            o = Outcome(dataclasses.replace(plan, drop_after=None))
            await send(client, target, o.plan, o, t0)
            if judge(o)[0] == ANSWERED:
                done.append(o.done_s)
            elif judge(o)[0] != REJECTED:
                raise PagellmError(f"a calibration request failed: {judge(o)[1]}")

    await asyncio.gather(*(worker() for _ in range(args.calibration_concurrency)))
    if not done:
        raise PagellmError("no calibration request completed; give --request-rate")
    return len(done) / max(done)


@dataclass
class _Load:
    """One soak's state as it runs, shared by the arrivals, the sampler and the drain: the sampler reads
    `phase` as the run moves from load to drain."""

    t0: float
    phase: str = "load"
    outcomes: list[Outcome] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)


async def _server_metrics(client: Any, target: Target) -> dict[str, float]:
    return parse_metrics((await client.get(target.base_url + "/metrics", timeout=30)).text)


async def _offered_rate(
    client: Any, target: Target, args: SoakArgs, mix: Mix, own: tuple[int, int], lengths: tuple[int, int]
) -> tuple[float, float | None]:
    """The request rate to offer, and the calibrated rate it came from (None: --request-rate gave it)."""
    if args.request_rate is not None:
        return args.request_rate, None
    echo(
        f"calibrating: {args.calibration_concurrency} clients for {args.calibration_s:g} s ...",
        err=True,
    )
    # its own draws, so the load's traffic is the same however many requests calibration sent
    calibration = plan_requests(args.traffic_seed + 1, mix, len(target.adapters), own, lengths)
    calibrated = await _calibrate(client, target, calibration, args)
    rate = args.overload * calibrated
    echo(f"the server served {calibrated:.2f} req/s; offering {rate:.2f} req/s", err=True)
    return rate, calibrated


async def _sample(client: Any, target: Target, args: SoakArgs, memory: Memory | None, load: _Load) -> None:
    """Every `sample_interval`, a row of the server's metrics and RSS and the client's progress, echoed;
    runs until cancelled."""
    while True:
        await asyncio.sleep(args.sample_interval)
        now = time.perf_counter() - load.t0
        rss = memory.rss_mib() if memory else None
        asked = time.perf_counter()
        values = await _server_metrics(client, target)
        rows = load.rows
        rows.append(sample_row(now, load.phase, values, rss, load.progress, args.sample_interval))
        rows[-1]["metrics_ms"] = round((time.perf_counter() - asked) * 1000, 1)
        echo(
            f"{now:6.0f} s {load.phase}: sent {load.progress.sent}, running {rows[-1]['running']}, waiting "
            f"{rows[-1]['waiting']}, RSS {rss or 0:.0f} MiB",
            err=True,
        )


async def _offer(
    client: Any, target: Target, args: SoakArgs, plans: Iterator[Planned], rate: float, load: _Load
) -> None:
    """Send the planned requests as Poisson arrivals at `rate` for `duration`, each in its own task, without
    waiting for answers."""

    async def one(plan: Planned, o: Outcome) -> None:
        await send(client, target, plan, o, load.t0)
        load.progress.end(o)

    arrivals = np.random.RandomState(args.traffic_seed)
    offset = 0.0
    while offset < args.duration:
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - load.t0)))
        plan = next(plans)
        load.outcomes.append(Outcome(plan))
        load.progress.sent += 1
        load.tasks.append(asyncio.create_task(one(plan, load.outcomes[-1])))
        offset += arrivals.exponential(1.0 / rate)


async def _drain_load(args: SoakArgs, load: _Load) -> None:
    """Wait for the requests still open until none has ended for `drain_timeout`; the rest are cancelled
    and count as errors."""
    open_tasks = await drain(load.tasks, args.drain_timeout)
    for task in open_tasks:
        task.cancel()
    await asyncio.gather(*open_tasks, return_exceptions=True)
    for task, o in zip(load.tasks, load.outcomes, strict=True):
        if task in open_tasks:  # never answered, or never ended
            o.error = f"still open when no request had ended for {args.drain_timeout:g} s of the drain"
            load.progress.end(o)


async def _settled_metrics(client: Any, target: Target) -> dict[str, float]:
    """The server's metrics once it runs and queues nothing, or after 30 s."""
    deadline = time.monotonic() + 30
    after = await _server_metrics(client, target)
    while time.monotonic() < deadline and (
        after.get("pagellm:num_requests_running") or after.get("pagellm:num_requests_waiting")
    ):
        await asyncio.sleep(0.5)
        after = await _server_metrics(client, target)
    return after


async def _soak(target: Target, args: SoakArgs, memory: Memory | None) -> dict[str, Any]:
    import httpx

    quiet_httpx()
    mix = Mix()
    target, own = with_prefixes(target, args.output_len_max, args.traffic_seed)
    lengths = (args.output_len_min, args.output_len_max)
    plans = plan_requests(args.traffic_seed, mix, len(target.adapters), own, lengths)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        rate, calibrated = await _offered_rate(client, target, args, mix, own, lengths)
        before = await _server_metrics(client, target)
        load = _Load(t0=time.perf_counter())
        sampling = asyncio.create_task(_sample(client, target, args, memory, load))
        await _offer(client, target, args, plans, rate, load)
        load.phase = "drain"
        await _drain_load(args, load)
        after = await _settled_metrics(client, target)
        sampling.cancel()
        load.phase = "after"
        now = time.perf_counter() - load.t0
        rss_after = memory.rss_mib() if memory else None
        load.rows.append(sample_row(now, load.phase, after, rss_after, load.progress, args.sample_interval))
    rows = load.rows
    warm = next((r["rss_mib"] for r in rows if r["time_s"] >= args.warmup()), None)
    return {
        "rate": rate,
        "calibrated_rate": calibrated,
        "outcomes": load.outcomes,
        "rows": rows,
        "before": before,
        "after": after,
        "rss_warm": warm,
        "rss_after": rss_after,
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Throughput, TTFT (overall and by thirds of the load, by send time), and the tally."""
    outcomes: list[Outcome] = run["outcomes"]
    client = tally(outcomes)
    answered = [o for o in outcomes if judge(o)[0] == ANSWERED]
    span = max((o.done_s for o in answered), default=0.0)
    ttfts = [(o.sent_s, o.ttft_s) for o in answered if o.ttft_s is not None]
    thirds = np.array_split(np.array(sorted(ttfts)).reshape(-1, 2), 3) if ttfts else []
    return {
        "offered_rate": run["rate"],
        "calibrated_rate": run["calibrated_rate"],
        "sent": len(outcomes),
        **client,
        "request_throughput": len(answered) / span if span else None,
        "output_tok_s": sum(o.output_tokens for o in answered) / span if span else None,
        "ttft_ms": percentiles([t for _, t in ttfts]),
        "ttft_ms_by_third": [percentiles(part[:, 1].tolist()) for part in thirds],
    }


def checks(
    run: dict[str, Any], summary: dict[str, Any], attached: bool
) -> list[tuple[str, bool | None, str]]:
    """(check, passed, detail) after the drain; passed is None for what could not be measured."""
    after, before = run["after"], run["before"]

    def gauge(name: str) -> float | None:
        return after.get(f"pagellm:{name}")

    def zero(title: str, names: Sequence[str]) -> tuple[str, bool | None, str]:
        values = {n: gauge(n) for n in names}
        if any(v is None for v in values.values()):
            return title, None, "not exposed by this server"
        return title, all(v == 0 for v in values.values()), ", ".join(f"{n} {v:g}" for n, v in values.items())

    server = {k: v - finished_by_reason(before).get(k, 0.0) for k, v in finished_by_reason(after).items()}
    mismatch = cross_check(summary, server)
    ok, memory_detail = memory_check(run["rss_warm"], run["rss_after"])
    if attached:
        memory_detail = "not measured: --base-url (the server's process is not ours)"
    problems = summary["problems"]
    return [
        zero("running and waiting 0", ["num_requests_running", "num_requests_waiting"]),
        zero("KV blocks held by requests 0 (prefix-cache-only blocks are free)", ["kv_cache_usage_perc"]),
        zero("LoRA requests and adapters released", ["lora_requests_running", "lora_adapters_active"]),
        zero("grammar matchers released", ["grammar_matchers_live"]),
        (f"resident memory within {MEMORY_TOLERANCE:.0%} of warm-up", ok, memory_detail),
        (
            "no 5xx but 503 overload answers (with Retry-After)",
            summary["server_errors"] == 0,
            f"{summary['server_errors']} other 5xx",
        ),
        (
            "every accepted request answered exactly once",
            not problems,
            f"{len(problems)} problems" + (f": {'; '.join(problems[:3])}" if problems else ""),
        ),
        ("server's finished counts match the client's", mismatch is None, mismatch or f"{server}"),
    ]


def main(args: SoakArgs) -> dict[str, Any]:
    """Run the soak against `pagellm serve` started here (or `args.base_url`); print the samples, the
    summary and the checks; write `args.output_json` and `args.csv_path`; raise SoakFailed if a check
    failed."""
    config = args.engine_config()
    echo(cpu_line(cpu_features()))  # the other commands print it with the floor's machine
    memory = None
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            config = soak_config(config, args.engine)
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagellm-soak-")))
            echo("making 2 LoRA adapters ...", err=True)
            adapters = make_adapters(resolve_model_source(config), folder, seed=args.traffic_seed)
            lora_args = []
            for i, path in enumerate(adapters):
                lora_args += ["--lora-modules", f"soak-lora-{i}={path}"]
            echo("starting pagellm serve ...", err=True)
            server = stack.enter_context(
                ServerProcess(config, args.server_log, args.server_timeout, extra_args=lora_args)
            )
            base_url = server.url
            memory = Memory(server.process.pid)
            echo(f"pagellm serve is up at {base_url} (log: {server.log_path})", err=True)
        else:
            echo("--base-url: the server's memory is not measured (its process is not ours)", err=True)
        target = discover(base_url.rstrip("/"))
        if len(target.adapters) < 2:
            echo(f"the server lists {len(target.adapters)} LoRA adapters; fewer adapter requests", err=True)
        run = asyncio.run(_soak(target, args, memory))
        summary = summarize(run)
        results = checks(run, summary, attached=args.base_url is not None)
        if args.base_url is None and any(passed is False for _, passed, _ in results):
            server.temporary_log = False  # keep the log: it may say why
    rows = run["rows"]
    shown = rows[:: max(1, len(rows) // 20)]  # about 20 rows, and the one after the drain
    echo(table(shown if shown[-1] is rows[-1] else [*shown, rows[-1]], _TABLE))
    echo(format_summary(summary))
    for title, passed, detail in results:
        echo(f"{'SKIP' if passed is None else 'PASS' if passed else 'FAIL'}  {title}: {detail}")
    if args.csv_path:
        write_csv(args.csv_path, rows)
        echo(f"wrote {args.csv_path}")
    sections = {
        "base_url": base_url,
        "results": summary,
        "checks": [{"check": t, "passed": p, "detail": d} for t, p, d in results],
        "samples": rows,
    }
    write_json(args.output_json, "soak", config, **sections)
    failed = [t for t, p, _ in results if p is False]
    if failed:
        raise SoakFailed(f"{len(failed)} check(s) failed: {'; '.join(failed)}")
    return sections


def format_summary(s: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    thirds = " / ".join(
        f"{num(t['p50'], '{:.0f}')}, {num(t['p99'], '{:.0f}')}" for t in s["ttft_ms_by_third"]
    )
    return "\n".join(
        [
            f"offered {num(s['offered_rate'])} req/s (calibrated: {num(s['calibrated_rate'])}); sent {s['sent']}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items())),
            f"throughput {num(s['request_throughput'])} req/s, {num(s['output_tok_s'], '{:.1f}')} output tok/s",
            f"TTFT ms p50 {num(s['ttft_ms']['p50'], '{:.0f}')}, p99 {num(s['ttft_ms']['p99'], '{:.0f}')}; "
            f"by thirds of the load (p50, p99): {thirds}",
            f"rejected (503) by kind: {s['rejected_by_kind']}",
            f"refused (400) by kind: {s['refused_by_kind']}",
        ]
    )
