"""Native CPU kernels, compiled on first use with `torch.utils.cpp_extension` and cached.

The library registers its functions as torch operators under a namespace named after the build (ops.cpp),
and `load()` returns them bound to plain attributes: `kernels.paged_attention(...)`. Not a pybind11 module:
`torch/extension.h` cost ~45 of the ~90 CPU-seconds the build took, and the sources include no more of
torch than they use (kernels.h), so a first start on two cores builds in ~30 s instead of ~70 s. Going
through the dispatcher costs a call ~1 us (store_kv) to ~3 us (paged_attention, 15 arguments) more than
pybind11 did.

The build targets the CPU it runs on (-march=native), so the AVX-512, AVX2 or plain C++ path of each kernel
is the one this machine can run; the cache key includes the CPU's feature flags, so a different CPU gets
its own build. Where no compiler is found or the build fails, `load()` returns None after one log line
saying why, and callers use their PyTorch path. PAGELLM_CPU_KERNELS=0 turns the kernels off;
PAGELLM_CPU_KERNELS_ARCH=x86-64 builds them without AVX2 (their plain C++ paths), in a build of its own.

A server need not wait for the build (~40 s on two cores): `build_in_background()` starts it in a niced
process of its own (`python -m pagellm.platforms.cpu_kernels`), and until that ends `load()` returns None, so the engine
starts on its PyTorch paths and takes the kernels up between two steps once `background_build_done()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pagellm.core.paths import cache_dir
from pagellm.core.progress import elapsed

logger = logging.getLogger("pagellm")

SOURCES = (
    "paged_attention.cpp",
    "linear_amx.cpp",
    "argmax.cpp",
    "fused_moe.cpp",
    "linear_panels.cpp",
    "linear_bf16_pairs.cpp",
    "gguf_linear.cpp",
    "gguf_moe.cpp",
    "recurrent.cpp",
    "native_decoder.cpp",
    "sparse_attention.cpp",
    "ops.cpp",
)
HEADERS = (
    "kernels.h",
    "amx_tiles.h",
    "panels.h",
    "gguf_blocks.h",
    "gguf_iq_grids.h",
    "gguf_tiles.h",
    "gguf_amx.h",
    "moe_routing.h",
    "avx512_helpers.h",
)
ENV_SWITCH = "PAGELLM_CPU_KERNELS"
ARCH_SWITCH = "PAGELLM_CPU_KERNELS_ARCH"
"""The build's -march (default native); e.g. x86-64 builds the plain C++ paths, to check them on any CPU."""
OPS = (
    "amx_available",
    "amx_pack",
    "amx_linear",
    "amx_pack_int8",
    "amx_linear_w8a8",
    "paged_attention",
    "argmax_rows",
    "store_kv",
    "isa",
    "attention_pair_tiles",
    "bf16_pairs_available",
    "gguf_dequantize",
    "gguf_kernel_type",
    "gguf_isa",
    "gguf_rows_asked_ahead",
    "gguf_interleaved_type",
    "gguf_interleave",
    "fused_moe_isa",
    "begin_native_step",
    "end_native_step",
    "gated_delta_rule_update",
    "selective_state_update",
    "conv1d_update",
    "sparse_index_scores",
    "sparse_attend_rows",
    "native_decoder_pairs",
    "native_decoder_panels",
    "native_decoder_plan",
    "native_decoder_step",
    "native_decoder_max_rows",
    "native_head_plan",
    "native_head_step",
    "native_decoder_drop",
)
"""The operators the library defines in its own namespace (TORCH_LIBRARY in ops.cpp)."""

_lock = threading.Lock()
_loaded: dict[str, SimpleNamespace | None] = {}
_why_not: str | None = None
_background: BackgroundBuild | None = None


def why_unavailable() -> str | None:
    """Why `load()` returned None (after it did), for reasons and log lines."""
    return _why_not


def load() -> SimpleNamespace | None:
    """The compiled kernels (one attribute per name in OPS, and `library`, the .so's path), building them the
    first time; None (with the reason logged once) when they cannot be had here."""
    global _why_not
    with _lock:
        if _background is not None and not _take_background_build():
            return None
        if "kernels" in _loaded:
            return _loaded["kernels"]
        kernels, _why_not = _build()
        if kernels is None:
            logger.warning(
                "CPU kernels unavailable (attention uses its PyTorch path, linears oneDNN, MoE experts the "
                "reference, recurrent layers theirs): %s",
                _why_not,
            )
        _loaded["kernels"] = kernels
        return kernels


def loaded() -> SimpleNamespace | None:
    """The kernels if this process has loaded them already, else None: for callers that would use them but
    must not start a build."""
    return _loaded.get("kernels")


def build_in_background() -> bool:
    """Start building the kernels in a niced process of their own where this machine can build them and no
    build of these sources is in the cache yet; True if one started. `load()` returns None until it ends,
    without a warning: the callers take their PyTorch paths meanwhile."""
    global _background
    with _lock:
        if _background is not None:
            return True
        if "kernels" in _loaded or _unbuildable() is not None:
            return False
        key, build_dir = _build_key()
        if any(build_dir.glob("*.so")):
            return False
        _background = BackgroundBuild(build_dir)
        logger.info(
            "building the CPU kernels in the background (pid %d, log %s)",
            _background.process.pid,
            _background.log,
        )
        return True


def background_build_done() -> bool:
    """Whether no background build is running (it ended, or none was started): `load()` then answers."""
    return _background is None or _background.process.poll() is not None


class BackgroundBuild:
    """The kernels' build in a child process (`python -m pagellm.platforms.cpu_kernels`), niced so that the
    serving process's steps come first, and ended with its compilers when the engine ends; its output goes
    to a log file beside the build."""

    def __init__(self, build_dir: Path):
        self.started = time.monotonic()
        self.log = Path(str(build_dir) + ".log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, which it ends whole if the engine goes
            )

    def failure(self) -> str | None:
        """None if the build succeeded, else the last line of its log."""
        if self.process.returncode == 0:
            return None
        try:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        last = lines[-1] if lines else "no output"
        return f"background build exited {self.process.returncode}: {last} (its log: {self.log})"


def _take_background_build() -> bool:
    """Under the lock: False while the background build runs; once it ended, forget it (a failure is this
    process's answer, logged once, not a build of its own on a step's path) and return True."""
    global _background, _why_not
    if _background.process.poll() is None:
        return False
    build, _background = _background, None
    failure = build.failure()
    if failure is not None:
        _why_not = failure
        logger.warning("CPU kernels unavailable (PyTorch paths stay): %s", failure)
        _loaded["kernels"] = None
    else:
        logger.info("CPU kernels built in the background in %.1fs", time.monotonic() - build.started)
    return True


def _unbuildable() -> str | None:
    """Why no build can be tried here, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; set CXX or install g++)"
    return None


def _build_key() -> tuple[str, Path]:
    """The build's key (sources, torch version, CPU flags, -march) and its folder in the cache."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    digest.update(os.environ.get(ARCH_SWITCH, "native").encode())
    key = digest.hexdigest()[:16]
    return key, Path(cache_dir()) / "kernels" / key


def _build() -> tuple[SimpleNamespace | None, str | None]:
    why_not = _unbuildable()
    if why_not is not None:
        return None, why_not
    here = Path(__file__).parent
    arch = os.environ.get(ARCH_SWITCH, "native")
    key, build_dir = _build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info(
            "building the CPU kernels (attention, AMX linear, MoE, recurrent) in %s (once per CPU and torch version)",
            build_dir,
        )
    started = time.monotonic()
    try:
        from filelock import FileLock
        from torch.utils.cpp_extension import load as load_extension

        # One build at a time per key, under a lock the OS drops when its holder dies: torch's own lock file
        # (`lock` in the build folder) outlives a killed build and would make every later start wait forever,
        # so, holding ours, a leftover one is stale and removed. The sources are compiled from a copy in the
        # build folder, so checkouts at other paths with the same sources share the build.
        with FileLock(str(build_dir) + ".build-lock"):
            (build_dir / "lock").unlink(missing_ok=True)
            sources = []
            for name in SOURCES + HEADERS:
                copy = build_dir / name
                if not copy.exists() or copy.read_bytes() != (here / name).read_bytes():
                    shutil.copyfile(here / name, copy)
                if name in SOURCES:
                    sources.append(str(copy))
            name = f"pagellm_cpu_kernels_{key}"
            with elapsed("building the CPU kernels") if fresh else contextlib.nullcontext():
                library = load_extension(
                    name=name,
                    sources=sources,
                    extra_cflags=["-O3", f"-march={arch}", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                    is_python_module=False,
                )
    except Exception as e:  # a compiler error, a missing header or ninja: fall back, say why
        logger.debug("the CPU kernels' build failed:\n%s", e)  # the compiler's own words
        return (
            None,
            f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}",
        )
    # Each op's `default` overload: calling it skips the overload lookup of `torch.ops.<ns>.<op>(...)`.
    ops = getattr(torch.ops, name)
    kernels = SimpleNamespace(library=Path(library), **{op: getattr(ops, op).default for op in OPS})
    if fresh:
        logger.info("CPU kernels built in %.1fs (%s)", time.monotonic() - started, kernels.isa())
    return kernels, None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
