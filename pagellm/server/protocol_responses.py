"""OpenAI's Responses API bodies (`/v1/responses`): the request, the response and its output items.

The request's fields pagellm does not serve (built-in tools, `background`, `include`, ...) are refused by
their validators with a 400 naming the field, rather than ignored: a client that asks for them would get
something else than it asked for. The response models carry what the official client's types read.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagellm.server.protocol import OpenAIModel, valid_unicode

# tool types OpenAI runs itself (or on a client's computer): pagellm serves function tools only
_BUILT_IN_TOOLS = "web_search, file_search, code_interpreter, computer_use, image_generation, mcp, shell, ..."


def _refused(value: Any, name: str, why: str) -> Any:
    if value not in (None, False, [], {}):
        raise ValueError(f"{name} is not supported: {why}")
    return value


class FunctionTool(OpenAIModel):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class ReasoningOptions(OpenAIModel):
    """`effort` goes to the chat template as `reasoning_effort` (GPT-OSS's reads it)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None

    _no_summary = field_validator("summary")(
        lambda v: _refused(v, "reasoning.summary", "the reasoning comes whole, as reasoning_text content")
    )


class TextFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", serialize_by_alias=True)  # `schema` shadows BaseModel's

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None

    _no_verbosity = field_validator("verbosity")(
        lambda v: _refused(v, "text.verbosity", "a model here has no verbosity setting")
    )


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # default: stored when the server keeps responses (--enable-responses-store)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # pagellm's own sampling fields, as on the chat endpoint (the official client: extra_body)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    priority: int = 0
    # refused when set: what pagellm does not do
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt: dict[str, Any] | None = None
    conversation: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    _valid_text = field_validator("input", "instructions")(valid_unicode)

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(
                    f"tools[{i}] is of type {kind!r}: only function tools are supported, not built-in tools "
                    f"({_BUILT_IN_TOOLS})"
                )
            FunctionTool.model_validate(tool)
        return tools

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        return _refused(value, "background", "responses run while their request is open; send stream: true")

    @field_validator("include")
    @classmethod
    def _no_include(cls, value: list[str] | None) -> list[str] | None:
        return _refused(value, "include", "no extra output data (encrypted reasoning, logprobs, sources)")

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("truncation 'auto' is not supported: a prompt too long for the context is a 400")
        return value

    @field_validator("prompt", "conversation", "max_tool_calls", "top_logprobs")
    @classmethod
    def _not_served(cls, value: Any, info: Any) -> Any:
        return _refused(value, info.field_name, "pagellm does not serve it on /v1/responses")

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)  # never written: the reasoning comes whole in content
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    cache_write_tokens: int = 0  # prompt tokens computed and kept in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response as OpenAI's API returns it (`openai.types.responses.Response`)."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    completed_at: float | None = None
    status: Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    store: bool = False
    user: str | None = None


def item_id(prefix: str, response_id: str, index: int) -> str:
    """The id of a response's `index`th output item: rs_, msg_ or fc_ and the response's own."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{index}"
