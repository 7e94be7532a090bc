"""The request and response bodies of Ollama's API (`/api/...`, serving_ollama.py), as Ollama's docs and its
official Python client (`ollama._types`) write them. Requests ignore fields they do not know, as Ollama
does; responses leave out what they do not carry (`exclude_none`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from pagellm.server.protocol import ChatTool, valid_unicode

Format = Literal["", "json"] | dict[str, Any] | None  # "json": any JSON; an object: a JSON schema


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OllamaOptions(OllamaModel):
    """Ollama's `options`: the sampling ones map onto the engine's; the load and hardware ones (num_ctx,
    num_gpu, num_thread, use_mmap...) are the server's to set and are ignored here (`model_extra`)."""

    model_config = ConfigDict(extra="allow")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1: no limit; -2: fill the context
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # sampling pagellm does not do: refused unless they ask for what pagellm does anyway
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None


class OllamaMessage(OllamaModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # base64, no data: prefix
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"function": {"name", "arguments": {...}}}]
    tool_name: str | None = None

    _valid_content = field_validator("content", "thinking")(valid_unicode)


class _GenerateFields(OllamaModel):
    model: str | None = None
    format: Format = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: float | str | None = None  # accepted: the served model stays loaded while the server runs
    think: bool | str | None = None


class OllamaChatRequest(_GenerateFields):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ChatTool] | None = None


class OllamaGenerateRequest(_GenerateFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[StrictInt] | None = None
    raw: bool = False
    images: list[str] | None = None

    _valid_prompt = field_validator("prompt", "suffix", "system")(valid_unicode)


class OllamaEmbedRequest(OllamaModel):
    model: str | None = None
    input: str | list[str]
    truncate: bool = True  # cut an input longer than the context to fit, as Ollama does
    dimensions: int | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None

    _valid_input = field_validator("input")(valid_unicode)


class OllamaShowRequest(OllamaModel):
    model: str | None = None
    name: str | None = None  # the field's older name
    verbose: bool = False


# -- responses ------------------------------------------------------------------------------------------


class OllamaToolFunction(BaseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCall(BaseModel):
    function: OllamaToolFunction


class OllamaResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None


class _Timings(BaseModel):
    """What the last line (or the whole answer) reports: durations in nanoseconds and token counts."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatResponse(_Timings):
    message: OllamaResponseMessage


class OllamaGenerateResponse(_Timings):
    response: str = ""
    thinking: str | None = None


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class OllamaModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTagsResponse(BaseModel):
    models: list[OllamaModelEntry]


class OllamaRunningModel(OllamaModelEntry):
    expires_at: str
    context_length: int


class OllamaPsResponse(BaseModel):
    models: list[OllamaRunningModel]


class OllamaShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersionResponse(BaseModel):
    version: str


class OllamaErrorResponse(BaseModel):
    error: str
