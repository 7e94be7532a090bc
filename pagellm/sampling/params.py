"""`SamplingParams`: how one request chooses its tokens and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pagellm.core.errors import ConfigError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
_LOGPROBS_RANGE = f"must be in [0, {MAX_LOGPROBS}]"
# what a torch.Generator takes as a seed: any 64-bit value, signed or not (-1 and 2**64 - 1 are one seed)
SEED_MIN, SEED_END = -(2**63), 2**64
TOP_K_END = 2**63  # top_k becomes an int64 tensor; any k >= the vocabulary size means off
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # of StructuredOutputsParams


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names): exactly one of a JSON schema, any JSON object, a
    regular expression, one of a list of strings, an EBNF grammar (xgrammar's GBNF dialect), or an xgrammar
    structural tag (a format of tagged parts, such as a harmony reply's messages: unlike the others it
    describes the whole reply, thinking included, so it applies from the first token even with a reasoning
    parser)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens (compact output)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k)]
        if len(given) != 1:
            raise ConfigError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object or "
                "structural_tag" + (f", got {', '.join(given)}" if given else ""),
                param="structured_outputs",
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise ConfigError(
                "structured_outputs.choice must be a list of non-empty strings", param="structured_outputs"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.logit_bias:
            # JSON object keys arrive as strings.
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        max_tokens = self.max_tokens
        bias = self.logit_bias or {}
        rules = (
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", 0 <= self.temperature < math.inf, "must be a finite number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k < TOP_K_END, f"must be -1 or 0 (off) or in [1, {TOP_K_END})"),
            (
                "seed",
                self.seed is None or SEED_MIN <= self.seed < SEED_END,
                f"must be in [{SEED_MIN}, {SEED_END})",
            ),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "must be a finite number > 0"),
            ("max_tokens", max_tokens is None or max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                max_tokens is None or self.min_tokens <= max_tokens,
                f"must be <= max_tokens ({max_tokens})",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, _LOGPROBS_RANGE),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                _LOGPROBS_RANGE,
            ),
            ("stop", all(self.stop), "strings must be non-empty"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            ("logit_bias", all(t >= 0 for t in bias), "keys must be token ids >= 0"),
            ("logit_bias", all(-100 <= v <= 100 for v in bias.values()), "values must be in [-100, 100]"),
            ("output_kind", self.output_kind in OUTPUT_KINDS, f"must be one of {', '.join(OUTPUT_KINDS)}"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"{name} {rule}, got {getattr(self, name)!r}", param=name)

    def validate_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids the model cannot produce; the engine calls this once it knows the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ConfigError(
                    f"{name} token ids must be < the vocabulary size {vocab_size}, got {bad}", param=name
                )

    @property
    def greedy(self) -> bool:
        """Temperature near zero means argmax; the other sampling knobs are then ignored."""
        return self.temperature < _GREEDY_EPS

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Token ids that finish this request: `stop_token_ids`, and the model's EOS unless `ignore_eos`."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: n=1 and a seed of its own (seed + index,
        wrapped into the seed range, so the last seeds of the range still make n valid seeds)."""
        seed = None if self.seed is None else (self.seed + index) % SEED_END
        return replace(self, n=1, seed=seed)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """How `LLM.beam_search` searches (vLLM's names, plus transformers' `early_stopping`).

    It keeps the `beam_width` sequences with the highest cumulative log-probability, for up to `max_tokens`
    tokens; a beam that samples an EOS token (unless `ignore_eos`) is finished. Finished beams rank by
    `cum_logprob / generated_tokens ** length_penalty` (the EOS token counted), as in transformers.
    `early_stopping` is transformers' rule for when to stop: False (its default) stops once `beam_width`
    beams are finished and the best running beam, at its current length, cannot beat the worst of them;
    True stops as soon as `beam_width` beams are finished; "never" stops only when no running beam can
    beat them at any length (the exhaustive search). Beam search is deterministic: `temperature` (kept for
    vLLM's signature) must be 0, and the model's sampling defaults do not apply."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        rules = (
            ("beam_width", _is_int(self.beam_width) and self.beam_width >= 1, "must be an integer >= 1"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", self.temperature == 0, "must be 0: beam search is deterministic"),
            ("length_penalty", math.isfinite(self.length_penalty), "must be a finite number"),
            (
                "early_stopping",
                isinstance(self.early_stopping, bool) or self.early_stopping == "never",
                'must be true, false or "never"',
            ),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"{name} {rule}, got {getattr(self, name)!r}", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
