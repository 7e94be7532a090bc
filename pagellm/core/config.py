"""`EngineConfig`: every engine setting, with the same names as the CLI flags and `LLM(...)` keywords.

The CLI builds its engine options from these fields (their `help` metadata), so a setting is declared
once. Platforms adjust it in `check_and_update_config`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagellm.core.dtype_names import DTYPE_NAMES, KV_CACHE_DTYPE_NAMES
from pagellm.core.errors import ConfigError
from pagellm.core.json_setting import json_setting

if TYPE_CHECKING:
    from pagellm.core.kv_connector import KVTransferConfig


# media items of each kind one prompt may carry unless limit_mm_per_prompt says otherwise: vLLM's default
MEDIA_ITEMS_PER_PROMPT = 999


NO_QUANTIZATION = "none"
"""--quantization none: no method; a GGUF file's blocks are widened to --dtype at load."""


@dataclass
class _MediaLimits:
    """The keys `limit_mm_per_prompt` takes."""

    image: int = MEDIA_ITEMS_PER_PROMPT


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None,
        "Hugging Face model id (ORG/NAME; GGUF: ORG/NAME:FILE.gguf or ORG/NAME:QUANT), local model directory "
        "or .gguf file; default: the embedded SmolLM2. Ids resolve in the Hugging Face cache, downloaded "
        "when missing unless HF_HUB_OFFLINE=1.",
    )
    revision: str | None = _opt(
        None, "Branch, tag or commit of a model given by Hugging Face id (default: main)."
    )
    tokenizer: str | None = _opt(
        None, "Tokenizer: a Hugging Face id or a local directory (default: the model's)."
    )  # start-up replaces an id with its local snapshot directory
    tokenizer_revision: str | None = _opt(
        None,
        "Branch, tag or commit of the tokenizer's repository (default: --revision for the model's, else main).",
    )
    download_dir: str | None = _opt(
        None,
        "Hugging Face cache directory for models given by id (default: $HF_HUB_CACHE, else $HF_HOME/hub).",
    )
    gguf_file: str | None = _opt(
        None, "GGUF file name inside --model's directory or Hugging Face repository."
    )
    dtype: str = _opt("auto", f"auto, {', '.join(DTYPE_NAMES)}.", choices=("auto", *DTYPE_NAMES))
    device: str = _opt(
        "auto", "Device platform (cpu, cuda, rocm, xpu, tpu or a plugin's), or auto.", envvar="PAGELLM_DEVICE"
    )
    attention_backend: str = _opt(
        "auto", "Attention backend name (see `pagellm plugins`), or auto.", envvar="PAGELLM_ATTENTION_BACKEND"
    )
    quantization: str | None = _opt(
        None,
        "Quantization method (see `pagellm plugins`); default: the checkpoint's, and for a .gguf file `gguf` "
        "(its blocks kept as they are). `none`: no method, a GGUF file's blocks widened to --dtype.",
    )
    block_size: int | None = _opt(
        None,
        "Tokens per KV-cache block; only attention backends that run it are candidates. Default: chosen "
        "with the backend, its preferred size (16; 256 for FLASH_ATTN).",
    )  # start-up sets the chosen size here, so it is an int once an engine runs
    kv_cache_dtype: str = _opt(
        "auto",
        f"KV-cache dtype: auto (the model's dtype) or {', '.join(KV_CACHE_DTYPE_NAMES)} (half the memory and traffic).",
        choices=("auto", *KV_CACHE_DTYPE_NAMES),
    )
    max_model_len: int | None = _opt(None, "Longest prompt + output (default: the model's).")
    max_num_seqs: int = _opt(256, "Most requests in one step.")
    max_num_batched_tokens: int | None = _opt(
        None, "Token budget of one step (default 2048, on CPU 512; at least max_num_seqs)."
    )
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts across steps within the token budget.")
    scheduling_policy: str = _opt("fcfs", "fcfs or priority.", choices=("fcfs", "priority"))
    kv_cache_space: float | None = _opt(None, "GiB of memory for the KV cache on CPU (default 4).")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of accelerator memory pagellm may use.")
    num_kv_blocks: int | None = _opt(
        None, "Exact number of KV-cache blocks, overriding the memory-based size."
    )
    seed: int = _opt(0, "Seed for sampling of requests that set none.")
    generation_config: str = _opt("auto", "auto: the model's generation_config.json defaults; pagellm: none.")
    tensor_parallel_size: int = _opt(
        1, "Ranks to split each layer over (heads, MLP columns, vocabulary); one process per rank."
    )
    enable_expert_parallel: bool = _opt(
        False,
        "Split mixture-of-experts layers over the tensor-parallel ranks by expert (each holds E/N experts "
        "whole) instead of sharding every expert's width.",
    )
    pipeline_parallel_size: int = _opt(1, "Ranks to split the layers over (stages); one process per rank.")
    data_parallel_size: int = _opt(1, "Engine copies behind one front end, each request on the least loaded.")
    distributed_executor_backend: str = _opt(
        "mp",
        "How ranks and engine copies are started: mp (processes on this machine) or ray (placed by Ray, "
        "across machines; `pip install pagellm[ray]`).",
        choices=("mp", "ray"),
    )
    distributed_timeout: float = _opt(
        60.0, "Seconds a rank may take to answer a step before the engine fails naming it."
    )
    speculative_config: dict[str, Any] | str | None = _opt(
        None,
        'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\' or '
        '\'{"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 3}\'.',
        json=True,
    )
    kv_transfer_config: dict[str, Any] | str | None = _opt(
        None,
        'Disaggregated prefill/decode or an external KV cache, as JSON: \'{"kv_connector": "shared_storage" '
        'or "zmq", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...}\' (docs/serving.md).',
        json=True,
    )
    max_waiting_requests: int | None = _opt(
        None,
        "A server's queue bound: with this many requests waiting to be scheduled, new ones are refused with "
        "503 and Retry-After (counted in pagellm:requests_rejected). Default: no bound.",
    )
    request_timeout: float | None = _opt(
        None,
        "A server's longest request, in seconds from when it is queued: past it the request is aborted, what "
        "it held is freed, and its client gets 408 (or an error event on a stream). Default: none.",
    )
    limit_mm_per_prompt: dict[str, Any] | str | None = _opt(
        None,
        "Most media items one prompt may carry, as JSON, e.g. '{\"image\": 4}' (default: 999 images, as "
        "vLLM's, for a model that takes images).",
        json=True,
    )
    allowed_local_media_path: str | None = _opt(
        None,
        "Folder whose files image URLs may name (file:// or a path); local files are refused without it.",
    )
    allowed_media_domains: list[str] | None = _opt(
        None, "A host that http(s) image URLs may name (repeatable; default: any public host)."
    )
    enable_lora: bool = _opt(False, "Serve LoRA adapters (PEFT format) chosen per request.")
    max_loras: int = _opt(1, "LoRA adapters one step may use (device slots).")
    max_lora_rank: int = _opt(16, "Largest LoRA rank accepted.")
    max_cpu_loras: int | None = _opt(None, "LoRA adapters kept loaded in memory (default: max_loras).")
    reasoning_parser: str | None = _opt(
        None,
        "Split replies into reasoning and content (deepseek_r1, qwen3, openai_gptoss, or a plugin's); a "
        "grammar (structured output) applies only after the reasoning ends.",
    )
    enforce_eager: bool = _opt(
        False,
        "Never compile or capture graphs: faster start-up, slower steps.",
        envvar="PAGELLM_ENFORCE_EAGER",
    )
    compile_in_background: bool = _opt(
        False,
        "Serve on the eager forward at once and compile the model in a process of its own, swapping the "
        "compiled forward in between two steps when it is ready (default for serve). A compiled forward "
        "saved by an earlier start is loaded in either case.",
    )
    native_decode: bool = _opt(
        True,
        "Run a decode step in one native call where the platform has one (CPU: one request's step of "
        "Llama-family and Qwen3-MoE models from GGUF files, or in bfloat16 on CPUs without AMX; a batch's "
        "step, and a step verifying speculative drafts, too where every linear is on the AVX-512 BF16 pair "
        "kernel; start-up says whether it applies "
        "and why); off: every step runs the model's forward.",
        envvar="PAGELLM_NATIVE_DECODE",
    )
    batch_invariant: bool = _opt(
        False,
        "A request's results do not depend on what else is in its batch (greedy tokens and logprobs the "
        "same alone or among others): kernels that sum in a fixed order whatever the batch. Costs speed; "
        "refused where the platform, model or quantization has no such kernels.",
    )
    runner: str = _opt(
        "generate",
        "generate (sample tokens) or pooling (embeddings: LLM.embed, /v1/embeddings; no tokens generated).",
        choices=("generate", "pooling"),
    )
    pooler_config: dict[str, Any] | str | None = _opt(
        None,
        'With --runner pooling: how hidden states become an embedding, as JSON, e.g. \'{"pooling_type": '
        '"MEAN", "normalize": false}\' (pooling_type LAST, MEAN or CLS); default: the model\'s '
        "sentence-transformers config (modules.json), else LAST, normalized.",
        json=True,
    )
    hf_overrides: dict[str, Any] | str | None = _opt(
        None,
        "Fields set on the model's Hugging Face config before it loads, as JSON (vLLM's), e.g. to serve "
        'Qwen3-Reranker as a reranker: \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'.',
        json=True,
    )

    @property
    def image_limit(self) -> int:
        """`limit_mm_per_prompt`'s images per prompt (checked: a ConfigError for a bad value)."""
        limits = json_setting(self.limit_mm_per_prompt, "limit_mm_per_prompt", _MediaLimits, '{"image": 4}')
        value = (limits or {}).get("image", MEDIA_ITEMS_PER_PROMPT)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"limit_mm_per_prompt.image: must be an integer >= 0, not {value!r}")
        return value

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed and checked (ConfigError when it cannot work), or None when off."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """`kv_transfer_config` parsed and checked (ConfigError naming the bad key), or None when off."""
        from pagellm.core.kv_connector import KVTransferConfig

        return KVTransferConfig.parse(self.kv_transfer_config)

    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule: max_num_batched_tokens (the platform may set it at start-up), else
        2048 (at least one per sequence)."""
        return self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)

    def step_tokens(self, max_model_len: int) -> int:
        """The most tokens one step runs (`step_tokens` of this config's budget)."""
        return step_tokens(self.token_budget, self.enable_chunked_prefill, max_model_len)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of valid ones. A setting
        not given takes its environment variable (e.g. PAGELLM_DEVICE) where it has one and it is set,
        as the CLI does."""
        from pagellm.core.errors import ConfigError

        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ConfigError(
                f"unknown engine setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(cls.field_names()))}"
            )
        for f in dataclasses.fields(cls):
            value = os.environ.get(f.metadata.get("envvar") or "")
            if f.name not in kwargs and value:
                kwargs[f.name] = value.strip().lower() in _TRUE if f.type == "bool" else value
        return cls(**kwargs)


_TRUE = ("1", "true", "yes", "on")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def step_tokens(token_budget: int, enable_chunked_prefill: bool, max_model_len: int) -> int:
    """The most tokens one step runs: the token budget, or without chunked prefill a whole prompt of up to
    max_model_len tokens when that is more. The scheduler schedules by it, and the runner sizes the KV
    cache and profiles memory with it."""
    return token_budget if enable_chunked_prefill else max(token_budget, max_model_len)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: how drafts are proposed and how many per step.

    ngram proposes the tokens that followed the latest earlier occurrence of the request's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens; draft_model runs a smaller model with the same
    vocabulary greedily; eagle3 runs an EAGLE-3 head (`model`: its directory) on the target's hidden
    states; mtp runs the checkpoint's own multi-token-prediction layer, or, for Gemma 4, the assistant
    checkpoint `model` names (docs/speculative-decoding.md). Either way the target model verifies every
    draft, so greedy output is unchanged."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        from pagellm.core.errors import ConfigError

        value = json_setting(value, "speculative_config", cls, '{"method": "ngram", ...}')
        if value is None:
            return None
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method: {method!r} is not a method; use one of {', '.join(SPECULATIVE_METHODS)}"
            )
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens: must be an integer >= 1, not {k!r}"
            )
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)  # one given: both that
        if method == "ngram":
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ConfigError(f"speculative_config.{name}: must be an integer >= 1, not {n!r}")
            if lo > hi:
                raise ConfigError(
                    f"speculative_config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
                )
        model = value.get("model")
        if method in ("draft_model", "eagle3") and not model:
            what = "the draft model's path" if method == "draft_model" else "the EAGLE-3 head's directory"
            raise ConfigError(f"speculative_config.model: {method} needs {what}")
        if method == "ngram" and model:
            raise ConfigError("speculative_config.model: ngram takes no model (did you mean draft_model?)")
        return cls(method, k, lo, hi, model)
