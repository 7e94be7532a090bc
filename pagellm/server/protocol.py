"""The OpenAI-compatible request and response bodies (pydantic), and how a request becomes SamplingParams.

Requests take OpenAI's fields plus pagellm's own sampling fields as extra body fields (as vLLM does);
fields neither knows are ignored, the way OpenAI-compatible clients expect.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)

from pagellm.core.errors import ConfigError
from pagellm.sampling.params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagellm.server.tool_parsers import tool_choice_schema

TokenIds = list[StrictInt]  # JSON true/false and 1.0 are not token ids
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's chat roles


def valid_unicode(value: Any) -> Any:
    """Refuse lone UTF-16 surrogates ("\\ud800" is valid JSON, but no tokenizer can encode it) in a string
    or a list of strings; other values pass untouched."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"has a lone UTF-16 surrogate at index {exc.start}; send valid Unicode"
                ) from None
    return value


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: text (no constraint), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # pagellm's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # disaggregated prefill/decode: passed to the engine's KV connector (docs/serving.md)
    kv_transfer_params: dict[str, Any] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one grammar this request asks for, from whichever field names it; ValueError for two."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            given["response_format"] = (
                {"json": rf.json_schema.schema_} if rf.type == "json_schema" else {"json": {"type": "object"}}
            )
        if self.structured_outputs:
            given["structured_outputs"] = self.structured_outputs
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                given[name] = {key: value}
        if len(given) > 1:
            raise ConfigError(
                f"give one of {', '.join(given)}, not several: each constrains the whole output",
                param=next(iter(given)),
            )
        if not given:
            return None
        ((name, value),) = given.items()
        try:
            return StructuredOutputsParams(**value)
        except TypeError as e:  # an unknown key
            raise ConfigError(
                f"{name}: {e}; valid keys: json, regex, choice, grammar, json_object, structural_tag",
                param=name,
            ) from None

    def _sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None, **extra: Any
    ) -> SamplingParams:
        """SamplingParams for this request over the model's defaults; raises ValueError naming the field."""
        fields: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "output_kind": "delta" if self.stream else "final_only",
            "structured_outputs": self._structured_outputs(),
            **extra,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            fields[name] = getattr(defaults, name) if value is None else value
        return SamplingParams(**fields)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # sample this many, answer the n with the highest cumulative logprob
    suffix: str | None = None  # fill in the middle, between prompt and suffix
    # beam search (vLLM's extension): n beams, ranked as transformers' generate(num_beams=n) ranks them
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    _valid_prompt = field_validator("prompt", "suffix")(valid_unicode)

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        logprobs, n = self.logprobs, self.n
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ConfigError(f"best_of must be >= n ({self.n}), got {self.best_of}", param="best_of")
            if self.stream and self.best_of > self.n:
                raise ConfigError(
                    "best_of greater than n cannot stream: the best samples are known at the end",
                    param="best_of",
                )
            if self.best_of > self.n and logprobs is None:
                logprobs = 0  # the engine then reports each sampled token's logprob, to rank the samples
            n = self.best_of
        return self._sampling_params(
            defaults, self.max_tokens, logprobs, prompt_logprobs=prompt_logprobs, n=n
        )

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """use_beam_search's params (`n` beams, greedy); ValueError naming the field that cannot go with it."""
        if self.stream:
            raise ConfigError(
                "stream cannot go with use_beam_search: the beams are ranked at the end", param="stream"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise ConfigError(
                "best_of must be unset (or n) with use_beam_search, which answers n beams", param="best_of"
            )
        if self.temperature not in (None, 0):
            raise ConfigError(
                f"temperature must be 0 or unset with use_beam_search, got {self.temperature}",
                param="temperature",
            )
        changes = {
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": None if self.repetition_penalty == 1 else self.repetition_penalty,
            "response_format": self.response_format and self.response_format.type != "text",
            "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        for name, value in changes.items():
            if value:
                raise ConfigError(
                    f"{name} cannot go with use_beam_search, which ranks beams by log-probability alone",
                    param=name,
                )
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )

    @property
    def samples_field(self) -> str:
        """The field that sets how many samples run: best_of when given, else n."""
        return "n" if self.best_of is None else "best_of"

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts: strings or token-id lists."""
        return as_prompt_list(self.prompt)


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    _valid_content = field_validator("content")(valid_unicode)

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        """Only an assistant message (one that called tools) may come without content, as in OpenAI's API."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (vLLM's field)
    add_generation_prompt: bool = True

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs set to true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(defaults, max_tokens, logprobs)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto when tools are given, else none."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """tool_choice required or a named function: a grammar over the tools' schemas (vLLM's way)."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return super()._structured_outputs()
        if not self.tools:
            raise ConfigError("tool_choice needs tools", param="tool_choice")
        functions = [t.function.model_dump() for t in self.tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {f["name"] for f in functions}:
            raise ConfigError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        if super()._structured_outputs() is not None:
            raise ConfigError(
                "tool_choice required or a named function sets the output's grammar; drop response_format",
                param="tool_choice",
            )
        named = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
        schema = tool_choice_schema(functions, named, self.parallel_tool_calls)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)  # calls need no layout


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    _valid_prompt = field_validator("prompt")(valid_unicode)


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


class EmbeddingRequest(OpenAIModel):
    """OpenAI's embeddings request; `normalize` (vLLM's) overrides the model's normalisation."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    priority: int = 0

    _valid_input = field_validator("input")(valid_unicode)

    def inputs(self) -> list[str | list[int]]:
        """The input field as a list of prompts: strings or token-id lists."""
        return as_prompt_list(self.input)


# -- responses ------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class LoadLoRARequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(OpenAIModel):
    lora_name: str = Field(min_length=1)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # what the engine's KV connector returned (a prefill engine: where the decode engine fetches the KV)
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # the thinking, with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reasoning_content(self) -> str | None:
        """The thinking again, under the name DeepSeek's API and older vLLM give it (clients read either)."""
        return self.reasoning


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(BaseModel):
    """Serialises only what it carries: {"role": ...}, {"content": ...} or {} (OpenAI's chunk deltas)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool-call deltas (index, id, type, function)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reasoning_content(self) -> str | None:
        """`reasoning` under its other name, as `ChatResponseMessage` sends it."""
        return self.reasoning

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str: base64 of the little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, api_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which the /v1/messages paths answer with."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def as_prompt_list(value: str | list) -> list[str | list[int]]:
    """A prompt field (a string, strings, token ids or lists of them) as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(p, int) for p in value):
        return [list(value)]  # one prompt of token ids
    return list(value)
