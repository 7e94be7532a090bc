"""The llama.cpp peer: `llama-server` on the same requests, the engine CPU users would run instead.

For each setting (slot count x flash attention on/off) a llama-server starts on a free port with the
same weights as a GGUF file, gets one warm-up request, then all the workload's requests at once as
token-id prompts to /completion (n_predict = the output length, ignore_eos, temperature 0, no prompt
cache), and is stopped. Only the tokens each request asked for count (useful output tok/s); the best
setting is the peer's number, and every setting's rate is kept.

The GGUF: `--llama-model PATH`, or one written from the run's model in its dtype (bf16 for parity with
pagellm's bf16 runs) and cached under the pagellm cache dir (pagellm.bench.gguf_convert writes it).
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

from pagellm.bench.common import ThroughputResult, peer_exit
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
            why = f"{peer_exit('llama-server', self.process.returncode, '--no-repack')}: {' '.join(self.command)}"
        else:
            why = f"llama-server did not become healthy in {timeout_s:.0f} s"
        return f"{why}\n{self.log_tail()}"


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


def gguf_for(config: Any, dtype_name: str, cache_root: str | os.PathLike) -> str:
    """The GGUF llama.cpp runs for `config.model`: its own GGUF file where pagellm runs that as it is, else
    the model in `dtype_name`, written once into `cache_root`/llama.cpp."""
    from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf
    from pagellm.engine.setup import resolve_model_source

    source = resolve_model_source(config)
    if source.gguf_original and _runs_as_is(source.gguf_original, config.quantization, dtype_name):
        return source.gguf_original
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


_FLOAT_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _runs_as_is(path: str, quantization: str | None, dtype_name: str) -> bool:
    """Whether llama.cpp on --model's own GGUF runs what pagellm runs: its blocks (`--quantization gguf`, a
    GGUF file's default) or matrices already in the run's dtype. Otherwise (`--quantization none`, model S
    in the bench) pagellm dequantized the file into `dtype_name` and llama.cpp gets the same weights in that
    dtype."""
    if quantization in ("gguf", None):
        return True
    import gguf

    matrices = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) >= 2}
    return matrices == {_FLOAT_TYPES.get(dtype_name)}
