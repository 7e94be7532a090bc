"""The processor: what a caller passes to `LLMEngine.add_request` becomes the engine's `Request`s.

It tokenizes the prompt (text, token ids or `{"prompt_token_ids": [...]}`), validates it with its
parameters (a `ConfigError` that says what to change, before anything is queued; a pooling request's
parameters resolved against the engine's `Pooler`), and makes the requests: one for n = 1 or a pooling
request, else n child requests `id#0`, `id#1`, ..., each with its own seed, and each with its grammar's
matcher when the output is constrained.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.pooling import Pooler, PoolerConfig, PoolingParams, classifier_of, resolve_pooler
from pagellm.engine.images import PromptImages
from pagellm.engine.request import Request
from pagellm.lora.request import LoRARequest
from pagellm.models.layers.rotary import rope_salt_function
from pagellm.models.loader import import_model_class
from pagellm.multimodal.inputs import ImageInput
from pagellm.sampling.params import SamplingParams
from pagellm.structured_output import grammar
from pagellm.worker.step import EngineSetup

logger = logging.getLogger("pagellm")


class PromptTooLongError(ConfigError):
    """A prompt (plus any requested output) does not fit the model's context."""


def check_length(n: int, max_tokens: int | None, max_model_len: int) -> None:
    """PromptTooLongError when a prompt of `n` tokens, with room for at least one output token and for
    `max_tokens` when given, does not fit `max_model_len`. A server checks it before it queues a request too:
    a request that can never run must get 400, not the 503 and Retry-After of a full queue."""
    if n >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {n} tokens but this model's context is {max_model_len} tokens "
            f"(max_model_len), which must also hold at least one output token; shorten the prompt",
            param="prompt",
        )
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"the prompt has {n} tokens and max_tokens is {max_tokens}, but the context is "
            f"{max_model_len} tokens (max_model_len); lower max_tokens to at most {max_model_len - n} "
            f"or shorten the prompt",
            param="max_tokens",
        )


@dataclass
class ProcessedPrompt:
    """A prompt tokenized and validated with its parameters, not yet a request."""

    prompt: str | None  # the text, when it came as text
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # pooling: resolved (pooling_type, normalize filled in)
    kv_transfer_params: dict[str, Any] | None = None  # for the KV connector (n = 1 only)
    images: list[ImageInput] = field(default_factory=list)  # in prompt order


def make_pooler(setup: EngineSetup) -> Pooler | None:
    """runner="pooling": the pooling from pooler_config and the model's files (checked before any weight
    loads); None for a generating engine."""
    config: EngineConfig = setup.config
    if config.runner != "pooling":
        if config.pooler_config not in (None, "", {}):
            raise ConfigError("pooler_config applies to embeddings; start with runner='pooling' to use it")
        if classifier_of(setup.hf_config) is not None:
            raise ConfigError(
                f"{setup.hf_config.architectures[0]} classifies rather than generates: start it with "
                "runner='pooling' (/classify, /v1/score, /v1/rerank)"
            )
        return None
    if config.speculative_config not in (None, "", {}):
        raise ConfigError(
            "speculative_config: runner='pooling' generates no tokens to speculate; leave it out"
        )
    override = PoolerConfig.parse(config.pooler_config)
    pooler = resolve_pooler(setup.source.directory, setup.hf_config, override)
    if pooler.classifier is not None and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ConfigError(
            "a classification model runs on one rank: leave tensor and pipeline parallelism at 1"
        )
    logger.info(
        "pooling runner: %s pooling, %snormalized (from %s)",
        pooler.pooling_type,
        "" if pooler.normalize else "not ",
        pooler.source,
    )
    return pooler


class Processor:
    def __init__(self, setup: EngineSetup, tokenizer: Any, eos_token_ids: set[int], pooler: Pooler | None):
        self.tokenizer = tokenizer
        self.rope_salt_of = rope_salt_function(setup.hf_config)  # a length-dependent rope's KV key
        self.vocab_size = setup.hf_config.vocab_size
        self.max_model_len = setup.max_model_len
        self.eos_token_ids = eos_token_ids
        if pooler is not None and pooler.classifier is not None:  # classifier_from_token's ids
            pooler = dataclasses.replace(pooler, classifier=pooler.classifier.with_token_ids(tokenizer))
        self.pooler = pooler  # None unless runner="pooling"
        self._grammar_compiler: grammar.GrammarCompiler | None = None
        parser = setup.reasoning_parser
        # a grammar applies after these tokens: the end of the reasoning, when a reasoning parser is set
        self._reasoning_end = tokenizer.encode(parser.end_tag, add_special_tokens=False) if parser else []
        model_class = import_model_class(setup.model_class_path)
        self.images: PromptImages | None = None  # a model that takes images
        if getattr(model_class, "supports_images", False):
            model_config = setup.model_config if setup.model_config is not None else setup.hf_config
            limit, config = setup.config.image_limit, setup.config
            # images that must run in one step: no longer than the budget (unchunked, any prompt fits)
            whole = model_class.bidirectional_images and config.enable_chunked_prefill
            self.images = PromptImages(
                model_class,
                model_config,
                setup.source.directory,
                limit,
                config.token_budget if whole else None,
            )

    def process(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams | PoolingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """Tokenize and validate; ConfigError (nothing queued) for invalid input. `kv_transfer_params` may
        also come in the prompt dict (how AsyncLLM's callers pass it); a pooling request takes none."""
        text, prompt_token_ids, images = self.read_prompt(prompt)
        if isinstance(params, PoolingParams):
            if images:
                raise ConfigError(
                    "embeddings of prompts with images are not supported", param="multi_modal_data"
                )
            return ProcessedPrompt(text, prompt_token_ids, self.validate(prompt_token_ids, params))
        self.validate(prompt_token_ids, params)
        if kv_transfer_params is None and isinstance(prompt, dict):
            kv_transfer_params = prompt.get("kv_transfer_params")
        if kv_transfer_params is not None and (not isinstance(kv_transfer_params, dict) or params.n > 1):
            raise ConfigError(
                "kv_transfer_params must be a JSON object, on a request with n = 1",
                param="kv_transfer_params",
            )
        return ProcessedPrompt(text, prompt_token_ids, params, kv_transfer_params, images)

    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text if it came as text, its token ids: image placeholders expanded)."""
        return self.read_prompt(prompt)[:2]

    def read_prompt(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int], list[ImageInput]]:
        """`tokenize`, and the prompt's images (`{"prompt": text, "multi_modal_data": {"image": ...}}`, with
        `"add_special_tokens": False` for a chat template's output)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            return self._read_images(prompt)
        return (*self._tokenize(prompt), [])

    def _read_images(self, prompt: dict) -> tuple[str | None, list[int], list[ImageInput]]:
        data = prompt["multi_modal_data"]
        if self.images is None:
            raise ConfigError("this model takes no images; send text only", param="multi_modal_data")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ConfigError(
                'multi_modal_data: expected {"image": image or [images]}', param="multi_modal_data"
            )
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ConfigError(
                "a prompt with images must be text (its image placeholders are expanded to the images' tokens)",
                param="prompt",
            )
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        token_ids, inputs = self.images.process(text, images, bool(prompt.get("add_special_tokens", True)))
        return text, token_ids, inputs

    def _tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> SamplingParams | PoolingParams:
        """Reject what cannot run, with a message that says what to change; returns the params, a pooling
        request's with the model's choices filled in."""
        self._check_runner(params)
        if isinstance(params, PoolingParams):
            return self._validate_pooling(prompt_token_ids, params)
        self._check_prompt_ids(prompt_token_ids)
        params.validate_token_ids(self.vocab_size)
        if params.structured_outputs is not None:
            grammar.check(params.structured_outputs)
        check_length(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        return params

    def _check_prompt_ids(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty; give at least one token", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt token id {bad[0]} is out of range for the vocabulary of {self.vocab_size} tokens",
                param="prompt",
            )

    def _check_runner(self, params: SamplingParams | PoolingParams) -> None:
        """A generating engine takes SamplingParams, a pooling one PoolingParams (as vLLM: one task each)."""
        if isinstance(params, PoolingParams) and self.pooler is None:
            raise ConfigError(
                "embeddings need an engine started with runner='pooling' (LLM(model, runner='pooling'), "
                "pagellm serve --runner pooling); this one generates text"
            )
        if not isinstance(params, PoolingParams) and self.pooler is not None:
            raise ConfigError(
                "this engine was started with runner='pooling': it computes embeddings (LLM.embed, "
                "/v1/embeddings) and generates no text; start another with runner='generate' to generate"
            )

    def _validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> PoolingParams:
        """The checks of `validate` for an embedding request; returns its params with the model's choices
        filled in. A pooling prompt may fill the whole context: nothing is generated after it."""
        self._check_prompt_ids(prompt_token_ids)
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but this model's context is {self.max_model_len} tokens "
                f"(max_model_len); shorten the prompt",
                param="prompt",
            )
        return self.pooler.resolve(params)

    def make_requests(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        external_request_id: str | None = None,
    ) -> list[Request]:
        """The requests the scheduler runs: a pooling request's one (no sampling state), or the n samples
        of a generation request, each with its own seed and, for structured output, its grammar (compiling
        starts now). `request_id` is the engine's (sample i of n > 1 gets `request_id#i`),
        `external_request_id` the caller's, which every sample's outputs carry."""
        params = processed.params
        salt_of = self.rope_salt_of
        rope_salt = (
            salt_of(len(processed.prompt_token_ids), len(processed.prompt_token_ids)) if salt_of else None
        )
        if isinstance(params, PoolingParams):
            request = Request(
                request_id,
                processed.prompt_token_ids,
                None,
                (),
                arrival_time,
                priority,
                lora_request,
                pooling_params=params,
                external_request_id=external_request_id,
            )
            request.rope_salt_of, request.rope_salt = salt_of, rope_salt
            return [request]
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.for_sample(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                Request(
                    child_id,
                    processed.prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    arrival_time,
                    priority,
                    lora_request,
                    kv_transfer_params=processed.kv_transfer_params,
                    images=processed.images,
                    external_request_id=external_request_id,
                )
            )
        mrope = self.images.mrope(processed.prompt_token_ids, processed.images) if self.images else None
        for child in children:
            child.rope_salt_of, child.rope_salt = salt_of, rope_salt
            if mrope is not None:
                child.mrope_positions, child.mrope_delta = mrope
        if params.structured_outputs is not None:
            # a structural tag describes the whole reply, the thinking included: it applies from the start
            whole = params.structured_outputs.kind == "structural_tag"
            for child in children:
                child.grammar = self._grammars().request_grammar(
                    params.structured_outputs, [] if whole else self._reasoning_end
                )
        return children

    @property
    def grammar_matchers_live(self) -> int:
        """Requests' grammars (matchers) still in memory: 0 once every structured-output request is gone,
        unless something still references a finished request."""
        return 0 if self._grammar_compiler is None else self._grammar_compiler.num_live

    def _grammars(self) -> grammar.GrammarCompiler:
        """The structured-output compiler, made on the first request with a grammar."""
        if self._grammar_compiler is None:
            self._grammar_compiler = grammar.GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler
