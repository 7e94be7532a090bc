"""The model's compiled forward kept on disk, so that a start finds it ready instead of compiling it.

`Platform.compile_ahead` compiles the forward as one graph ahead of time (torch's AOT precompile); the
result is saved under `cache_dir()/compiled/<key>.bin` and loaded by later starts in about a second, where a
compile (Dynamo's trace, inductor's code) took minutes on two cores cold and ~40 s warm. The artifact keeps
no guards, so its key holds everything the graph depends on: pagellm's code, torch's version, the CPU, the
engine's choices, the model's config and each module's parameters and settings (`artifact_key`). A loaded
artifact is also checked against the eager forward on a dummy step before it serves (`agrees`).

With `--compile-in-background` the compile runs in a process of its own (`CompileProcess`, the module
`pagellm.engine.compile_process`), which loads the model again and saves the artifact; this process serves
on the eager forward meanwhile and swaps the compiled one in between two steps. A process rather than a
thread: a compile holds the GIL for seconds at a time, and every torch op of an eager step hands the GIL
back and waits for it, so a compiling thread beside the engine made its steps many times slower. Loading a
saved artifact does take a thread (`BackgroundLoad`): it holds the GIL for a few seconds once (importing
inductor, reading the file), where waiting for it at start made every warm start that much later.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagellm.core.paths import cache_dir

logger = logging.getLogger("pagellm")

FORMAT = 1
"""Bumped when what goes into a key or an artifact changes."""

COMPILE_PROCESS_MODULE = "pagellm.engine.compile_process"
"""What `CompileProcess` runs (`python -m`): it builds the engine's model as the engine does."""

_SCALARS = (bool, int, float, str, type(None), torch.dtype)


def compiled_dir() -> Path:
    """Where compiled forwards are kept: `cache_dir()/compiled`."""
    return Path(cache_dir()) / "compiled"


def artifact_path(key: str, regional: bool = False) -> Path:
    """The whole graph's file, or the regional forward's (worker/regional.py), which a compile process saves
    first: it compiles in a fifth of the time and steps a few percent slower."""
    return compiled_dir() / (f"{key}.regional.bin" if regional else f"{key}.bin")


def artifact_key(model: torch.nn.Module, facts: dict[str, Any]) -> str:
    """A hash of what the compiled graph depends on: pagellm's sources, torch's version, the CPU's flags,
    `facts` (the engine's choices: model class, dtype, backend, quantization, ...), and for every module its
    class, its settings (attributes of plain types) and its tensors' names, shapes, dtypes and strides."""
    digest = hashlib.sha256()
    digest.update(f"{FORMAT} {torch.__version__} {_sources_digest()} {_cpu_flags()}".encode())
    digest.update(repr(sorted(facts.items())).encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}".encode())
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") and attr not in ("_parameters", "_buffers"):
                continue
            if isinstance(value, dict) and attr in ("_parameters", "_buffers"):
                for tensor_name, tensor in sorted(value.items()):
                    digest.update(f"{tensor_name}{_tensor_facts(tensor)}".encode())
            else:
                digest.update(f"{attr}={_value_facts(value)}".encode())
    return digest.hexdigest()[:24]


def _tensor_facts(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return "None"
    return f"{tuple(tensor.shape)}{tensor.dtype}{tuple(tensor.stride())}{tensor.device.type}"


def _value_facts(value: Any) -> str:
    """A setting as it enters the key: plain values as they are, tensors by their layout, containers item by
    item, an op by its name, anything else by its type (objects the graph reads only through ops)."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_facts(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value_facts(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_value_facts(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(value)
    if isinstance(value, torch.nn.Module):
        return "module"  # hashed on its own in named_modules
    return type(value).__qualname__


@functools.cache
def _sources_digest() -> str:
    """pagellm's Python and C++ sources: any change to the code a graph was traced from makes a new key."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def save(compiled: Any, path: Path) -> None:
    """Write the artifact (atomically: a start never reads half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    compiled.save_compiled_function(str(partial))
    os.replace(partial, path)


def load(path: Path, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The saved forward, bound to `model` (the artifact takes the module as its first argument)."""
    from torch.compiler import load_compiled_function

    with open(path, "rb") as f:
        fn = load_compiled_function(f)
    return bind(fn, model)


def bind(compiled: Any, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """A compiled forward called as `forward(input_ids, positions)`. Its guard check is off: it has no
    guards to check, and binding the arguments to check none is Python on every step."""
    compiled.disable_guard_check()
    return functools.partial(compiled, model)


def agrees(eager: torch.Tensor, compiled: torch.Tensor) -> bool:
    """Whether a compiled forward's output is the eager one's up to rounding: within a tenth of it in relative
    L2 norm. Model S on 32 tokens: float32 2e-6; bfloat16 0.011 (fused kernels round otherwise, and the
    torch.compile graph drifts as far); an artifact of another model is off by about 1 or more."""
    if eager.shape != compiled.shape or eager.dtype != compiled.dtype:
        return False
    eager, compiled = eager.float(), compiled.float()
    if not bool(torch.isfinite(compiled).all()):
        return False
    return float((eager - compiled).norm()) <= 0.1 * float(eager.norm()) + 1e-6


@dataclass
class CompileRequest:
    """What the compile process is given: the engine's config with the choices the engine made at start-up
    pinned (so it builds the same model and times nothing), where to save, and the key it must reach."""

    config: Any  # EngineConfig
    path: str
    key: str
    timings_config: Any = None
    regional: bool = False
    """Compile the regional forward (worker/regional.py) rather than the whole graph."""
    """The engine's own config where it chose its attention backend itself: once the forward is saved, the
    process times the backends under it for the next start (`compile_process.time_attention_for_next_start`)."""


class CompileProcess:
    """The compile running in a process of its own (`python -m pagellm.engine.compile_process REQUEST`)."""

    def __init__(self, request: CompileRequest):
        self.request = request
        self.started = time.monotonic()
        fd, self._request_file = tempfile.mkstemp(prefix="pagellm-compile-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(request, f)
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", COMPILE_PROCESS_MODULE, self._request_file],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PAGELLM_ENFORCE_EAGER": "0"},
        )
        # the process ends with this object (an engine dropped or shut down): its compile has no taker
        self._end = weakref.finalize(self, _end, self.process, self._request_file)
        logger.info(
            "compiling the model in a separate process (pid %d); serving on the eager forward until then",
            self.process.pid,
        )

    def poll(self) -> bool | None:
        """None while it runs; then whether it saved the artifact (a failure is logged with its output's end)."""
        code = self.process.poll()
        if code is None:
            return None
        self._end()
        if code == 0 and os.path.exists(self.request.path):
            return True
        self._log.seek(0)
        tail = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
        logger.warning(
            "the compile process failed (exit %s), so the model keeps running eagerly: %s",
            code,
            " | ".join(tail),
        )
        return False

    def stop(self) -> None:
        self._end()


class BackgroundLoad:
    """A saved forward loaded (`load`) on a daemon thread while the engine serves on the eager one; the runner
    checks it (`agrees`) and swaps it in between two steps once `poll` says it is there. `start=False`: the
    thread starts at `start` (or `wait`): a load holds the GIL for seconds, and the runner puts it off
    while requests are served."""

    def __init__(self, path: Path, model: torch.nn.Module, start: bool = True):
        self.path = path
        self.started: float | None = None
        """When the thread started (time.monotonic()); None before."""
        self.forward: Callable[..., torch.Tensor] | None = None
        self.error: Exception | None = None
        self.compiled_now = False  # the file is this run's compile process's, not a start's before
        self._thread = threading.Thread(
            target=self._run, args=(model,), name="pagellm-load-compiled", daemon=True
        )
        if start:
            self.start()

    def start(self) -> None:
        """Start loading; nothing if it has started."""
        if self.started is None:
            self.started = time.monotonic()
            self._thread.start()

    def _run(self, model: torch.nn.Module) -> None:
        try:
            self.forward = load(self.path, model)
        except Exception as e:  # a torch upgrade's format, a truncated file: said by the runner
            self.error = e

    def poll(self) -> bool | None:
        """None until it has loaded; then whether it did."""
        if self.started is None or self._thread.is_alive():
            return None
        return self.forward is not None

    def wait(self) -> None:
        """Load now (starting the thread if it has not), and return once it is done."""
        self.start()
        self._thread.join()


def _end(process: subprocess.Popen, request_file: str) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    if os.path.exists(request_file):
        os.unlink(request_file)
