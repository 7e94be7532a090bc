"""Selection rules of docs/architecture.md ("Start-up"), on a registry of fake platforms and backends."""

import dataclasses
import logging

import pytest
import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.errors import BackendUnsupportedError, DeviceUnavailableError, QuantizationUnsupportedError
from pagellm.core.platform import CAPABILITIES, Availability, Platform
from pagellm.core.quant import QuantMethod
from pagellm.core.registry import Registry
from pagellm.core.selector import (
    TIMING_ROUNDS,
    Measured,
    TimingCache,
    backend_reasons,
    quant_method_reasons,
    select_attention_backend,
    select_platform,
    select_quant_method,
)

pytestmark = pytest.mark.usefixtures("idle_machine")


class Host(Platform):
    name, device_type, priority = "host", "cpu", 0
    attention_backends = ("FAST", "SLOW", "REF")

    @classmethod
    def availability(cls):
        return Availability.yes("always here")


class Accel(Platform):
    name, device_type, priority = "accel", "cuda", 100

    @classmethod
    def availability(cls):
        return Availability.no("no accel device nodes")


class Second(Platform):
    name, device_type, priority = "second", "cpu", 50

    @classmethod
    def availability(cls):
        return Availability.yes("second device present")


class Broken(Platform):
    name, device_type = "broken", "cpu"

    @classmethod
    def availability(cls):
        raise RuntimeError("probe exploded")


class Ref(AttentionBackend):
    name = "REF"


class Fast(AttentionBackend):
    name = "FAST"
    head_sizes = (128,)


class Slow(AttentionBackend):
    name = "SLOW"
    device_types = ("cpu",)


class GpuOnly(AttentionBackend):
    name = "GPU_ONLY"
    device_types = ("cuda",)


class Quant(QuantMethod):
    name = "q4"
    platforms = ("accel",)


def registry(*platforms):
    r = Registry()
    for p in platforms:
        r.add("platforms", p.name, p, "test")
    for b in (Ref, Fast, Slow, GpuOnly):
        r.add("attention_backends", b.name, b, "test")
    r.add("quant_methods", Quant.name, Quant, "test")
    return r


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32)


def test_auto_picks_highest_priority_available_and_lists_the_rest():
    choice = select_platform(registry(Host, Accel, Second))
    assert choice.platform is Second
    text = "\n".join(choice.explanation)
    assert "also available, lower priority: host" in text
    assert "accel: no accel device nodes" in text


def test_named_unavailable_device_explains_and_lists_alternatives():
    with pytest.raises(DeviceUnavailableError) as err:
        select_platform(registry(Host, Accel), "accel")
    msg = str(err.value)
    assert "'accel' is unavailable: no accel device nodes" in msg
    assert "host (available)" in msg and "--device host" in msg


def test_unknown_device_lists_registered_platforms():
    with pytest.raises(DeviceUnavailableError, match="not a registered platform.*host \\(available\\)"):
        select_platform(registry(Host), "nope")


def test_named_device_is_case_insensitive_and_probe_errors_are_reasons():
    assert select_platform(registry(Host, Broken), "HOST").platform is Host
    with pytest.raises(DeviceUnavailableError, match="probe exploded"):
        select_platform(registry(Host, Broken), "broken")


def test_no_platform_available():
    with pytest.raises(DeviceUnavailableError, match="No device platform is available.*accel"):
        select_platform(registry(Accel))


def test_auto_backend_takes_first_compatible_and_says_why_better_ones_were_rejected():
    choice = select_attention_backend(registry(Host), Host, SPEC)
    assert choice.backend is Slow
    text = "\n".join(choice.explanation)
    assert "rejected FAST: head size 64 not in [128]" in text
    assert (
        "GPU_ONLY" in choice.rejected
        and "runs on device types cuda, not cpu" in choice.rejected["GPU_ONLY"][0]
    )


def test_auto_backend_times_compatible_ones_and_caches(tmp_path):
    calls = []

    def timer(backend, spec, platform):
        calls.append(backend.name)
        return {"SLOW": 0.002, "REF": 0.001}[backend.name]

    cache = TimingCache(tmp_path / "t.json")
    choice = select_attention_backend(registry(Host), Host, SPEC, timer=timer, cache=cache)
    assert choice.backend is Ref and set(calls) == {"SLOW", "REF"}
    assert "fastest measured" in choice.explanation[0] and "slower: SLOW" in "\n".join(choice.explanation)
    again = select_attention_backend(
        registry(Host), Host, SPEC, timer=timer, cache=TimingCache(tmp_path / "t.json")
    )
    assert again.backend is Ref and len(calls) == 2 * (TIMING_ROUNDS + 1)  # served from the on-disk cache


def test_named_backend_incompatible_or_unknown_is_an_error_with_reasons():
    with pytest.raises(BackendUnsupportedError) as err:
        select_attention_backend(registry(Host), Host, SPEC, "fast")
    assert "head size 64 not in [128]" in str(err.value) and "Compatible here: SLOW, REF" in str(err.value)
    with pytest.raises(BackendUnsupportedError, match="does not exist.*Registered backends"):
        select_attention_backend(registry(Host), Host, SPEC, "MISSING")
    assert select_attention_backend(registry(Host), Host, SPEC, "ref").backend is Ref


def test_spec_features_are_checked():
    windowed = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=8)
    assert "no sliding-window support" in Ref.unsupported_reasons(windowed, Host)


def test_quant_method_reasons_and_checkpoint_detection():
    r = registry(Host, Accel)
    with pytest.raises(QuantizationUnsupportedError, match="runs on accel, not host"):
        select_quant_method(r, Host, "q4", None)
    with pytest.raises(QuantizationUnsupportedError, match="'awq', which no installed"):
        select_quant_method(r, Host, None, {"quant_method": "awq"})
    with pytest.raises(QuantizationUnsupportedError, match="does not exist"):
        select_quant_method(r, Host, "nope", None)
    assert select_quant_method(r, Accel, None, {"quant_method": "q4"}) is Quant
    assert select_quant_method(r, Host, None, None) is None


class Needy(QuantMethod):
    name = "needy"
    device_types = ("cuda",)
    requires = ("float8", "acme_dma")
    dtypes = (torch.float16,)


class Old(QuantMethod):
    """Overrides `unsupported_reasons` with the signature from before the dtype argument."""

    name = "old"

    @classmethod
    def unsupported_reasons(cls, platform):
        return [] if platform.name == "accel" else ["only on accel"]


class Raising(QuantMethod):
    name = "raising"

    @classmethod
    def unsupported_reasons(cls, platform, dtype=None):
        raise RuntimeError("probe exploded")


def test_quant_method_needs_are_checked_against_the_platform_facts():
    """Every unmet need is a reason, named; a platform declaring them all accepts the method, whatever its
    name (no platform lists methods)."""
    assert quant_method_reasons(Needy, Host) == [
        "runs on device types cuda, not cpu",
        f"needs float8 ({CAPABILITIES['float8']}), which platform host does not declare",
        "needs acme_dma, which platform host does not declare",
        "computes in float16; host supports float32",
    ]

    class Gpu(Accel):
        name, supported_dtypes = "gpu", (torch.float16, torch.float32)
        capabilities = frozenset({"float8", "acme_dma", "dtype_views"})

    assert quant_method_reasons(Needy, Gpu) == []
    assert quant_method_reasons(Needy, Gpu, torch.float32) == ["dtype float32 not in float16"]
    r = registry(Host, Gpu)
    r.add("quant_methods", Needy.name, Needy, "test")
    assert select_quant_method(r, Gpu, "needy", None, dtype=torch.float16) is Needy
    with pytest.raises(QuantizationUnsupportedError, match="needy cannot run on host: runs on device types"):
        select_quant_method(r, Host, "needy", None)


def test_old_style_and_raising_checks():
    assert quant_method_reasons(Old, Accel) == [] and quant_method_reasons(Old, Host) == ["only on accel"]
    assert quant_method_reasons(Raising, Host) == ["compatibility check raised RuntimeError: probe exploded"]


def test_duplicate_names_name_both_owners():
    r = registry(Host)
    with pytest.raises(Exception, match="registered twice: by test and by other-dist"):
        r.add("platforms", "host", Host, "other-dist")


def test_backend_log_is_info(caplog):
    caplog.set_level(logging.INFO)
    choice = select_attention_backend(registry(Host), Host, SPEC)
    assert choice.explanation  # the engine logs these lines at INFO at start-up


class Paged256(AttentionBackend):
    """Like FLASH_ATTN: runs only blocks of a multiple of 256 tokens, and says so."""

    name = "PAGED256"

    @classmethod
    def preferred_block_size(cls):
        return 256

    @classmethod
    def unsupported_reasons(cls, spec, platform):
        reasons = super().unsupported_reasons(spec, platform)
        if spec.block_size % 256:
            reasons.append(f"block size {spec.block_size}: needs a multiple of 256")
        return reasons


class Narrow(AttentionBackend):
    """An out-of-tree backend that lists block sizes without 16 and declares no preferred size."""

    name = "NARROW"
    block_sizes = (64, 32)


class BigFirst(Host):
    name = "bigfirst"
    attention_backends = ("PAGED256", "REF")


def block_registry(*backends):
    r = Registry()
    r.add("platforms", BigFirst.name, BigFirst, "test")
    for b in backends:
        r.add("attention_backends", b.name, b, "test")
    return r


def test_without_a_block_size_each_backend_runs_its_preferred_one():
    choice = select_attention_backend(block_registry(Paged256, Ref), BigFirst, SPEC, choose_block_size=True)
    assert choice.backend is Paged256 and choice.spec.block_size == 256
    assert choice.spec == dataclasses.replace(SPEC, block_size=256)
    assert (
        choice.explanation[-1]
        == "KV-cache block size 256 (PAGED256's preferred, as no --block-size was given)"
    )
    requested = select_attention_backend(
        block_registry(Paged256, Ref), BigFirst, SPEC, "ref", choose_block_size=True
    )
    assert requested.spec.block_size == 16  # the base class's default


def test_an_explicit_block_size_binds_every_candidate_and_says_why_one_is_refused():
    choice = select_attention_backend(block_registry(Paged256, Ref), BigFirst, SPEC)
    assert choice.backend is Ref and choice.spec is SPEC
    text = "\n".join(choice.explanation)
    assert "rejected PAGED256: block size 16: needs a multiple of 256" in text
    assert choice.explanation[-1] == "KV-cache block size 16 (as given by --block-size)"
    with pytest.raises(
        BackendUnsupportedError, match="PAGED256 cannot run.*block size 16: needs a multiple of 256"
    ):
        select_attention_backend(block_registry(Paged256, Ref), BigFirst, SPEC, "paged256")


def test_timing_compares_backends_at_their_own_block_sizes():
    seen = {}

    def timer(backend, spec, platform):
        seen[backend.name] = spec.block_size
        return {"PAGED256": 0.002, "REF": 0.001}[backend.name]

    choice = select_attention_backend(
        block_registry(Paged256, Ref), BigFirst, SPEC, timer=timer, choose_block_size=True
    )
    assert seen == {"PAGED256": 256, "REF": 16}
    assert choice.backend is Ref and choice.spec.block_size == 16
    assert "PAGED256 2.00 ms (block size 256)" in choice.explanation[0]


def test_a_backend_declaring_no_preferred_size_gets_16_or_its_smallest_block_size():
    assert Ref.preferred_block_size() == 16 and Narrow.preferred_block_size() == 32
    choice = select_attention_backend(block_registry(Narrow), BigFirst, SPEC, choose_block_size=True)
    assert choice.backend is Narrow and choice.spec.block_size == 32
    reasons = backend_reasons(block_registry(Narrow, Paged256, Ref), BigFirst, SPEC, choose_block_size=True)
    assert reasons == {"PAGED256": [], "NARROW": [], "REF": []}
    assert backend_reasons(block_registry(Narrow), BigFirst, SPEC)["NARROW"] == [
        "block size 16 not in [64, 32]"
    ]


def test_a_backend_within_the_timing_margin_keeps_the_preference_order(tmp_path):
    """Timings a few percent apart are noise on a small machine: the earlier backend in preference order
    stays unless a later one is more than 10% faster."""

    def timer(times):
        return lambda backend, spec, platform: times[backend.name]

    close = select_attention_backend(
        registry(Host), Host, SPEC, timer=timer({"SLOW": 0.00105, "REF": 0.001}), cache=None
    )
    assert close.backend is Slow
    assert "first in preference order within 10% of the fastest" in close.explanation[0]
    clear = select_attention_backend(
        registry(Host), Host, SPEC, timer=timer({"SLOW": 0.0012, "REF": 0.001}), cache=None
    )
    assert clear.backend is Ref and "fastest measured" in clear.explanation[0]


def test_timings_alternate_between_backends_round_by_round():
    """Interleaved: a burst of other work slows every candidate alike instead of one candidate's runs."""
    calls = []

    def timer(backend, spec, platform):
        calls.append(backend.name)
        return 0.001

    select_attention_backend(registry(Host), Host, SPEC, timer=timer, cache=None)
    assert calls == ["SLOW", "REF"] * (TIMING_ROUNDS + 1)  # an untimed round first


def test_a_later_backend_must_win_repeatedly_not_once():
    """One fast round (the other candidate's round hit by a burst) does not displace the preferred backend:
    it must be faster by the margin in its median round too."""
    rounds = {
        "SLOW": iter([0.001] * (TIMING_ROUNDS + 1)),
        "REF": iter([9.0, 0.0005] + [0.001] * (TIMING_ROUNDS - 1)),
    }
    choice = select_attention_backend(
        registry(Host), Host, SPEC, timer=lambda b, s, p: next(rounds[b.name]), cache=None
    )
    assert choice.backend is Slow


def test_a_busy_machine_neither_picks_by_its_timings_nor_caches_them(tmp_path, monkeypatch):
    """Timed beside other work, a backend that is slower on an idle machine measured faster; the choice is
    the platform's order, logged, and nothing is cached, so the next start (idle) measures and picks right."""
    from pagellm.core import selector

    busy_times = {"SLOW": 0.004, "REF": 0.001}  # REF looks 4x faster while the machine is busy
    idle_times = {"SLOW": 0.001, "REF": 0.002}  # alone, SLOW is the faster one
    cache = TimingCache(tmp_path / "t.json")
    monkeypatch.setattr(selector, "_cpu_load", lambda: lambda: 0.6)
    busy = select_attention_backend(
        registry(Host), Host, SPEC, timer=lambda b, s, p: busy_times[b.name], cache=cache
    )
    assert busy.backend is Slow
    assert "other processes used 60% of the CPU while timing" in busy.explanation[0]
    assert not cache.path.exists()
    monkeypatch.setattr(selector, "_cpu_load", lambda: lambda: 0.0)
    idle = select_attention_backend(
        registry(Host), Host, SPEC, timer=lambda b, s, p: idle_times[b.name], cache=cache
    )
    assert idle.backend is Slow and "fastest measured" in idle.explanation[0]
    assert cache.get(next(iter(cache._load()))) is not None


def test_a_cached_timing_of_the_old_format_is_measured_again(tmp_path):
    """One bare number per backend was cached without any check for other work: not trusted."""
    cache = TimingCache(tmp_path / "t.json")
    calls = []

    def timer(backend, spec, platform):
        calls.append(backend.name)
        return {"SLOW": 0.002, "REF": 0.001}[backend.name]

    select_attention_backend(registry(Host), Host, SPEC, timer=timer, cache=cache)
    data = cache._load()
    cache.path.write_text(__import__("json").dumps({k: 0.5 for k in data}))  # the format before
    calls.clear()
    choice = select_attention_backend(registry(Host), Host, SPEC, timer=timer, cache=cache)
    assert len(calls) == 2 * (TIMING_ROUNDS + 1) and choice.backend is Ref
    assert all(isinstance(cache.get(k), Measured) for k in data)


def test_the_load_probe_spans_only_the_timed_rounds(monkeypatch):
    """Each candidate's first, untimed call may build its kernels (child processes of this one, which the
    probe would count as other work): the probe starts after those calls."""
    from pagellm.core import selector

    events = []
    monkeypatch.setattr(selector, "_cpu_load", lambda: events.append("probe") or (lambda: 0.0))
    select_attention_backend(
        registry(Host), Host, SPEC, timer=lambda b, s, p: events.append(b.name) or 0.001, cache=None
    )
    assert events[:3] == ["SLOW", "REF", "probe"] and events.count("probe") == 1
