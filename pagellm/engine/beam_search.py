"""Beam search on the engine, the way vLLM builds it: each step runs every live beam as a request of one
token with its top log-probabilities, expands the beams by those tokens and keeps the best.

A beam's request is its prompt plus the tokens it has so far, so the prefix cache serves all of it but the
last, partly filled block: beams share their prompt's (and common history's) KV blocks by reference
count, and each step computes about one new token's KV per beam. Only `generate` calls are needed, so the
same search runs on `LLM` (one engine or data-parallel engines) and on `AsyncLLM` (the server).

The expansion and pruning follow transformers' `generate(num_beams=...)` (its `_beam_search`), which is
the oracle the tests compare with; see `BeamSearchParams` for the rules. `BeamSearch` is one prompt's
search, driven from outside (`pending`, then `advance` with the results); `beam_search` and
`beam_search_async` drive a batch of them over a step function, one engine call for all their beams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.errors import ConfigError
from pagellm.engine.outputs import Logprob, RequestOutput
from pagellm.engine.processor import PromptTooLongError
from pagellm.sampling.params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

TopLogprobs = dict[int, Logprob]  # the top next tokens of one sequence: token id -> its log-probability
# one step: the top `k` next-token log-probabilities of each token sequence, in order
Step = Callable[[list[list[int]], int], list[TopLogprobs]]
AsyncStep = Callable[[list[list[int]], int], Awaitable[list[TopLogprobs]]]


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): `tokens` are the prompt's then the generated ones; `logprobs` has, for each
    generated token, the top log-probabilities of its step; `text` is the generated text (without the EOS
    token). `score` is what beams rank by: cum_logprob / len(output_token_ids) ** length_penalty."""

    tokens: list[int]
    logprobs: list[TopLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": it ended with an EOS token; "length": at max_tokens
    stop_reason: int | None = None  # the EOS token id that ended it
    num_prompt_tokens: int = 0
    score: float = 0.0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (beam_width of them)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[TopLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0


class BeamSearch:
    """One prompt's search. `pending()` lists the sequences whose next-token log-probabilities it needs
    (the top `num_logprobs` of each); `advance()` takes them in that order; `done` once it has its beams.

    Per step, as transformers: candidates are every running beam extended by one token, ranked by
    cumulative log-probability. Of the best `beam_width`, those that end (an EOS token, or max_tokens
    reached) join the finished beams, scored cum / generated_length ** length_penalty (the EOS counted),
    of which the best `beam_width` are kept; the best `beam_width` candidates that do not end run on.
    Each beam's top `beam_width + number of EOS tokens` next tokens are enough to find both sets (a
    candidate among the best `beam_width` that do not end has at most that many better ones in its beam),
    so that is all a step asks for."""

    def __init__(
        self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Iterable[int]
    ):
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.stop_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_logprobs = params.beam_width + len(self.stop_ids)
        if self.num_logprobs > MAX_LOGPROBS:
            raise ConfigError(
                f"beam_width must be <= {MAX_LOGPROBS - len(self.stop_ids)} (each step reads the top beam_width "
                f"+ {len(self.stop_ids)} EOS log-probabilities, at most {MAX_LOGPROBS}), got {params.beam_width}",
                param="beam_width",
            )
        self.running = [_Beam()]
        self.finished: list[tuple[float, _Beam]] = []  # (score, beam), best first
        self.num_steps = 0
        self.done = False

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + beam.tokens for beam in self.running]

    def advance(self, tops: Sequence[TopLogprobs]) -> None:
        width, penalty = self.params.beam_width, self.params.length_penalty
        candidates = []
        for beam, top in zip(self.running, tops, strict=True):
            ranked = sorted(top.items(), key=lambda item: item[1].logprob, reverse=True)
            for token, entry in ranked[: self.num_logprobs]:
                candidates.append((beam.cum_logprob + entry.logprob, beam, token, top))
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.num_steps += 1
        length = self.num_steps  # generated tokens, the new one included
        last = length >= self.params.max_tokens

        def extend(c: tuple[float, _Beam, int, TopLogprobs]) -> _Beam:
            cum, beam, token, top = c
            return _Beam(beam.tokens + [token], beam.logprobs + [top], cum)

        for c in candidates[:width]:
            if last or c[2] in self.stop_ids:
                self.finished.append((c[0] / length**penalty, extend(c)))
        self.finished.sort(key=lambda f: f[0], reverse=True)
        del self.finished[width:]
        self.running = [extend(c) for c in candidates if c[2] not in self.stop_ids][:width]
        self.done = last or not self.running or self._cannot_improve(length)

    def _cannot_improve(self, length: int) -> bool:
        """transformers' early stop: only once beam_width beams are finished; then at once (True), or when
        the best running beam, scored at its current length (False) or at the length that scores best
        ("never"), does not beat the worst finished one."""
        params = self.params
        if len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        penalty = params.length_penalty
        if params.early_stopping == "never" and penalty > 0:
            length = params.max_tokens
        return self.running[0].cum_logprob / length**penalty <= self.finished[-1][0]

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """The best beam_width beams, best first (running ones only if too few finished)."""
        beams = list(self.finished)
        if len(beams) < self.params.beam_width:  # only when the vocabulary ran out of candidates
            penalty = self.params.length_penalty
            beams += [(b.cum_logprob / max(len(b.tokens), 1) ** penalty, b) for b in self.running]
            beams.sort(key=lambda f: f[0], reverse=True)
        sequences = []
        for score, beam in beams[: self.params.beam_width]:
            stopped = bool(beam.tokens) and beam.tokens[-1] in self.stop_ids
            text_ids = beam.tokens[:-1] if stopped else beam.tokens
            sequences.append(
                BeamSearchSequence(
                    tokens=self.prompt + beam.tokens,
                    logprobs=beam.logprobs,
                    cum_logprob=beam.cum_logprob,
                    text=tokenizer.decode(text_ids, skip_special_tokens=True),
                    finish_reason="stop" if stopped else "length",
                    stop_reason=beam.tokens[-1] if stopped else None,
                    num_prompt_tokens=len(self.prompt),
                    score=score,
                )
            )
        return BeamSearchOutput(sequences)


def beam_search(
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams | Sequence[BeamSearchParams],
    eos_token_ids: Iterable[int],
    step: Step,
    tokenizer: Any,
    on_step: Callable[[], None] | None = None,
) -> list[BeamSearchOutput]:
    """Search every prompt (token ids) at once: each step is one `step` call for all their live beams."""
    searches = _searches(prompts, params, eos_token_ids)
    while not all(s.done for s in searches):
        sequences, k = _pending(searches)
        _advance(searches, step(sequences, k))
        if on_step is not None:
            on_step()
    return [s.output(tokenizer) for s in searches]


async def beam_search_async(
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams | Sequence[BeamSearchParams],
    eos_token_ids: Iterable[int],
    step: AsyncStep,
    tokenizer: Any,
) -> list[BeamSearchOutput]:
    """`beam_search` over an async step function (e.g. `AsyncLLM.generate` calls, see `async_llm_step`)."""
    searches = _searches(prompts, params, eos_token_ids)
    while not all(s.done for s in searches):
        sequences, k = _pending(searches)
        _advance(searches, await step(sequences, k))
    return [s.output(tokenizer) for s in searches]


def _searches(
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams | Sequence[BeamSearchParams],
    eos_token_ids: Iterable[int],
) -> list[BeamSearch]:
    eos = frozenset(eos_token_ids)
    each = [params] * len(prompts) if isinstance(params, BeamSearchParams) else list(params)
    return [BeamSearch(p, q, eos) for p, q in zip(prompts, each, strict=True)]


def _pending(searches: list[BeamSearch]) -> tuple[list[list[int]], int]:
    live = [s for s in searches if not s.done]
    return [seq for s in live for seq in s.pending()], max(s.num_logprobs for s in live)


def _advance(searches: list[BeamSearch], tops: list[TopLogprobs]) -> None:
    at = 0
    for search in searches:
        if not search.done:
            n = len(search.running)
            search.advance(tops[at : at + n])
            at += n


def step_params(num_logprobs: int) -> SamplingParams:
    """What each beam's one-token request runs with: greedy, its top log-probabilities, none of the
    model's sampling defaults."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_logprobs, output_kind="final_only")


def next_token_logprobs(output: RequestOutput) -> TopLogprobs:
    """The top log-probabilities of a step request's one token; raises when the engine failed it."""
    sample = output.outputs[0]
    if output.error is not None or not sample.logprobs:
        raise RuntimeError(
            f"beam search step request {output.request_id} failed: {output.error or sample.finish_reason}"
        )
    return sample.logprobs[0]


def prompt_token_ids(prompt: str | dict | Sequence[int], tokenizer: Any) -> list[int]:
    """A prompt as `LLM.generate` takes it (a string, {"prompt_token_ids": [...]}, {"prompt": ...}) in token ids."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return [int(t) for t in prompt]


def check_fits(prompt_token_ids: Sequence[int], max_tokens: int, max_model_len: int) -> None:
    """Refuse, before any step runs, a prompt whose beams could not reach max_tokens in the context."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ConfigError("the prompt is empty; give at least one token", param="prompt")
    if n >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {n} tokens but this model's context is {max_model_len} tokens (max_model_len), "
            f"which must also hold at least one output token; shorten the prompt"
        )
    if n + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"the prompt has {n} tokens and max_tokens is {max_tokens}, but the context is {max_model_len} "
            f"tokens (max_model_len); lower max_tokens to at most {max_model_len - n} or shorten the prompt"
        )


def async_llm_step(
    llm: Any, request_id: str, priority: int = 0, lora_request: Any = None, min_logprobs: int = 0
):
    """A step function over `AsyncLLM.generate`: each sequence one request (ids `<request_id>-<step>-<i>`),
    all at once; cancelling the search aborts them."""
    steps = iter(range(1 << 62))

    async def step(sequences: list[list[int]], k: int) -> list[TopLogprobs]:
        params = step_params(max(k, min_logprobs))
        n = next(steps)

        async def one(i: int, sequence: list[int]) -> TopLogprobs:
            final = None
            async for output in llm.generate(
                {"prompt_token_ids": sequence}, params, f"{request_id}-{n}-{i}", priority, lora_request
            ):
                final = output
            assert final is not None
            return next_token_logprobs(final)

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, s)) for i, s in enumerate(sequences)]
        return [t.result() for t in tasks]

    return step
