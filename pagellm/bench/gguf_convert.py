"""GGUF files for the llama.cpp peer (and for tests of pagellm's GGUF loading): a Hugging Face checkpoint
converted the way llama.cpp's convert_hf_to_gguf.py does, or a GGUF re-encoded in another type.

Per family, what llama.cpp's converter does and this one copies:
- Llama/Mistral: q/k rows permuted from Hugging Face's rotate-half order into llama.cpp's interleaved one.
- Gemma 2 and Gemma 3: every `*norm.weight` stored as 1 + w (llama.cpp's RMSNorm multiplies by the weight
  as stored, Gemma's by 1 + w); Gemma 2's two soft-caps and window; Gemma 3's window, final soft-cap (when
  set) and the global layers' rope base and linear scaling. llama.cpp itself fixes the layer pattern
  (Gemma 2 alternates, Gemma 3 has five local layers per global one), the local rope base (10000) and the
  attention scale (1/sqrt(head_dim), except for the 27B models), so the file has no key for them.
- Phi-3 / Phi-4-mini: the fused `qkv_proj` and `gate_up_proj` kept as `attn_qkv` and `ffn_up`; the rotary
  width in dimensions (partial rotary), the original context length, the window (0 for none) and, for
  LongRoPE, the attention factor and the long and short factors as the tensors `rope_factors_long/short`.
- Mixtures of experts: Qwen3-MoE (`qwen3moe`), Qwen2-MoE (`qwen2moe`, with its shared expert as
  `ffn_*_shexp` and its gate as `ffn_gate_inp_shexp`) and Mixtral (`llama` with an expert count, q/k
  permuted as Llama's): each layer's per-expert projections stacked into `ffn_gate_exps` / `ffn_up_exps`
  [E, I, H] and `ffn_down_exps` [E, H, I]; the expert count, experts per token and the experts' (and shared
  expert's) width as keys; routers kept float32 whatever the type. llama.cpp has every layer a mixture of
  experts and fixes the top-k renormalisation per architecture (Qwen3-MoE and Mixtral yes, Qwen2-MoE no),
  so a checkpoint with dense layers or the other renormalisation is refused.

Beyond llama.cpp's keys the file also states the rope base and vocabulary size, which transformers' GGUF
reader takes from them. Tokenizers: byte-level BPE only (llama.cpp's "gpt2" model); a SentencePiece one is
refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def _gguf_type(type_name: str):
    from gguf import GGMLQuantizationType, LlamaFileType

    return {
        "bfloat16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
        "float16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
        "float32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
        "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    }[type_name]


def _encode(data: np.ndarray, type_name: str, keep_f32: bool = False) -> tuple[np.ndarray, Any]:
    """Matrices in the requested type; vectors (norms, biases) and `keep_f32` tensors (routers) stay float32,
    as llama.cpp's converter does."""
    from gguf import GGMLQuantizationType, quants

    qtype = _gguf_type(type_name)[0] if data.ndim >= 2 and not keep_f32 else GGMLQuantizationType.F32
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        return data, qtype
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16), qtype
    return quants.quantize(data, qtype), qtype


def reencode_gguf(
    source: str | os.PathLike,
    target: str | os.PathLike,
    dtype_name: str = "bfloat16",
    encode: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
) -> Path:
    """Write `source` (any GGUF) to `target` with every tensor dequantized and stored in `dtype_name`
    (matrices) or float32 (vectors), keeping all its metadata and tokenizer. `encode` (tensor name, float32
    values) -> (data, GGML type) stores a tensor its own way instead (None: the default), as the tests
    write K-quant experts."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, dequantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    writer = GGUFWriter(str(partial), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in (
            "general.architecture",
            "general.file_type",
            "general.quantization_version",
        ):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(_gguf_type(dtype_name)[1])
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        own = encode(tensor.name, values) if encode is not None else None
        data, qtype = own if own is not None else _encode(values, dtype_name)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    _finish(writer, partial, target)
    return target


def _finish(writer: Any, partial: Path, target: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half q/k rows into llama.cpp's interleaved order (its converter's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of `layer_type`'s layers (Gemma 3 keys them by layer type, others have one set)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    return dict(params.get(layer_type, params))


def _gemma2_keys(writer: Any, config: Any) -> list[tuple[str, np.ndarray]]:
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    return []


def _gemma3_keys(writer: Any, config: Any) -> list[tuple[str, np.ndarray]]:
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if "sliding_attention" in config.layer_types:
        writer.add_sliding_window(config.sliding_window)
    rope = _rope(config)
    if rope.get("rope_type") == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    return []


def _phi3_keys(writer: Any, config: Any) -> list[tuple[str, np.ndarray]]:
    """Rotary width, original context, window; LongRoPE's attention factor and its factors as tensors."""
    rope = _rope(config)
    original = (
        getattr(config, "original_max_position_embeddings", None) or rope["original_max_position_embeddings"]
    )
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return []
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    )
    return [
        ("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
        ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)),
    ]


def _moe_keys(writer: Any, config: Any) -> list[tuple[str, np.ndarray]]:
    """Expert count and experts per token; Qwen's experts' width and shared expert's width (Mixtral's
    experts' width is its `feed_forward_length`)."""
    writer.add_expert_count(_expert_count(config))
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    return []


def _expert_count(config: Any) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


_RENORMALISED = {"QWEN3MOE": True, "QWEN2MOE": False, "LLAMA": True}
"""Whether llama.cpp renormalises the top-k expert weights of each MoE architecture (fixed in its code)."""


def _check_moe(config: Any, arch: str) -> None:
    """Refuse what llama.cpp's MoE architectures cannot state: dense layers, the other renormalisation."""
    if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise ValueError("no GGUF conversion for a mixture of experts with dense layers (llama.cpp has none)")
    renormalised = bool(getattr(config, "norm_topk_prob", True))
    if renormalised != _RENORMALISED[arch]:
        raise ValueError(
            f"no GGUF conversion for {config.model_type!r} with norm_topk_prob={renormalised}: llama.cpp "
            f"fixes it to {_RENORMALISED[arch]} for this architecture"
        )


class _ExpertStacker:
    """Collects a layer's per-expert projections (`<mlp>.experts.{e}.<module>.weight`) and hands out each
    projection stacked over the experts, [E, rows, columns], under gguf's name, once all E have come."""

    _KINDS = {
        "gate_proj": "FFN_GATE_EXP",
        "up_proj": "FFN_UP_EXP",
        "down_proj": "FFN_DOWN_EXP",
        "w1": "FFN_GATE_EXP",  # Mixtral's names
        "w3": "FFN_UP_EXP",
        "w2": "FFN_DOWN_EXP",
    }
    _NAME = re.compile(r".*\.layers\.(\d+)\..*\.experts\.(\d+)\.(\w+)\.weight")

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.pending: dict[tuple[int, str], dict[int, np.ndarray]] = {}

    def add(self, name: str, data: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The stacked tensor (GGUF name, data) `name` completes, or None while experts are missing."""
        from gguf import MODEL_TENSOR, TENSOR_NAMES

        match = self._NAME.fullmatch(name)
        if match is None or match[3] not in self._KINDS:
            raise ValueError(f"no GGUF name for expert tensor {name}")
        key = (int(match[1]), self._KINDS[match[3]])
        parts = self.pending.setdefault(key, {})
        parts[int(match[2])] = data
        if len(parts) < self.num_experts:
            return None
        del self.pending[key]
        layer, kind = key
        gguf_name = TENSOR_NAMES[MODEL_TENSOR[kind]].format(bid=layer) + ".weight"
        return gguf_name, np.stack([parts[e] for e in range(self.num_experts)])

    def check_done(self) -> None:
        if self.pending:
            raise ValueError(f"the checkpoint lacks experts of {sorted(self.pending)}")


@dataclass(frozen=True)
class _Family:
    """How llama.cpp writes one Hugging Face model type."""

    arch: str  # gguf.MODEL_ARCH member
    permute_qk: bool = False  # llama.cpp rotates q/k pairs interleaved for this arch (not NeoX-style)
    norm_shift: float = 0.0  # added to every `*norm.weight`
    # writes the family's own keys, returns its extra tensors (GGUF name, float32 data)
    keys: Callable[[Any, Any], list[tuple[str, np.ndarray]]] | None = None
    tokenizer_pre: str = "default"


_FAMILIES = {
    "llama": _Family("LLAMA", permute_qk=True),
    "mistral": _Family("LLAMA", permute_qk=True),
    "qwen2": _Family("QWEN2", tokenizer_pre="qwen2"),
    "gemma2": _Family("GEMMA2", norm_shift=1.0, keys=_gemma2_keys),
    "gemma3_text": _Family("GEMMA3", norm_shift=1.0, keys=_gemma3_keys),
    "phi3": _Family("PHI3", keys=_phi3_keys),
    "qwen3_moe": _Family("QWEN3MOE", keys=_moe_keys, tokenizer_pre="qwen2"),
    "qwen2_moe": _Family("QWEN2MOE", keys=_moe_keys, tokenizer_pre="qwen2"),
    "mixtral": _Family("LLAMA", permute_qk=True, keys=_moe_keys),
}


def convert_hf_checkpoint(
    directory: str | os.PathLike, target: str | os.PathLike, dtype_name: str = "bfloat16"
) -> Path:
    """A Hugging Face Llama/Mistral/Qwen2/Gemma 2/Gemma 3 (text)/Phi-3/Qwen3-MoE/Qwen2-MoE/Mixtral checkpoint
    (safetensors, byte-level BPE tokenizer) as a GGUF file llama.cpp can serve, matrices in `dtype_name` (a
    dtype or "q8_0")."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory)
    family = _family_of(config)
    moe = config.model_type in ("qwen3_moe", "qwen2_moe", "mixtral")
    if moe:
        _check_moe(config, family.arch)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(Path(directory).name)
    _add_hparams(writer, config, heads, kv_heads, dtype_name)
    extra_tensors = family.keys(writer, config) if family.keys else []
    _add_tokenizer(writer, AutoTokenizer.from_pretrained(directory), config, family.tokenizer_pre)
    _add_tensors(writer, directory, config, family, arch, moe, dtype_name, heads, kv_heads)
    for gguf_name, data in extra_tensors:
        writer.add_tensor(gguf_name, data)
    _finish(writer, partial, target)
    return target


def _family_of(config: Any) -> _Family:
    """The family a checkpoint converts as; refuses model types and sliding-window checkpoints the
    conversion does not write."""
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(
            f"no GGUF conversion for {config.model_type!r} checkpoints; pass --llama-model with a GGUF file"
        )
    if family.arch in ("LLAMA", "QWEN2") and getattr(config, "sliding_window", None):
        if getattr(config, "use_sliding_window", True):
            raise ValueError(
                "no GGUF conversion for sliding-window checkpoints; pass --llama-model with a GGUF file"
            )
    return family


def _add_hparams(writer: Any, config: Any, heads: int, kv_heads: int, dtype_name: str) -> None:
    """The model's shape, rope and file type as GGUF keys (`heads` and `kv_heads` as the tensors are
    permuted for)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(_rope(config).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # the rotated width: all of a head but Phi-4-mini's 3/4 (llama.cpp computes it from the hidden size)
    partial_rotary = _rope(config).get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(partial_rotary * heads * head_dim) // heads)
    writer.add_file_type(_gguf_type(dtype_name)[1])


def _add_tensors(
    writer: Any,
    directory: str | os.PathLike,
    config: Any,
    family: _Family,
    arch: Any,
    moe: bool,
    dtype_name: str,
    heads: int,
    kv_heads: int,
) -> None:
    """The checkpoint's tensors under their GGUF names, in checkpoint order: q/k rows permuted and norms
    shifted as the family needs, MoE experts stacked per layer, routers kept in float32."""
    import gguf

    from pagellm.models.loader import iter_checkpoint_weights

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    experts = _ExpertStacker(_expert_count(config)) if moe else None
    routers = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)
    router_names = {
        gguf.TENSOR_NAMES[kind].format(bid=bid) for kind in routers for bid in range(config.num_hidden_layers)
    }
    for name, tensor in iter_checkpoint_weights(str(directory)):
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        data = tensor.float().numpy()
        if experts is not None and ".experts." in name:
            stacked = experts.add(name, data)
            if stacked is not None:
                data, qtype = _encode(stacked[1], dtype_name)
                writer.add_tensor(stacked[0], data, raw_dtype=qtype)
            continue
        if family.permute_qk and name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif family.permute_qk and name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        elif family.norm_shift and name.endswith("norm.weight"):
            data = data + family.norm_shift
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {name}")
        data, qtype = _encode(data, dtype_name, keep_f32=gguf_name.removesuffix(".weight") in router_names)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    if experts is not None:
        experts.check_done()


def _add_tokenizer(writer: Any, tokenizer: Any, config: Any, pre: str) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens by id, their types, the merges."""
    from gguf import TokenType

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if "ByteLevel" not in json.dumps(backend.get("pre_tokenizer")):
        raise ValueError(
            "no GGUF conversion for a tokenizer that is not byte-level BPE (SentencePiece vocabularies, as "
            "Gemma's and Phi-3-mini's, are not written); pass --llama-model with a GGUF file"
        )
    vocab = tokenizer.get_vocab()
    size = config.vocab_size
    by_id = {i: t for t, i in vocab.items()}
    special = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(TokenType.CONTROL if i in special else TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is None:
            token_id = getattr(config, f"{kind}_token_id", None)
        if isinstance(token_id, int):
            getattr(writer, f"add_{kind}_token_id")(token_id)
