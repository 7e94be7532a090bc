import os
import subprocess
import sys

import torch

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Availability, Platform
from pagellm.core.registry import Registry
from pagellm.core.selector import TIMING_ROUNDS, TimingCache, select_attention_backend
from pagellm.core.timing import CpuLoad, time_backend

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"
    attention_backends = ("TORCH_SDPA",)

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("always, in tests")


class _OtherSDPA(TorchSDPABackend):
    name = "OTHER_SDPA"


def test_time_backend_returns_seconds():
    seconds = time_backend(TorchSDPABackend, SPEC, _CPU)
    assert isinstance(seconds, float)
    assert 0 < seconds < 5


def test_selector_times_each_backend_once_and_caches(tmp_path, idle_machine):
    registry = Registry()
    registry.add("attention_backends", "TORCH_SDPA", TorchSDPABackend, "test")
    registry.add("attention_backends", "OTHER_SDPA", _OtherSDPA, "test")
    calls = []

    def timer(backend, spec, platform):
        calls.append(backend.name)
        return time_backend(backend, spec, platform)

    cache = TimingCache(tmp_path / "timings.json")
    first = select_attention_backend(registry, _CPU, SPEC, timer=timer, cache=cache)
    assert sorted(calls) == sorted(["OTHER_SDPA", "TORCH_SDPA"] * (TIMING_ROUNDS + 1))
    assert cache.path.exists()
    assert set(first.timings) == {"OTHER_SDPA", "TORCH_SDPA"}

    second = select_attention_backend(registry, _CPU, SPEC, timer=timer, cache=TimingCache(cache.path))
    assert len(calls) == 2 * (TIMING_ROUNDS + 1)
    assert second.timings == first.timings
    assert second.backend is first.backend


def test_runtime_does_not_import_the_test_helpers():
    """The selector times backends in production, where `pagellm.testing` (for plugin authors) has no place."""
    code = (
        "import pkgutil, sys, importlib, pagellm.core, pagellm.attention_backends\n"
        "for pkg in (pagellm.core, pagellm.attention_backends):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__): importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "print(sorted(m for m in sys.modules if m.startswith('pagellm.testing')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_cpu_load_sees_another_process_spinning():
    """A process spinning on one core for a second while this one waits: about one core's share of the
    machine (at least half of it, whatever else runs)."""
    load = CpuLoad()
    spin = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    share = load.others()
    assert share is not None and share > 0.5 / (os.cpu_count() or 1)
