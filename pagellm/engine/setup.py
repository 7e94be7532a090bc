"""Start-up resolution: plugins, device, model config, dtype, quantization and attention backend.

Everything here runs before any weight is read, so a wrong `--device` or `--attention-backend` fails in
under a second, and `pagellm plugins --explain MODEL` can print the same decision.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import torch

from pagellm.core.attention import DEFAULT_BLOCK_SIZE, AttentionSpec
from pagellm.core.config import NO_QUANTIZATION, EngineConfig
from pagellm.core.dtypes import DTYPES, KV_CACHE_DTYPES, dtype_name
from pagellm.core.errors import ConfigError
from pagellm.core.kv_cache_spec import KVCacheLayout, group_layers
from pagellm.core.paths import cache_dir, keep_compiled_code_in_cache_dir
from pagellm.core.platform import GiB, Platform
from pagellm.core.selector import (
    BackendChoice,
    TimingCache,
    quant_method_reasons,
    select_attention_backend,
    select_platform,
    select_quant_method,
)
from pagellm.engine.default_model import default_model_path
from pagellm.models.gguf_checkpoint import blocks_kept_for
from pagellm.models.gguf_header import gguf_file_type
from pagellm.models.hub import gguf_path, hub_cache_dir, model_snapshot, parse_model_id, tokenizer_snapshot
from pagellm.models.layers.fused_moe.block import expert_count
from pagellm.models.layers.rotary import scaled_max_positions
from pagellm.models.loader import import_model_class, resolve_model_class
from pagellm.plugins import load_plugins
from pagellm.worker.step import EngineSetup, ModelSource

logger = logging.getLogger("pagellm")


def resolve_model_source(config: EngineConfig) -> ModelSource:
    """Where --model's files are: a local directory or .gguf file (these win over an id of the same
    spelling), else a Hugging Face id resolved in the Hugging Face cache, downloaded when missing and allowed
    (models/hub.py)."""
    model = config.model or default_model_path()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return _gguf_source(os.path.abspath(model))
    if os.path.isdir(model):
        return _local_directory_source(model, config.gguf_file)
    model_id = parse_model_id(model)
    if model_id is None:
        if model.endswith(".gguf"):
            raise ConfigError(f"--model {model}: no such GGUF file")
        raise ConfigError(
            f"--model {model}: not a local directory or .gguf file, nor a Hugging Face model id (ORG/NAME)"
        )
    cache = hub_cache_dir(config.download_dir)
    if model_id.gguf and config.gguf_file and model_id.gguf != config.gguf_file:
        raise ConfigError(f"--gguf-file {config.gguf_file}: --model {model} already names {model_id.gguf}")
    gguf = model_id.gguf or config.gguf_file
    if gguf:
        path = gguf_path(model_id.repo_id, gguf, revision=config.revision, cache_dir=cache)
        return _gguf_source(path)
    return ModelSource(model_snapshot(model_id.repo_id, revision=config.revision, cache_dir=cache))


def _local_directory_source(model: str, gguf_file: str | None) -> ModelSource:
    if gguf_file:
        if not os.path.isfile(os.path.join(model, gguf_file)):
            raise ConfigError(f"--gguf-file {gguf_file}: not found in {model}")
        return _gguf_source(os.path.abspath(os.path.join(model, gguf_file)))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(
            f"--model {model}: no config.json there (or pass --gguf-file for a GGUF checkpoint)"
        )
    return ModelSource(os.path.abspath(model))


def resolve_tokenizer(config: EngineConfig) -> str | None:
    """The local tokenizer directory when --tokenizer names a Hugging Face id (or --tokenizer-revision asks
    for another revision of the model's); the path as given when it is local; None: the model's own.

    --tokenizer-revision defaults to --revision when the tokenizer is the model's repository, else main."""
    name = config.tokenizer
    if name is None:
        if config.tokenizer_revision is None:
            return None
        name = config.model or ""
        if os.path.exists(name) or parse_model_id(name) is None:
            raise ConfigError(
                f"--tokenizer-revision {config.tokenizer_revision}: neither --tokenizer nor --model is a Hugging "
                "Face id to take a revision of"
            )
    if os.path.exists(name):
        return name
    tokenizer_id = parse_model_id(name)
    if tokenizer_id is None or tokenizer_id.gguf:
        raise ConfigError(f"--tokenizer {name}: no such directory, nor a Hugging Face id (ORG/NAME)")
    model_id = parse_model_id(config.model or "")
    revision = config.tokenizer_revision
    if revision is None and model_id is not None and model_id.repo_id == tokenizer_id.repo_id:
        revision = config.revision
    return tokenizer_snapshot(
        tokenizer_id.repo_id, revision=revision, cache_dir=hub_cache_dir(config.download_dir)
    )


def _gguf_source(path: str) -> ModelSource:
    """A GGUF file is read through a converted Hugging Face copy (made once, cached); the file itself stays
    the source for methods that use its quantized tensors."""
    from pagellm.models.gguf_checkpoint import gguf_checkpoint_dir

    return ModelSource(str(gguf_checkpoint_dir(path, cache_dir())), gguf_original=path)


def load_hf_config(source: ModelSource) -> Any:
    """The checkpoint's config as the engine sizes and runs the decoder with it: a multimodal checkpoint's
    `text_config` (see `decoder_config`), any other checkpoint's config as it is."""
    return decoder_config(load_model_config(source))


def load_model_config(source: ModelSource) -> Any:
    """The checkpoint's whole config (a multimodal one's with its vision_config)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory)


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | str | None) -> Any:
    """`hf_config` with each field of `--hf-overrides` (a JSON object) set on it; ConfigError if not one."""
    if overrides is None or overrides == "" or overrides == {}:
        return hf_config
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"hf_overrides: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(overrides, dict):
        raise ConfigError('hf_overrides: expected a JSON object such as {"num_labels": 1}')
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return hf_config


def decoder_config(hf_config: Any) -> Any:
    """A multimodal checkpoint's decoder config (`get_text_config`) carrying the fields that only its top
    level states: the architecture the model class is registered under, the weights' dtype and their
    quantization. Everything from the KV layout to the sampler's vocabulary reads the decoder's fields."""
    text = hf_config.get_text_config(decoder=True)
    if text is hf_config:
        return hf_config
    text.architectures = list(getattr(hf_config, "architectures", None) or [])
    for key in ("dtype", "quantization_config"):
        if getattr(text, key, None) is None and getattr(hf_config, key, None) is not None:
            setattr(text, key, getattr(hf_config, key))
    return text


def resolve_dtype(requested: str, hf_config: Any, platform: type[Platform], gguf: bool) -> torch.dtype:
    if requested != "auto":
        dtype = DTYPES[requested]
        if dtype not in platform.supported_dtypes:
            names = ", ".join(dtype_name(d) for d in platform.supported_dtypes)
            raise ConfigError(f"--dtype {requested} is not supported on {platform.name}; supported: {names}")
        return dtype
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    if not gguf and checkpoint in platform.supported_dtypes and checkpoint != torch.float32:
        return checkpoint
    return platform.default_dtype


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if getattr(hf_config, key, None):
            limit = scaled_max_positions(hf_config, int(getattr(hf_config, key)))
            break
    if requested is None:
        if limit is None:
            raise ConfigError("the model config states no maximum length; pass --max-model-len")
        return limit
    if limit is not None and requested > limit:
        raise ConfigError(f"--max-model-len {requested} exceeds the model's maximum of {limit} positions")
    return requested


def release_timing_inputs() -> None:
    """Free the inputs the backend timings built (tens of MB per candidate)."""
    from pagellm.core import timing

    timing.release()


def _backend_timer():
    if os.environ.get("PAGELLM_ATTENTION_TIMING", "1") == "0":
        return None
    from pagellm.core.timing import time_backend

    return time_backend


def resolve_engine(config: EngineConfig) -> EngineSetup:
    """Everything decided at start-up, before weights are read. Raises ConfigError with the fix."""
    config.speculative  # noqa: B018 (a bad speculative_config fails here, before anything loads)
    registry = load_plugins()
    keep_compiled_code_in_cache_dir()  # the plugins defined their operators; the backend timings compile
    platform_choice = select_platform(registry, config.device)
    platform = platform_choice.platform
    platform.check_and_update_config(config)
    building = _build_kernels_in_background(config, platform)  # beside the model's conversion and config
    source, model_config, hf_config, model_class_path = _resolve_model(config, registry)
    model_class = import_model_class(model_class_path)
    dtype = resolve_dtype(config.dtype, hf_config, platform, gguf=source.gguf_original is not None)
    max_model_len = resolve_max_model_len(config.max_model_len, hf_config)
    requested, quant_note = gguf_default_quantization(config, registry, platform, dtype, source)
    quant = select_quant_method(
        registry, platform, requested, checkpoint_quantization(hf_config, model_class), dtype
    )
    if config.batch_invariant:
        check_batch_invariant(config, platform, dtype, quant, model_config is not hf_config)
    kernels_pending = building and _serve_without_kernels(config, quant, source, hf_config, dtype, platform)
    if building and not kernels_pending:
        _wait_for_kernels(platform)
    backend_choice = _select_backend(
        config, registry, platform, model_class, hf_config, dtype, kernels_pending
    )
    spec = backend_choice.spec
    config.block_size = spec.block_size  # everything after start-up reads the chosen size from here
    kv_layout = model_kv_layout(model_class, hf_config, spec)
    explanation = [
        *platform_choice.explanation,
        f"model {_shown(config, source)} ({model_class_path}), dtype {dtype_name(dtype)}, "
        f"max_model_len {max_model_len}",
        f"quantization {quant.name if quant else 'none'}{quant_note}",
        *backend_choice.explanation,
        kv_layout.describe(),
    ]
    if kernels_pending:
        explanation.append(
            "the platform's kernels are building in the background: serving on the PyTorch paths until "
            "they are built, attention backends not timed (the next start times them)"
            + (", the GGUF blocks widened to the model's dtype until then" if quant is not None else "")
        )
    return EngineSetup(
        config=config,
        registry=registry,
        platform=platform,
        source=source,
        hf_config=hf_config,
        model_config=model_config,
        model_class_path=model_class_path,
        dtype=dtype,
        max_model_len=max_model_len,
        spec=spec,
        backend_choice=backend_choice,
        quant_method=quant,
        explanation=explanation,
        reasoning_parser=reasoning_parser(registry, config.reasoning_parser),
        kv_layout=kv_layout,
        kernels_pending=kernels_pending,
    )


def _resolve_model(config: EngineConfig, registry: Any) -> tuple[ModelSource, Any, Any, str]:
    """The checkpoint's source, its config and decoder config, and the model class's path; the tokenizer
    resolved to a local directory (`config.tokenizer` from here on); TP/PP checked against the model."""
    source = resolve_model_source(config)
    tokenizer = resolve_tokenizer(config)
    if tokenizer is not None:
        config.tokenizer = tokenizer  # a local directory from here on: everything after start-up reads it
    model_config = apply_hf_overrides(load_model_config(source), config.hf_overrides)
    hf_config = decoder_config(model_config)
    model_class_path = resolve_model_class(hf_config, registry.models)
    check_parallel(config, hf_config, import_model_class(model_class_path))
    return source, model_config, hf_config, model_class_path


def _select_backend(
    config: EngineConfig,
    registry: Any,
    platform: type[Platform],
    model_class: type,
    hf_config: Any,
    dtype: torch.dtype,
    kernels_pending: bool,
) -> BackendChoice:
    """The attention backend (and its block size, where no --block-size was given) for the model's spec,
    timed unless the kernels are still building."""
    # without --block-size the spec's block size is a placeholder: each candidate backend runs its own
    block_size = DEFAULT_BLOCK_SIZE if config.block_size is None else config.block_size
    spec = dataclasses.replace(
        model_class.selection_spec(hf_config, dtype, block_size),
        kv_cache_dtype=KV_CACHE_DTYPES.get(config.kv_cache_dtype),
        batch_invariant=config.batch_invariant,
    )
    choice = select_attention_backend(
        registry,
        platform,
        spec,
        config.attention_backend,
        timer=None if kernels_pending else _backend_timer(),
        cache=TimingCache(os.path.join(cache_dir(), "attention_timings.json")),
        choose_block_size=config.block_size is None,
    )
    release_timing_inputs()
    return choice


def _build_kernels_in_background(config: EngineConfig, platform: type[Platform]) -> bool:
    """With --compile-in-background (serve's default) a one-process engine starts the platform's kernels'
    build in the background (`Platform.build_kernels_in_background`) as soon as the platform is chosen, so
    that it runs beside the rest of the start (a GGUF file's conversion takes seconds); True if one
    started."""
    if not config.compile_in_background or config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        return False
    return platform.build_kernels_in_background()


def _serve_without_kernels(
    config: EngineConfig,
    quant: type | None,
    source: ModelSource,
    hf_config: Any,
    dtype: torch.dtype,
    platform: type[Platform],
) -> bool:
    """Whether the engine starts on its PyTorch paths while the kernels build. An unquantized model does; so
    does a GGUF one (`loads_gguf_blocks`) whose blocks, widened to the model's dtype for that time, fit in
    half the memory beside the file's bytes kept for the kernels (`QuantMethod.take_up_kernels`). Other
    quantized weights, MXFP4 experts (they stay packed only with the kernels) and batch-invariant mode
    (it needs them) wait for the build (`_wait_for_kernels`)."""
    checkpoint_format = (getattr(hf_config, "quantization_config", None) or {}).get("quant_method")
    if config.batch_invariant or checkpoint_format == "mxfp4":
        return False
    if quant is None:
        return True
    if not quant.loads_gguf_blocks:
        return False
    stored = _checkpoint_bytes(source)
    widened = stored * dtype.itemsize * 8 / GGUF_FEWEST_BITS
    fits = stored + widened <= platform.free_memory() / 2
    if not fits:
        logger.info(
            "the GGUF blocks widened (~%.1f GiB) would not fit in half the free memory: waiting for the "
            "kernels that read them in place",
            widened / GiB,
        )
    return fits


GGUF_FEWEST_BITS = 4.5
"""Bits per weight of the most compact block type the CPU kernels read (Q4_0), for the widened size."""


def _checkpoint_bytes(source: ModelSource) -> int:
    if source.gguf_original is not None:
        return os.path.getsize(source.gguf_original)
    return sum(
        os.path.getsize(os.path.join(source.directory, name))
        for name in os.listdir(source.directory)
        if name.endswith((".safetensors", ".bin", ".pt"))
    )


def _wait_for_kernels(platform: type[Platform]) -> None:
    started = time.monotonic()
    logger.info("waiting for the kernels' build: this model's weights or mode need them")
    while not platform.kernels_built():
        time.sleep(0.1)
    logger.info("kernels built after %.1fs more", time.monotonic() - started)


def model_kv_layout(model_class: type, hf_config: Any, spec: AttentionSpec) -> KVCacheLayout:
    """The KV cache groups of the model's layers (`CausalLM.attention_spec` of each, at the chosen block
    size and KV-cache dtype of `spec`)."""
    specs = [
        dataclasses.replace(
            model_class.attention_spec(hf_config, spec.dtype, spec.block_size, i),
            kv_cache_dtype=spec.kv_cache_dtype,
            batch_invariant=spec.batch_invariant,
        )
        for i in range(model_class.num_attention_layers(hf_config))
    ]
    return group_layers(specs)


def check_batch_invariant(
    config: EngineConfig, platform: type[Platform], dtype: torch.dtype, quant: Any, multimodal: bool
) -> None:
    """Refuse `--batch-invariant` where some part of a step would still depend on the batch. The model's
    layers are checked once built (`runner_build.check_batch_invariant`), the attention backend by the
    selector (`supports_batch_invariant`)."""
    reason = platform.batch_invariant_unsupported(dtype)
    if reason is None and quant is not None:
        reason = f"quantization {quant.name} has no batch-invariant kernels"
    if reason is None and config.enable_lora:
        reason = "LoRA adapters are applied to a step's rows together, in one matmul per slot"
    if reason is None and multimodal:
        reason = "the vision encoder has no batch-invariant kernels"
    if reason is None and config.tensor_parallel_size > 1:
        reason = "tensor parallelism sums partial results in an order set by the all-reduce"
    if reason is not None:
        raise ConfigError(f"--batch-invariant: {reason}; run without --batch-invariant")


def _shown(config: EngineConfig, source: ModelSource) -> str:
    path = source.gguf_original or source.directory
    return path if config.model is None or os.path.exists(config.model) else f"{config.model} ({path})"


def check_parallel(config: EngineConfig, hf_config: Any, model_class: type) -> None:
    """Refuse, before anything loads, a split the model or the engine cannot run, saying what fits."""
    tp, pp, dp = config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size
    for name, size in (("tensor", tp), ("pipeline", pp), ("data", dp)):
        if size < 1:
            raise ConfigError(f"--{name}-parallel-size must be at least 1, got {size}")
    if tp == 1 and pp == 1:
        return
    if not getattr(model_class, "supports_parallel", False):
        raise ConfigError(
            f"{model_class.__name__} does not support tensor or pipeline parallelism yet "
            f"({model_class.unsplit_layers}); use --tensor-parallel-size 1 --pipeline-parallel-size 1 "
            f"(--data-parallel-size works with any model)"
        )
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: the model's {heads} attention heads do not divide by it"
        )
    if (kv_heads % tp) if kv_heads >= tp else (tp % kv_heads):
        raise ConfigError(
            f"--tensor-parallel-size {tp}: the model's {kv_heads} KV heads neither divide by it nor divide it"
        )
    if hf_config.intermediate_size % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: the MLP width {hf_config.intermediate_size} does not divide by it"
        )
    _check_experts_split(config, hf_config, tp)
    if pp > hf_config.num_hidden_layers:
        raise ConfigError(
            f"--pipeline-parallel-size {pp} is more than the model's {hf_config.num_hidden_layers} layers"
        )
    refused = {
        "quantization": config.quantization is not None or checkpoint_quantization(hf_config, model_class),
        "LoRA (enable_lora)": config.enable_lora,
        "a draft model, an EAGLE-3 head or MTP (speculative_config)": (config.speculative or None)
        and config.speculative.method in ("draft_model", "eagle3", "mtp"),
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"{what} with tensor or pipeline parallelism is not supported yet")


_FLOAT_FILE_TYPES = frozenset({"ALL_F32", "F16", "BF16"})
"""`gguf_file_type`'s names for a file whose matrices are all floats."""


def gguf_default_quantization(
    config: EngineConfig, registry: Any, platform: type[Platform], dtype: torch.dtype, source: ModelSource
) -> tuple[str | None, str]:
    """The method to ask the selector for, and a note for the start-up log. A GGUF file without
    --quantization keeps its blocks (`gguf`), as llama.cpp and vLLM do: the memory is the file's and a
    decode step reads the file's bytes, not 2.5-3.5x them widened. It is widened instead where the method
    cannot run here, with tensor or pipeline parallelism (not supported with quantization yet) or
    --batch-invariant, and for an architecture whose blocks the loader does not hand over
    (`blocks_kept_for`), saying why; `none` widens it on request. A file of float matrices (its header's
    `general.file_type` F32, F16 or BF16) has no blocks to keep: it loads as a checkpoint of floats does,
    onto the platform's float kernels, as `none` would."""
    if config.quantization == NO_QUANTIZATION:
        return None, " (--quantization none)" if source.gguf_original is not None else ""
    if config.quantization is not None or source.gguf_original is None:
        return config.quantization, ""
    file_type = gguf_file_type(source.gguf_original)
    if file_type in _FLOAT_FILE_TYPES:
        return None, f" (a {file_type} GGUF file: its matrices are floats, loaded as {dtype_name(dtype)})"
    method = registry.quant_methods.get("gguf")
    reasons = quant_method_reasons(method, platform, dtype) if method is not None else ["not installed"]
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        reasons.append("tensor or pipeline parallelism")
    if config.batch_invariant:
        reasons.append("--batch-invariant (it has no batch-invariant kernels)")
    unkept = blocks_kept_for(source.gguf_original)
    if unkept is not None:
        reasons.append(unkept)
    if reasons:
        return None, f" (the GGUF blocks widened to {dtype_name(dtype)}: gguf {'; '.join(reasons)})"
    return "gguf", " (a GGUF file's default: its blocks kept; --quantization none widens them)"


def checkpoint_quantization(hf_config: Any, model_class: type) -> dict | None:
    """The checkpoint's `quantization_config` for the quantization selector; None where there is none or
    the model class reads that format itself (`CausalLM.reads_quantization`)."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization and quantization.get("quant_method") in getattr(model_class, "reads_quantization", ()):
        return None
    return quantization


def _check_experts_split(config: EngineConfig, hf_config: Any, tp: int) -> None:
    """A mixture-of-experts model splits its experts by expert (--enable-expert-parallel) or by width."""
    experts = expert_count(hf_config)
    if not experts:
        return
    if config.enable_expert_parallel and experts % tp:
        raise ConfigError(
            f"--enable-expert-parallel: the model's {experts} experts do not divide over "
            f"--tensor-parallel-size {tp}",
            param="enable_expert_parallel",
        )
    hints = {"shared_expert_intermediate_size": ""}  # a shared expert is sharded either way
    if not config.enable_expert_parallel:
        hints["moe_intermediate_size"] = " (--enable-expert-parallel splits the experts whole instead)"
    widths = {key: getattr(hf_config, key, None) for key in hints}
    # DeepSeek's and GLM-4.5's shared experts: one MLP of n_shared_experts x the experts' width
    shared = getattr(hf_config, "n_shared_experts", None)
    if shared and getattr(hf_config, "moe_intermediate_size", None):
        key = "shared experts' width (n_shared_experts x moe_intermediate_size)"
        hints[key], widths[key] = "", shared * hf_config.moe_intermediate_size
    for key, hint in hints.items():
        width = widths[key]
        if width and width % tp:
            raise ConfigError(
                f"--tensor-parallel-size {tp}: the model's {key} {width} does not divide by it{hint}",
                param="tensor_parallel_size",
            )


def reasoning_parser(registry, name: str | None) -> type | None:
    """The class of --reasoning-parser NAME from the plugins' registry; ConfigError for an unknown name."""
    if name is None:
        return None
    parser = registry.reasoning_parsers.get(name)
    if parser is None:
        known = ", ".join(sorted(registry.reasoning_parsers)) or "none installed"
        raise ConfigError(f"--reasoning-parser {name}: no such reasoning parser; known: {known}")
    return parser
