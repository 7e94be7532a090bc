"""The llama.cpp peer: `llama-server` on the same requests, the engine CPU users would run instead.

For each setting (slot count x flash attention on/off) a llama-server starts on a free port with the
same weights as a GGUF file, gets one warm-up request, then all the workload's requests at once as
token-id prompts to /completion (n_predict = the output length, ignore_eos, temperature 0, no prompt
cache), and is stopped. Only the tokens each request asked for count (useful output tok/s); the best
setting is the peer's number, and every setting's rate is kept.

The GGUF: `--llama-model PATH`, or one written from the run's model in its dtype (bf16 for parity with
pagellm's bf16 runs) and cached under the pagellm cache dir: a GGUF model (model S ships as Q4_1) is
dequantized and re-encoded tensor by tensor with the same metadata and tokenizer; a Hugging Face Llama or
Qwen2 checkpoint (model M) is converted with the `gguf` package.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.bench.common import ThroughputResult
from pagellm.bench.process import LoggedProcess, quiet_httpx
from pagellm.bench.workloads import Workload

logger = logging.getLogger("pagellm")

START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class LlamaSetting:
    slots: int
    flash_attn: str  # "on" or "off"

    @property
    def label(self) -> str:
        return f"llama.cpp ({self.slots} slots, flash attn {self.flash_attn})"


def settings(slots: Sequence[int], flash_attn: Sequence[str]) -> list[LlamaSetting]:
    return [LlamaSetting(s, fa) for s in slots for fa in flash_attn]


def find_binary(path: str | None) -> str | None:
    """The llama-server executable: a path, or a name on PATH; None if not given or not found."""
    if not path:
        return None
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return os.path.abspath(path)
    return shutil.which(path)


def _flash_attn_args(help_text: str, setting: str) -> list[str]:
    """Newer llama-server takes `-fa on|off|auto`; older ones a bare `-fa` switch."""
    if "on|off" in help_text:
        return ["-fa", setting]
    return ["-fa"] if setting == "on" else []


def server_command(
    binary: str,
    model: str,
    port: int,
    setting: LlamaSetting,
    ctx_per_slot: int,
    threads: int,
    help_text: str = "",
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(setting.slots), "-c", str(setting.slots * ctx_per_slot)]
    command += ["-t", str(threads), "-tb", str(threads), *_flash_attn_args(help_text, setting.flash_attn)]
    return [*command, *extra_args]


class LlamaServer(LoggedProcess):
    """One llama-server process on a free port; `url` once /health answers 200."""

    def __init__(
        self, command: list[str], port: int, log_path: str, start_timeout_s: float = START_TIMEOUT_S
    ):
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(command, log_path)
        self.wait_healthy(self.url, start_timeout_s)

    def start_failure(self, timeout_s: float) -> str:
        if self.process.poll() is not None:
            why = f"exited with {self.process.returncode}: {' '.join(self.command)}"
        else:
            why = f"did not become healthy in {timeout_s:.0f} s"
        return f"llama-server {why}\n{self.log_tail()}"


def completion_body(prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_predict": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "stream": False,
    }


async def _post_all(url: str, prompts: list[list[int]], output_lens: list[int]) -> list[dict[str, Any]]:
    import httpx

    quiet_httpx()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one(prompt: list[int], n: int) -> dict[str, Any]:
            response = await client.post(url + "/completion", json=completion_body(prompt, n))
            if response.status_code != 200:
                raise RuntimeError(f"llama-server answered {response.status_code}: {response.text[:300]}")
            return response.json()

        return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, output_lens, strict=True))))


def _predicted(response: dict[str, Any]) -> int:
    if "tokens_predicted" in response:
        return int(response["tokens_predicted"])
    return int(response.get("timings", {}).get("predicted_n", 0))


def run_setting(server_url: str, workload: Workload, label: str) -> ThroughputResult:
    """Warm up, then send every request at once and time until the last answer."""
    asyncio.run(_post_all(server_url, [list(range(1, 17))], [4]))
    start = time.perf_counter()
    responses = asyncio.run(_post_all(server_url, workload.prompts, workload.output_lens))
    elapsed = time.perf_counter() - start
    useful = sum(min(_predicted(r), n) for r, n in zip(responses, workload.output_lens, strict=True))
    return ThroughputResult(
        engine=label,
        num_requests=len(responses),
        input_tokens=workload.input_tokens,
        output_tokens=useful,
        elapsed_s=elapsed,
    )


def run_llama_cpp(
    binary: str,
    model_gguf: str,
    workload: Workload,
    slot_counts: Sequence[int],
    flash_attn: Sequence[str],
    threads: int,
    extra_args: Sequence[str] = (),
    on_result: Callable[[ThroughputResult], None] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> ThroughputResult:
    """Every setting in turn, each on a fresh llama-server; the best by useful output tok/s, with every
    setting's rate in extra["output_tok_s_by_setting"]."""
    from pagellm.bench.serve import free_port

    help_text = _help(binary)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    ctx_per_slot = -(-longest // 256) * 256
    runs = []
    for setting in settings(slot_counts, flash_attn):
        port = free_port()
        command = server_command(
            binary, model_gguf, port, setting, ctx_per_slot, threads, help_text, extra_args
        )
        fd, log_path = tempfile.mkstemp(prefix="pagellm-llama-server-", suffix=".log")
        os.close(fd)
        server = LlamaServer(command, port, log_path, start_timeout_s)
        try:
            result = run_setting(server.url, workload, setting.label)
        finally:
            server.stop()
        os.remove(log_path)  # kept only when the setting failed
        result.extra.update(slots=setting.slots, flash_attn=setting.flash_attn, command=command)
        runs.append(result)
        if on_result is not None:
            on_result(result)
    best = max(runs, key=lambda r: r.output_tok_s)
    best.extra["output_tok_s_by_setting"] = {r.engine: r.output_tok_s for r in runs}
    best.extra["gguf"] = model_gguf
    return best


def _help(binary: str) -> str:
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


# -- the GGUF file ---------------------------------------------------------------------------------------


def _gguf_type(dtype_name: str):
    from gguf import GGMLQuantizationType, LlamaFileType

    return {
        "bfloat16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
        "float16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
        "float32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    }[dtype_name]


def _encode(data: np.ndarray, dtype_name: str) -> tuple[np.ndarray, Any]:
    """Matrices in the run's dtype; vectors (norms, biases) stay float32, as llama.cpp's converter does."""
    from gguf import GGMLQuantizationType, quants

    qtype = _gguf_type(dtype_name)[0] if data.ndim >= 2 else GGMLQuantizationType.F32
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        return data, qtype
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16), qtype
    return quants.quantize(data, qtype), qtype


def reencode_gguf(source: str | os.PathLike, target: str | os.PathLike, dtype_name: str = "bfloat16") -> Path:
    """Write `source` (any GGUF) to `target` with every tensor dequantized and stored in `dtype_name`
    (matrices) or float32 (vectors), keeping all its metadata and tokenizer."""
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
        data, qtype = _encode(dequantize(tensor.data, tensor.tensor_type), dtype_name)
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


_HF_ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2"}


def convert_hf_checkpoint(
    directory: str | os.PathLike, target: str | os.PathLike, dtype_name: str = "bfloat16"
) -> Path:
    """A Hugging Face Llama/Mistral/Qwen2 checkpoint (safetensors, byte-level BPE tokenizer) as a GGUF file
    llama.cpp can serve: llama.cpp's tensor names and metadata, q/k rows permuted for Llama."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from pagellm.models.loader import iter_checkpoint_weights

    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in _HF_ARCHS:
        raise ValueError(
            f"no GGUF conversion for {config.model_type!r} checkpoints; pass --llama-model with a GGUF file"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(
            "no GGUF conversion for sliding-window checkpoints; pass --llama-model with a GGUF file"
        )
    arch = getattr(gguf.MODEL_ARCH, _HF_ARCHS[config.model_type])
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch_name)
    writer.add_name(Path(directory).name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "rope_theta"
    )
    writer.add_rope_freq_base(float(theta or 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(_gguf_type(dtype_name)[1])
    _add_tokenizer(
        writer,
        AutoTokenizer.from_pretrained(directory),
        config,
        "qwen2" if arch_name == "qwen2" else "default",
    )
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in iter_checkpoint_weights(str(directory)):
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        data = tensor.float().numpy()
        if arch_name == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif arch_name == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {name}")
        data, qtype = _encode(data, dtype_name)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    _finish(writer, partial, target)
    return target


def _add_tokenizer(writer: Any, tokenizer: Any, config: Any, pre: str) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens by id, their types, the merges."""
    import json

    from gguf import TokenType

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
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
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


def gguf_for(config: Any, dtype_name: str, cache_root: str | os.PathLike) -> str:
    """The GGUF of `config.model` in `dtype_name`, written once into `cache_root`/llama.cpp."""
    from pagellm.engine.setup import resolve_model_source

    source = resolve_model_source(config)
    origin = source.gguf_original or source.directory
    stat = os.stat(origin)
    stem = Path(origin).name.removesuffix(".gguf")
    target = Path(cache_root) / "llama.cpp" / f"{stem}-{stat.st_size}-{int(stat.st_mtime)}.{dtype_name}.gguf"
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing %s for llama.cpp (once)", target)
    if source.gguf_original:
        reencode_gguf(source.gguf_original, target, dtype_name)
    else:
        convert_hf_checkpoint(source.directory, target, dtype_name)
    return str(target)
