"""Prometheus metrics under the `pagellm:` prefix, fed by AsyncLLM's engine thread after every turn.

Each server has its own CollectorRegistry, so several apps can live in one process (tests) without clashing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.engine.async_llm import IterationStats
from pagellm.engine.scheduler import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class PrometheusStatLogger:
    """An AsyncLLM stat logger that keeps the server's Prometheus metrics."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # created in the order they are exposed
        self._add_batch_gauges()
        self._add_request_metrics()
        self._add_spec_and_transfer_counters()
        # counters fed from the scheduler's cumulative counts, by increments
        self._cumulative = [
            (self.prefix_queries, "prefix_cache_queries"),
            (self.prefix_hits, "prefix_cache_hits"),
            (self.preemptions, "num_preemptions"),
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
            (self.kv_loaded_tokens, "kv_transfer_loaded_tokens"),
            (self.kv_load_failures, "kv_transfer_load_failures"),
        ]
        self._last = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"pagellm:{name}", doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"pagellm:{name}", doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(f"pagellm:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)
        return metric.labels(self.model_name)

    def _add_batch_gauges(self) -> None:
        """The state after each turn: the running batch and queue, the KV cache, adapters, grammars, and
        whether the compiled forward and the native kernels are in use yet."""
        gauge = self._gauge
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1)."
        )
        self.lora_requests_running = gauge("lora_requests_running", "Running requests under a LoRA adapter.")
        self.loras_active = gauge(
            "lora_adapters_active", "Distinct LoRA adapters of the running requests (device slots in use)."
        )
        self.grammar_matchers_live = gauge(
            "grammar_matchers_live",
            "Structured-output grammar matchers in memory (0 when idle: finished requests free theirs).",
        )
        self.forward_compiled = gauge(
            "forward_compiled",
            "1 when steps run the compiled forward, 0 while they run the eager one (before a background "
            "compile is swapped in, or with --enforce-eager).",
        )
        self.forward_regional = gauge(
            "forward_regional",
            "1 while the compiled forward is the regional one (each decoder layer compiled once, a few "
            "percent slower), before the whole graph compiled after it is swapped in.",
        )
        self.kernels_pending = gauge(
            "kernels_pending",
            "1 while the platform's native kernels build in the background and steps run the PyTorch paths, "
            "0 once they are taken up (or none were to build).",
        )

    def _add_request_metrics(self) -> None:
        """Counts and latencies of the requests: prefix-cache lookups, preemptions, rejections, tokens,
        TTFT, TPOT and end-to-end latency, and finished requests by reason."""
        counter, histogram = self._counter, self._histogram
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.rejected = counter(
            "requests_rejected",
            "Requests refused with 503 because the queue was full (--max-waiting-requests).",
        )
        self._rejected_seen = 0
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token.", _TOKEN_TIME_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.success = Counter(
            "pagellm:request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def _add_spec_and_transfer_counters(self) -> None:
        """Speculative decoding's drafts verified and accepted (also by position), and a KV connector's
        loads."""
        counter = self._counter
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Request steps that verified speculative drafts."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative drafts the target model verified."
        )
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Of those, drafts accepted.")
        self.spec_accepted_per_pos = Counter(
            "pagellm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted, by their position in the step's drafts (0: the first).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.kv_loaded_tokens = counter(
            "kv_transfer_loaded_tokens", "Prompt tokens a KV connector loaded (disaggregated prefill)."
        )
        self.kv_load_failures = counter(
            "kv_transfer_load_failures",
            "KV loads that ended short (missing, corrupt, timed out): recomputed.",
        )

    def record(self, scheduler_stats: SchedulerStats, iteration: IterationStats) -> None:
        s, last = scheduler_stats, self._last
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.lora_requests_running.set(s.num_lora_requests_running)
        self.loras_active.set(s.num_loras_active)
        self.grammar_matchers_live.set(s.num_grammar_matchers_live)
        self.forward_compiled.set(int(s.forward_compiled))
        self.forward_regional.set(int(s.forward_regional))
        self.kernels_pending.set(int(s.kernels_pending))
        for counter, name in self._cumulative:  # cumulative counts; Prometheus counters take increments
            counter.inc(max(0, getattr(s, name) - getattr(last, name)))
        for position, accepted in enumerate(s.spec_accepted_per_position):
            before = (
                last.spec_accepted_per_position[position]
                if position < len(last.spec_accepted_per_position)
                else 0
            )
            if accepted > before:
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(accepted - before)
        self._last = s
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens:
            self.ttft.observe(ttft)
        for finished in iteration.finished:
            self.e2e.observe(finished.e2e_latency)
            if finished.time_per_output_token is not None:
                self.tpot.observe(finished.time_per_output_token)
            self.success.labels(self.model_name, finished.finish_reason).inc()

    def count_rejections(self, total: int) -> None:
        """Bring `requests_rejected` up to AsyncLLM's running count of refused requests."""
        self.rejected.inc(total - self._rejected_seen)
        self._rejected_seen = total

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
