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

KV connector (disaggregated prefill/decode, core/kv_connector.py): a waiting request whose next blocks can
be loaded from outside gets blocks for them and waits out of the queue (WAITING_FOR_REMOTE_KVS) until the
worker reports the load ended; then its loaded blocks, up to the first that failed, go into the prefix
cache, it releases every block and goes back to the head of the queue, where it finds them as hits. So only
running and loading requests hold blocks, a failed load costs a recompute, and a request preempted later
finds what it received in the prefix cache. A finished request the connector must still send keeps its
blocks until the worker reports them sent.

Whole images: for a model whose image tokens attend to each other both ways (Gemma 3,
`SupportsImages.bidirectional_images`), a prefill chunk never ends inside an image: it ends before an image
it cannot hold whole, and the budget it leaves goes to the requests after it; a chunk that starts inside
an image (a prefix-cache hit ending there) takes the rest of the image or nothing. The processor refuses an
image longer than the token budget, so every image fits a step.

Between `schedule()` and `update_from_output()`, a scheduled request's `num_computed_tokens` is the
position of its first scheduled token.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagellm.core.config import step_tokens
from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import KVConnector, KVConnectorOutput
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request, RequestStatus
from pagellm.worker.step import SchedulerOutput

logger = logging.getLogger("pagellm")


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
    kv_transfer_loaded_tokens: int = 0  # cumulative: tokens a KV connector loaded (then prefix-cache hits)
    kv_transfer_load_failures: int = 0  # cumulative: loads that ended short (missing, corrupt, timed out)
    num_lora_requests_running: int = 0  # running requests under a LoRA adapter
    num_loras_active: int = 0  # distinct adapters of those: the device slots the running batch needs
    num_grammar_matchers_live: int = 0  # structured-output matchers not yet freed (LLMEngine.stats adds it)
    forward_compiled: bool = False  # the steps run the compiled forward, not the eager one (LLMEngine.stats)
    forward_regional: bool = (
        False  # that forward is the regional one (layers compiled once), the whole to come
    )
    kernels_pending: bool = (
        False  # the platform's kernels are still building: PyTorch paths (LLMEngine.stats)
    )


@dataclass
class _Step:
    """What one `schedule()` call has decided so far, shared by its phases: the token budget left, the
    requests scheduled (in order) with their token counts and drafts, those newly admitted, and those
    preempted."""

    budget: int
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_request_ids: set[str] = field(default_factory=set)


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
        kv_connector: KVConnector | None = None,
        kv_windows: Sequence[int | None] = (None,),
        whole_images: bool = False,
    ):
        """`kv_windows`: each KV cache group's sliding window as the KV cache manager honours it (None:
        the group keeps every block). `whole_images`: a prefill chunk never cuts an image's tokens."""
        if policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, not {policy!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so every running request can decode each step; raise it or lower max_num_seqs"
            )
        token_budget = step_tokens(max_num_batched_tokens, enable_chunked_prefill, max_model_len)
        kv = KVCacheManager(block_size, num_blocks, enable_prefix_caching, kv_windows)
        if kv.max_blocks_per_request(max_model_len, token_budget) > num_blocks - 1:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens, fewer than max_model_len "
                f"({max_model_len}); give the KV cache more memory or lower max_model_len"
                if kv.num_groups == 1 and kv.windows[0] is None
                else f"the KV cache's {num_blocks - 1} blocks are fewer than a request of max_model_len "
                f"({max_model_len}) tokens needs over its {kv.num_groups} KV cache groups "
                f"({kv.max_blocks_per_request(max_model_len, token_budget)}); give the KV cache more memory "
                "or lower max_model_len"
            )
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.whole_images = whole_images
        self.policy = policy
        self.token_budget = token_budget
        self.kv_cache_manager = kv
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
        if kv_connector is not None and not enable_prefix_caching:
            raise ConfigError(
                "kv_transfer_config needs prefix caching (loaded KV is found as prefix-cache hits); "
                "leave enable_prefix_caching on"
            )
        self.kv_connector = kv_connector  # the scheduler's half
        # loading: request id -> (request, tokens of its local prefix-cache hit, external tokens)
        self._parked: dict[str, tuple[Request, int, int]] = {}
        self._sending: dict[str, Request] = {}  # finished, blocks held until the connector sent them
        self.kv_transfer_loaded_tokens = 0
        self.kv_transfer_load_failures = 0

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
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.waiting.remove(request)
        self._finish(request, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_kv_transfers(self) -> bool:
        """Loads or sends in flight: the engine must keep stepping to hear how they end."""
        return bool(self._parked or self._sending)

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
        adapters = [r.lora_int_id for r in self.running if r.lora_int_id]
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
            kv_transfer_loaded_tokens=self.kv_transfer_loaded_tokens,
            kv_transfer_load_failures=self.kv_transfer_load_failures,
            num_lora_requests_running=len(adapters),
            num_loras_active=len(set(adapters)),
        )

    def schedule(self) -> SchedulerOutput:
        """One step's decision, in three phases that share a `_Step`: the running requests first, then the
        waiting ones (none after a preemption), then the output built from what was scheduled."""
        step = _Step(budget=self.token_budget)
        self._preempt_outgrown(step)
        self._schedule_running(step)
        self._schedule_waiting(step)
        return self._build_output(step)

    def _preempt_outgrown(self, step: _Step) -> None:
        """Running requests whose KV was rotated for a shorter sequence (models/layers/rotary.py) are
        preempted before anything is scheduled, so the step never runs on that KV."""
        for request in [r for r in self.running if r.rope_outgrown]:
            self.running.remove(request)
            self._preempt(request, outgrown=True)
            step.preempted.append(request.request_id)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, in admission order, each its remaining known tokens (and drafts) up to the
        budget left; one that gets no blocks preempts the newest until it fits or is itself preempted."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            known = request.num_tokens - request.num_computed_tokens
            n = self._whole_images(request, request.num_computed_tokens, min(known, step.budget))
            if n == 0:  # the runner returned no token for it last step, or its next image does not fit
                i += 1
                continue
            drafts = request.spec_token_ids[: step.budget - n] if n == known else []
            if drafts and request.grammar is not None:
                drafts = request.grammar.valid_prefix(drafts)
            n += len(drafts)
            i = self._allocate_or_preempt(step, request, n, i)
            if request.status != RequestStatus.RUNNING:
                break
            step.scheduled.append(request)
            step.num_scheduled[request.request_id] = n
            if drafts:
                step.spec_token_ids[request.request_id] = drafts
            step.budget -= n
            i += 1

    def _allocate_or_preempt(self, step: _Step, request: Request, n: int, i: int) -> int:
        """Slots for `n` tokens of `request` (running at index `i`), preempting victims until they fit: a
        victim scheduled earlier this step gives its tokens back to the budget. Returns `request`'s index
        after the victims before it left; `request` is no longer RUNNING if it was the victim."""
        kv = self.kv_cache_manager
        while not kv.allocate_slots(request, n + self._lookahead(request.num_computed_tokens + n)):
            victim = self._pick_victim()
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim.request_id in step.num_scheduled:
                step.budget += step.num_scheduled.pop(victim.request_id)
                step.scheduled.remove(victim)
            if victim_index < i:
                i -= 1
            self._preempt(victim)
            step.preempted.append(victim.request_id)
            if victim is request:
                break
        return i

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests in policy order while the budget, `max_num_seqs` and free blocks allow, none in
        a step that preempted. One waiting for a grammar, an adapter slot or the connector's answer keeps
        its place in the queue; one whose next blocks the connector can load is parked to load them."""
        kv = self.kv_cache_manager
        compiling: list[Request] = []  # waiting for a grammar or an adapter slot: they keep their place
        adapters = {r.lora_int_id for r in self.running} - {0}
        while (
            not step.preempted
            and self.waiting
            and step.budget > 0
            and len(self.running) + len(self._parked) < self.max_num_seqs  # a loading request runs next
        ):
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
            if self.kv_connector is not None and not request.kv_loaded and kv.uses_prefix_cache(request):
                num_external = self._external_tokens(request, num_hit)
                if num_external is None:  # the connector does not know yet: it keeps its place
                    compiling.append(self.waiting.pop())
                    continue
                if num_external:
                    if not kv.allocate_slots(request, num_external, computed_blocks):
                        break
                    self._park(request, num_hit, num_external)
                    continue
            n = request.num_tokens - num_hit
            if n > step.budget:
                if not self.enable_chunked_prefill:
                    break
                n = self._whole_images(request, num_hit, step.budget)
                if n == 0:  # its next image does not fit the budget left
                    break
            if not kv.allocate_slots(request, n + self._lookahead(num_hit + n), computed_blocks):
                break
            self._admit(step, request, num_hit, n)
            if lora:
                adapters.add(lora)

        for request in reversed(compiling):
            self.waiting.prepend(request)

    def _admit(self, step: _Step, request: Request, num_hit: int, n: int) -> None:
        """The queue's head, its blocks allocated, starts running with `n` tokens after its `num_hit`
        prefix-cache hit."""
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if self.kv_connector is not None:  # admitted without external tokens (it may release an offer)
            block_ids = self.kv_cache_manager.block_table(request.request_id)
            self.kv_connector.update_state_after_alloc(request, block_ids, 0)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
        self.running.append(request)
        step.scheduled.append(request)
        step.num_scheduled[request.request_id] = n
        step.new_request_ids.add(request.request_id)
        step.budget -= n

    def _build_output(self, step: _Step) -> SchedulerOutput:
        """The step's `SchedulerOutput`: what was scheduled with its block tables and grammar bitmasks, the
        requests finished since the last step, and the connector's metadata."""
        kv = self.kv_cache_manager
        scheduled, num_scheduled = step.scheduled, step.num_scheduled
        finished_ids, self._finished_ids = self._finished_ids, set()
        output = SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=num_scheduled,
            new_request_ids=step.new_request_ids,
            preempted=step.preempted,
            finished_ids=finished_ids,
            block_ids={r.request_id: kv.block_table(r.request_id) for r in scheduled},
            group_block_ids={r.request_id: kv.block_tables(r.request_id) for r in scheduled},
            total_num_scheduled_tokens=self.token_budget - step.budget,
            spec_token_ids=step.spec_token_ids,
            grammar_bitmasks=self._grammar_bitmasks(scheduled, num_scheduled, step.spec_token_ids),
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
        return output

    def _external_tokens(self, request: Request, num_hit: int) -> int | None:
        """Whole blocks after the local hit the connector can load, never the last known token."""
        n = self.kv_connector.get_num_new_matched_tokens(request, num_hit)
        if n is None:
            return None
        bs = self.kv_cache_manager.block_size
        return max(0, min(n - n % bs, (request.num_tokens - 1) // bs * bs - num_hit))

    def _park(self, request: Request, num_hit: int, num_external: int) -> None:
        """The request (the queue's head) holds blocks for its external tokens and waits, out of the queue,
        until the worker reports the load ended (`update_kv_transfers`)."""
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit
        self._parked[request.request_id] = (request, num_hit, num_external)
        block_ids = self.kv_cache_manager.block_table(request.request_id)
        self.kv_connector.update_state_after_alloc(request, block_ids, num_external)

    def update_kv_transfers(self, output: KVConnectorOutput) -> None:
        """What the connector's worker reported after a step: requests whose KV was sent release their
        blocks; requests whose load ended go back to the head of the queue, their loaded blocks up to the
        first that failed made prefix-cache hits (the rest is recomputed)."""
        kv = self.kv_cache_manager
        for request_id in output.finished_sending:
            request = self._sending.pop(request_id, None)
            if request is not None:
                kv.free(request)
        for request_id in output.finished_recving:
            entry = self._parked.pop(request_id, None)
            if entry is None:
                continue
            request, num_hit, num_external = entry
            if request.is_finished:  # aborted while loading: its blocks may be reused only now
                kv.free(request)
                continue
            table, first = kv.block_table(request_id), num_hit // kv.block_size
            num_ok = 0
            while (
                num_ok < num_external // kv.block_size
                and table[first + num_ok] not in output.invalid_block_ids
            ):
                num_ok += 1
            loaded = num_ok * kv.block_size
            kv.release_loaded(request, num_hit, num_hit + loaded)
            self.kv_transfer_loaded_tokens += loaded
            if loaded < num_external:
                self.kv_transfer_load_failures += 1
                logger.warning(
                    "request %s: %d of %d tokens of KV failed to load; recomputing them",
                    request_id,
                    num_external - loaded,
                    num_external,
                )
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            request.kv_loaded = True
            self.waiting.prepend(request)

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

    def _whole_images(self, request: Request, start: int, n: int) -> int:
        """`n`, or fewer so that the chunk [start, start + n) ends outside every image (0 when it starts
        inside one it cannot finish), with `whole_images`."""
        if not self.whole_images:
            return n
        end = start + n
        for image in request.images:
            if image.offset < end < image.end:
                return max(0, image.offset - start)
        return n

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
        the target's own token: the KV computed covers the accepted drafts, not the rejected ones. A pooling
        request (embeddings) finishes in the step that reaches the end of its prompt."""
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
            if (
                request.pooling_params is not None
                and request.num_computed_tokens + known >= request.num_tokens
            ):
                # nothing to decode: a pooling request finishes with its prompt (the runner pooled it)
                request.num_computed_tokens += known
                kv.cache_blocks(request, request.num_computed_tokens)
                self._finish(request, RequestStatus.FINISHED_STOPPED, None)
                any_finished = True
                updated.append(request)
                continue
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

    def _preempt(self, request: Request, outgrown: bool = False) -> None:
        """Free its KV and queue it first, to be recomputed. `outgrown`: not for room but because its KV was
        rotated for a shorter sequence (`Request.rope_outgrown`): recomputed under its new prefix-cache key."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.kv_loaded = False
        self.waiting.prepend(request)
        if outgrown:
            request.rope_salt = request.rope_salt_of(request.num_prompt_tokens, request.num_tokens)
            request.block_hashes.clear()
        else:
            self.num_preemptions += 1

    def _finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        request.status = status
        request.stop_reason = stop_reason
        request.finished_time = time.monotonic()
        kv, request_id = self.kv_cache_manager, request.request_id
        delay_free = False
        if self.kv_connector is not None:
            block_ids = list(kv.block_table(request_id)) if kv.has_blocks(request_id) else []
            delay_free, request.kv_transfer_output = self.kv_connector.request_finished(request, block_ids)
        if request_id in self._parked:
            pass  # the connector may still be filling its blocks: freed when the load ends
        elif delay_free and kv.has_blocks(request_id):
            self._sending[request_id] = request
        else:
            kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
