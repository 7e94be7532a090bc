"""`Request`: one generation request as the scheduler tracks it, from arrival to finish.

Timestamps are `time.monotonic()` seconds, so differences between them are latencies.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # holds blocks a KV connector is filling; not in the waiting queue
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token ids, progress and status of one request.

    `request_id` is the engine's own id, unique for the engine's lifetime; `external_request_id` is the
    caller's, which its outputs carry and its aborts name. A caller may use an id again once its request
    finished, while the runner still holds the old request's state (released at the next step): the two
    never share an engine id (vLLM v1's internal and external request ids).

    `num_computed_tokens` counts the leading tokens whose KV is in the cache; the tokens after it are
    what the next steps must run, followed by any drafts in `spec_token_ids` for the target to verify. `block_hashes` holds the chained hashes of its full blocks, filled
    incrementally by the KV cache manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
        pooling_params: Any = None,
        kv_transfer_params: dict[str, Any] | None = None,
        images: list[Any] | None = None,
        external_request_id: str | None = None,
    ):
        self.request_id = request_id
        self.external_request_id = request_id if external_request_id is None else external_request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params  # None for a pooling request
        # core.pooling.PoolingParams (resolved) for a pooling request: it finishes after its prompt, no tokens
        self.pooling_params = pooling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.priority = priority  # lower is scheduled sooner
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit tokens when first scheduled
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step (speculative decoding)
        self.grammar: Any = None  # structured_output.grammar.RequestGrammar when the output is constrained
        self.lora_request = lora_request  # lora.request.LoRARequest, or None for the base model
        # a length-dependent rope (models/layers/rotary.py): what its KV depends on besides its tokens, as a
        # function of (prompt tokens, tokens), and that value for the KV it holds
        self.rope_salt_of: Callable[[int, int], tuple | None] | None = None
        self.rope_salt: tuple | None = None
        # disaggregated prefill/decode: what the client sent for the KV connector, and what goes back to it
        self.kv_transfer_params = kv_transfer_params
        # multimodal.inputs.ImageInput of each image in its prompt, in prompt order (a multimodal model's)
        self.images: list[Any] = images or []
        # a multimodal rope's (Qwen-VL) prompt positions [3, P] and the delta of later positions; None else
        self.mrope_positions: Any = None
        self.mrope_delta = 0
        self.kv_transfer_output: dict[str, Any] | None = None
        self.kv_loaded = False  # its KV connector load ended since it was last admitted: do not load again
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs; a live list, do not modify."""
        return self._all_token_ids

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def cache_salt(self) -> tuple | None:
        """What its prefix-cache keys start from: an adapter's KV never serves another's requests, nor a
        prompt's rotated for one length (a length-dependent rope) another's."""
        r = self.lora_request
        lora = ("lora", r.lora_int_id, r.lora_name, r.lora_path) if r is not None else None
        return lora if self.rope_salt is None else (lora, self.rope_salt)

    @property
    def rope_outgrown(self) -> bool:
        """Whether it grew past the rope its KV was computed with (longrope's short factors): the KV is then
        recomputed for its new length, as transformers' generate does."""
        salt_of = self.rope_salt_of
        return salt_of is not None and salt_of(self.num_prompt_tokens, self.num_tokens) != self.rope_salt

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether each prompt position must run here, so no prefix-cache hit may stand in for it: prompt
        logprobs, or pooling over more than the last token (MEAN, CLS)."""
        if self.pooling_params is not None:
            return self.pooling_params.pooling_type != "LAST"
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens after the first `num_output_tokens` (a stop string ended the output inside a
        step's accepted drafts); the request is finished right after, so its KV does not matter."""
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
