"""Incremental detokenization of one request's output, with stop strings, for streaming.

Text is decoded a window of tokens at a time (the algorithm of `tokenizers.decoders.DecodeStream`): a
token that ends inside a multi-byte character yields nothing until the character is complete, so no
U+FFFD is emitted for it. The stream is primed with the prompt's last tokens so the first output token
decodes as it does in context (its leading space kept). Text that could be the start of a stop string is
held back from what is visible until the next tokens confirm or refute it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from pagellm.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_PRIME_MIN, _PRIME_MAX = 4, 24
_INVALID_PREFIX = "Invalid prefix encountered"


class _RustStream:
    """`DecodeStream` over a fast tokenizer's Rust backend."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:
            # Some decoders give text that does not extend the previous window's (vLLM issue 17448);
            # DecodeStream cannot go on from there, so start a fresh window at this token.
            if _INVALID_PREFIX not in str(e):
                raise
            logger.warning("detokenizer: restarting the decode stream at token %d (%s)", token_id, e)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, token_id)


class _PyStream:
    """DecodeStream's algorithm over `tokenizer.decode`, for tokenizers without a Rust backend."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = ""
        self.prefix_index = 0

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if len(text) <= len(self.prefix) or text.endswith(_REPLACEMENT):
            return None
        new_text = text[len(self.prefix) :]
        self.ids = self.ids[self.prefix_index :]
        self.prefix = self.decode(self.ids)
        self.prefix_index = len(self.ids)
        return new_text


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive and watches for its stop strings.

    `output_text` is all text so far (cut at a matched stop string); `visible_text()` and `get_delta()`
    leave out a tail that may still turn into a stop string, until the request is finished.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.params = params
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop_string: str | None = None
        self._delta_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        skip = params.skip_special_tokens
        self._stream = _RustStream(backend, skip) if backend is not None else _PyStream(tokenizer, skip)
        for token_id in _prompt_tail(self._stream.decode, prompt_token_ids):
            self._stream.step(token_id)
        self._added_tokens: dict[int, str] = {}
        if not (skip or params.spaces_between_special_tokens):
            self._added_tokens = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._last_was_added = False

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append new tokens' text; return the stop string they completed, if any.

        `stop_terminated`: the last token is a stop token (EOS or a `stop_token_ids` entry); its text is
        left out unless `include_stop_str_in_output`. Tokens after a matched stop string are ignored.
        """
        if self.stopped or not new_token_ids:
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output:
            to_decode.pop()
        check_from = len(self.output_text)
        for token_id in to_decode:
            self.output_token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if len(self.output_token_ids) <= self.params.min_tokens:
                # Stop strings only count once they end after the first min_tokens tokens' text.
                check_from = len(self.output_text)
        if len(to_decode) < len(new_token_ids):
            self.output_token_ids.append(new_token_ids[-1])
        if len(self.output_token_ids) <= self.params.min_tokens:
            return None
        return self._check_stop(check_from)

    def visible_text(self, finished: bool = False) -> str:
        """The text that may be shown now: all of it once finished or stopped."""
        return self.output_text[: self._visible_len(finished)]

    def get_delta(self, finished: bool = False) -> str:
        """Visible text not returned by an earlier call."""
        end = self._visible_len(finished)
        delta = self.output_text[self._delta_offset : end]
        self._delta_offset = max(self._delta_offset, end)
        return delta

    def _decode_next(self, token_id: int) -> str:
        text = self._stream.step(token_id) or ""
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_was_added:
                # The decoder may join tokens with spaces; adjacent added tokens keep their raw text.
                text = content
            self._last_was_added = content is not None
        return text

    def _check_stop(self, check_from: int) -> str | None:
        """Find the earliest stop string that ends after `check_from` and cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.output_text.find(stop, max(0, check_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[
            : index + len(stop) if self.params.include_stop_str_in_output else index
        ]
        self.stop_string = stop
        return stop

    def _visible_len(self, finished: bool) -> int:
        text = self.output_text
        if finished or self.stopped or self.params.include_stop_str_in_output:
            # With the stop string included, a partial one is a prefix of the final text anyway.
            return len(text)
        held = 0
        for stop in self.params.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return len(text) - held


def _prompt_tail(decode: Callable[[Sequence[int]], str], prompt_token_ids: Sequence[int]) -> Sequence[int]:
    """The shortest tail of the prompt (4 to 24 tokens) that starts on a character boundary: enough
    context for the first output token to decode as it does after the prompt."""
    longest = min(_PRIME_MAX, len(prompt_token_ids))
    for size in range(min(_PRIME_MIN, longest), longest + 1):
        tail = prompt_token_ids[len(prompt_token_ids) - size :]
        if not decode(tail).startswith(_REPLACEMENT):
            return tail
    return prompt_token_ids[len(prompt_token_ids) - longest :]
