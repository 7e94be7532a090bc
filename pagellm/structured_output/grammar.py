"""xgrammar behind two small classes: `GrammarCompiler` turns a request's `StructuredOutputsParams` into a
compiled grammar off the step path (a thread pool, cached by the grammar's key), and `RequestGrammar` is
one request's matcher: which tokens may come next (a bitmask row per sampled position), which drafts it
admits, and the tokens it accepted.

A request waits in the queue until its grammar is compiled. Its matcher follows its output tokens only,
so preemption (which keeps the outputs and recomputes their KV) leaves it as it is; drafts are tried and
rolled back, never kept.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagellm.core.errors import ConfigError
from pagellm.sampling.params import StructuredOutputsParams

logger = logging.getLogger("pagellm")

# Compiled grammars kept for later requests with an equal grammar, least recently used dropped beyond this
# size. Each holds a token-mask cache over the vocabulary: ~2.5 MB for a JSON schema with model S's 49k
# tokens, so an unbounded cache grew without end for clients that send a schema of their own each time.
CACHE_LIMIT_BYTES = 64 * 2**20

# JSON: at most this many whitespace characters in a row (room for a newline and deep indentation).
# Free whitespace without a bound lets a model loop on it until max_tokens (models S and tiny both did).
MAX_WHITESPACE = 20


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: only requests with a grammar need it
        raise ValueError("structured_outputs needs xgrammar: pip install xgrammar") from e
    return xgrammar


def _schema_text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices` (xgrammar's dialect: JSON-style string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check(params: StructuredOutputsParams) -> None:
    """Parse the grammar without compiling it for a vocabulary (milliseconds): a ValueError naming the
    field and the problem for an invalid schema, regex or grammar, before the request is queued."""
    xgr = _xgrammar()
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            xgr.Grammar.from_json_schema(json.dumps(schema))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_grammar(params.choice))
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(_schema_text(params.structural_tag))
    except (ValueError, RuntimeError, TypeError) as e:  # xgrammar's parse errors are RuntimeErrors
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"structured_outputs.{kind}: {message}", param="structured_outputs") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary on a background thread; equal grammars share one
    compilation, and compiled ones stay cached up to `cache_limit_bytes` (least recently asked for dropped
    first; a request that holds a dropped one keeps it until it ends)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_limit_bytes: int = CACHE_LIMIT_BYTES,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_limit_bytes = cache_limit_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-grammar")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()  # least recently asked for first
        self._sizes: dict[tuple, int] = {}  # bytes of each compiled grammar in `_compiled`
        self._lock = threading.Lock()
        self._compiler = None
        self._live: weakref.WeakSet[RequestGrammar] = weakref.WeakSet()  # every request grammar not yet freed

    @property
    def num_live(self) -> int:
        """Request grammars (each with its matcher) that are still in memory."""
        return len(self._live)

    def request_grammar(
        self, params: StructuredOutputsParams, start_after: Sequence[int] = ()
    ) -> RequestGrammar:
        """A matcher-to-be for one request; compiling starts now (or is shared with an equal grammar).
        `start_after`: token ids that end a reasoning section; the grammar applies to what follows them."""
        key = _key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, key, params)
            self._compiled.move_to_end(key)
        request_grammar = RequestGrammar(future, self.vocab_size, start_after)
        self._live.add(request_grammar)
        return request_grammar

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars the cache holds."""
        with self._lock:
            return sum(self._sizes.values())

    def _compile(self, key: tuple, params: StructuredOutputsParams):
        compiled = self._compile_now(params)
        with self._lock:
            self._sizes[key] = compiled.memory_size_bytes
            # drop the least recently asked for compiled grammars over the limit (never the newest)
            for old in [k for k in self._compiled if k in self._sizes and k != key]:
                if sum(self._sizes.values()) <= self.cache_limit_bytes:
                    break
                del self._compiled[old], self._sizes[old]
        return compiled

    def _compile_now(self, params: StructuredOutputsParams):
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # no cache of xgrammar's own: unbounded by default, and this class caches what it compiles
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler = self._compiler
        json_options = {"any_whitespace": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:  # a model may otherwise emit whitespace until max_tokens
            json_options["max_whitespace_cnt"] = MAX_WHITESPACE
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(_schema_text(params.json), **json_options)
        if kind == "json_object":  # any JSON object (not any JSON value), as OpenAI's json_object mode
            return compiler.compile_json_schema('{"type": "object"}', **json_options)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(params.choice))
        if kind == "structural_tag":
            return compiler.compile_structural_tag(_schema_text(params.structural_tag))
        return compiler.compile_grammar(params.grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _key(params: StructuredOutputsParams) -> tuple:
    kind = params.kind
    value = {
        "json": lambda: _schema_text(params.json),
        "json_object": lambda: "",
        "regex": lambda: params.regex,
        "choice": lambda: tuple(params.choice),
        "grammar": lambda: params.grammar,
        "structural_tag": lambda: _schema_text(params.structural_tag),
    }[kind]()
    return kind, value, params.disable_any_whitespace


class RequestGrammar:
    """One request's grammar state. With `start_after` (the tokens that end a reasoning section) the
    output is free until they appear, and the grammar constrains what follows."""

    def __init__(self, compiled: Future, vocab_size: int, start_after: Sequence[int] = ()):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self._matcher = None
        self._start_after = list(start_after)
        self._recent: list[int] = []  # the output's last tokens, while waiting for `start_after`

    @property
    def active(self) -> bool:
        return not self._start_after

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def matcher(self):
        if self._matcher is None:
            xgr = _xgrammar()
            self._matcher = xgr.GrammarMatcher(self._compiled.result())  # rolls back any number of tokens
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def valid_prefix(self, drafts: Sequence[int]) -> list[int]:
        """The leading drafts the grammar admits (the rest could never be accepted). Before the grammar
        applies: the drafts up to the end of the reasoning, if they reach it (the grammar masks the rest
        from the next step on)."""
        if not self.active:
            tag, recent = self._start_after, self._recent[-len(self._start_after) :]
            seen = recent + list(drafts)
            for end in range(len(recent) + 1, len(seen) + 1):
                if seen[max(0, end - len(tag)) : end] == tag:
                    return list(drafts[: end - len(recent)])
            return list(drafts)
        matcher = self.matcher
        n = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return list(drafts[:n])

    def bitmask(self, drafts: Sequence[int] = ()) -> torch.Tensor | None:
        """int32 [len(drafts) + 1, ceil(vocab / 32)]: bit t of row j set when token t may follow the
        outputs and drafts[:j] (xgrammar's layout); None while the reasoning runs. The drafts must be
        admitted (`valid_prefix`)."""
        if not self.active:
            return None
        xgr = _xgrammar()
        matcher = self.matcher
        mask = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        for j, token in enumerate(drafts):
            matcher.accept_token(token)
            matcher.fill_next_token_bitmask(mask, j + 1)
        if drafts:
            matcher.rollback(len(drafts))
        return mask

    def accept(self, token_ids: Iterable[int]) -> None:
        """Advance over a step's new tokens (each was sampled under this grammar's mask)."""
        token_ids = list(token_ids)
        while token_ids and not self.active:  # the reasoning: watch for its end
            self._recent.append(token_ids.pop(0))
            if self._recent[-len(self._start_after) :] == self._start_after:
                self._start_after, self._recent = [], []
        if not token_ids:
            return
        matcher = self.matcher
        for token in token_ids:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(token):
                logger.warning(
                    "a grammar did not accept token %d it allowed; its output may not match", token
                )
                return
