"""The bounded in-memory store of `/v1/responses` (`--enable-responses-store`): what `previous_response_id`,
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` read.

Each entry is a response and the conversation it ended (the chat messages of its prompt plus its own output
as the assistant's turns), so a follow-up request continues exactly that conversation. The store holds at
most `max_entries` responses, dropping the oldest first, and forgets a response `max_age_s` seconds after it
was made: a server that keeps every response grows without end. It lives in the server's process and dies
with it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.server.protocol_responses import ResponseObject

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages: the prompt's, then the response's own turns
    cancel: Callable[[], None] | None = None  # aborts its engine requests while it runs
    made_at: float = field(default_factory=time.monotonic)


class ResponsesStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S):
        if max_entries < 1 or max_age_s <= 0:
            raise ValueError("the responses store needs room for one response and a positive age limit")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def put(self, entry: StoredResponse) -> None:
        self._expire()
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).made_at < oldest:
            self._entries.popitem(last=False)
