"""`Scheduler`: each step, decides how many tokens every request runs, within the token budget.

One decision per step, no prefill or decode mode: running requests first, in admission order, each
getting its remaining known tokens up to the budget left (1 for a decode), then waiting requests in
policy order while the budget, `max_num_seqs` and free blocks allow. A prefill chunk that stops short
uses up the budget, so at most the last running request is mid-prefill and decodes always go first. Out of
blocks, the newest running request (priority policy: the lowest priority, latest arrival) is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to recompute its prompt and
outputs so far (the prefix cache usually still holds most of them). With chunked prefill off the token
budget is raised to `max_model_len`, so any prompt can run, alone if need be.

Speculative decoding: a decoding request's drafts (`Request.spec_token_ids`, proposed by the model runner
in the step before) run after its last token, counted against the token budget and trimmed to fit it.
Once verified, `num_computed_tokens` moves past the accepted drafts only, so the KV of rejected ones is
overwritten when those positions run again, and a block is offered to the prefix cache only when
accepted tokens fill it. `num_lookahead_tokens` more slots are allocated for a draft model's own KV.

Between `schedule()` and `update_from_output()`, a scheduled request's `num_computed_tokens` is the
position of its first scheduled token.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass

from pagellm.core.errors import ConfigError
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request, RequestStatus
from pagellm.worker.step import SchedulerOutput


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
    spec_num_drafts: int = 0  # cumulative: (request, step) pairs that verified drafts
    spec_num_draft_tokens: int = 0  # cumulative: drafts the target verified
    spec_num_accepted_tokens: int = 0  # cumulative: of those, accepted
    spec_accepted_per_position: tuple[int, ...] = ()  # cumulative acceptances of the 1st, 2nd, ... draft

    @property
    def spec_acceptance_rate(self) -> float | None:
        return (
            self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None
        )


class _FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)


class _PriorityQueue:
    """Lowest (priority, arrival_time) first; a preempted request goes back by its own key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        num_lookahead_tokens: int = 0,
        max_loras: int | None = None,
    ):
        if policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, not {policy!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so every running request can decode each step; raise it or lower max_num_seqs"
            )
        if (num_blocks - 1) * block_size < max_model_len:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens, fewer than max_model_len "
                f"({max_model_len}); give the KV cache more memory or lower max_model_len"
            )
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.token_budget = (
            max_num_batched_tokens if enable_chunked_prefill else max(max_num_batched_tokens, max_model_len)
        )
        self.kv_cache_manager = KVCacheManager(block_size, num_blocks, enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = _PriorityQueue() if policy == "priority" else _FCFSQueue()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_loras = max_loras  # distinct LoRA adapters a step may use
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_position: list[int] = []
        self._finished_ids: set[str] = set()

    def add_request(self, request: Request) -> None:
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"request {request.request_id} has {request.num_prompt_tokens} prompt tokens; "
                f"it needs 1 to max_model_len ({self.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> None:
        """Abort a waiting or running request; unknown or finished ids are ignored."""
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish a request for a reason found outside the scheduler (a stop string, an abort)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_accepted_per_position),
        )

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.token_budget
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        spec_token_ids: dict[str, list[int]] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            known = request.num_tokens - request.num_computed_tokens
            n = min(known, budget)
            if n == 0:  # the runner returned no token for it last step
                i += 1
                continue
            drafts = request.spec_token_ids[: budget - n] if n == known else []
            if drafts and request.grammar is not None:
                drafts = request.grammar.valid_prefix(drafts)
            n += len(drafts)
            while not kv.allocate_slots(request, n + self._lookahead(request.num_computed_tokens + n)):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim.request_id in num_scheduled:
                    budget += num_scheduled.pop(victim.request_id)
                    scheduled.remove(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            scheduled.append(request)
            num_scheduled[request.request_id] = n
            if drafts:
                spec_token_ids[request.request_id] = drafts
            budget -= n
            i += 1

        new_request_ids = set()
        compiling: list[Request] = []  # waiting for a grammar or an adapter slot: they keep their place
        adapters = {r.lora_int_id for r in self.running} - {0}
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            lora = request.lora_int_id
            if (request.grammar is not None and not request.grammar.ready) or (
                lora
                and lora not in adapters
                and self.max_loras is not None
                and len(adapters) >= self.max_loras
            ):
                compiling.append(self.waiting.pop())
                continue
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if not kv.allocate_slots(request, n + self._lookahead(num_hit + n), computed_blocks):
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
            self.running.append(request)
            scheduled.append(request)
            num_scheduled[request.request_id] = n
            new_request_ids.add(request.request_id)
            if lora:
                adapters.add(lora)
            budget -= n

        for request in reversed(compiling):
            self.waiting.prepend(request)

        finished_ids, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=num_scheduled,
            new_request_ids=new_request_ids,
            preempted=preempted,
            finished_ids=finished_ids,
            block_ids={r.request_id: kv.block_table(r.request_id) for r in scheduled},
            total_num_scheduled_tokens=self.token_budget - budget,
            spec_token_ids=spec_token_ids,
            grammar_bitmasks=self._grammar_bitmasks(scheduled, num_scheduled, spec_token_ids),
        )

    @staticmethod
    def _grammar_bitmasks(scheduled, num_scheduled, spec_token_ids) -> dict:
        """The token bitmask rows of every request with a grammar that samples this step: one for its last
        token and one after each of its drafts."""
        masks = {}
        for request in scheduled:
            if request.grammar is None:
                continue
            rid = request.request_id
            drafts = spec_token_ids.get(rid, [])
            if request.num_computed_tokens + num_scheduled[rid] == request.num_tokens + len(drafts):
                mask = request.grammar.bitmask(drafts)
                if mask is not None:
                    masks[rid] = mask
        return masks

    def _lookahead(self, end: int) -> int:
        """Slots past a step's last token (`end` tokens in all) for a draft model's own KV, never past
        max_model_len."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, list[int]],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Record a step's work, its sampled tokens and the drafts proposed for the next step; returns the
        requests that got tokens or finished.

        A request gets sampled tokens only when the step reached the end of its known tokens (a
        partial prefill chunk's sample is dropped). With drafts, the tokens are the accepted drafts then
        the target's own token: the KV computed covers the accepted drafts, not the rejected ones."""
        kv = self.kv_cache_manager
        now = time.monotonic()
        updated = []
        any_finished = False
        for request in output.scheduled:
            if request.is_finished:  # finished elsewhere since schedule()
                continue
            rid = request.request_id
            drafts = output.spec_token_ids.get(rid, ())
            known = output.num_scheduled_tokens[rid] - len(drafts)
            new_token_ids = sampled.get(rid)
            request.spec_token_ids = []
            if request.num_computed_tokens + known < request.num_tokens or not new_token_ids:
                request.num_computed_tokens += known
                kv.cache_blocks(request, request.num_computed_tokens)
                continue
            accepted = min(len(new_token_ids) - 1, len(drafts))
            if drafts:
                self._count_drafts(len(drafts), accepted)
            computed = request.num_computed_tokens + known + accepted
            if request.first_token_time is None:
                request.first_token_time = now
            stop = None
            appended = 0
            for token_id in new_token_ids:
                request.append_output_token_id(token_id)
                appended += 1
                stop = self._check_stop(request)
                if stop is not None:
                    break
            if request.grammar is not None:
                request.grammar.accept(new_token_ids[:appended])
                if stop is None and request.grammar.terminated:  # the grammar is complete
                    stop = (RequestStatus.FINISHED_STOPPED, None)
            request.num_computed_tokens = min(computed, request.num_tokens)
            kv.cache_blocks(request, request.num_computed_tokens)
            if stop is not None:
                self._finish(request, *stop)
                any_finished = True
            elif spec_token_ids:
                request.spec_token_ids = spec_token_ids.get(rid, [])
            updated.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_position = self.spec_accepted_per_position
        per_position.extend([0] * (num_drafts - len(per_position)))
        for i in range(num_accepted):
            per_position[i] += 1

    def _check_stop(self, request: Request) -> tuple[RequestStatus, int | None] | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if last in (params.stop_token_ids or ()):
                return RequestStatus.FINISHED_STOPPED, last
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def _pick_victim(self) -> Request:
        if self.policy == "fcfs":
            return self.running[-1]
        return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.waiting.prepend(request)
        self.num_preemptions += 1

    def _finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        request.status = status
        request.stop_reason = stop_reason
        request.finished_time = time.monotonic()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
