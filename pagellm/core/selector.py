"""Start-up selection of the device platform and the attention backend (docs/architecture.md, "Start-up").

Every rejection carries a reason; an explicit choice that cannot work is an error that lists the
alternatives; `auto` takes the best available platform and the fastest compatible backend.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.errors import BackendUnsupportedError, DeviceUnavailableError, QuantizationUnsupportedError
from pagellm.core.platform import Availability, Platform
from pagellm.core.quant import QuantMethod
from pagellm.core.registry import Registry

logger = logging.getLogger("pagellm.selector")

AUTO = "auto"


@dataclass
class PlatformChoice:
    platform: type[Platform]
    availability: dict[str, Availability]
    explanation: list[str]


@dataclass
class BackendChoice:
    backend: type[AttentionBackend]
    spec: AttentionSpec  # what it runs: the spec asked for, with the block size chosen with it
    rejected: dict[str, list[str]]  # backend name -> reasons, for every incompatible backend
    timings: dict[str, float] = field(default_factory=dict)  # seconds per timed step, when measured
    explanation: list[str] = field(default_factory=list)


def platform_availability(registry: Registry) -> dict[str, Availability]:
    """Availability of every registered platform; a probe that raises counts as unavailable."""
    result = {}
    for name, platform in sorted(registry.platforms.items()):
        try:
            result[name] = platform.availability()
        except Exception as exc:  # a broken probe must not hide the other platforms
            result[name] = Availability.no(f"availability check raised {type(exc).__name__}: {exc}")
    return result


def select_platform(registry: Registry, requested: str | None = AUTO) -> PlatformChoice:
    requested = (requested or AUTO).strip().lower()
    availability = platform_availability(registry)
    available = [n for n, a in availability.items() if a.ok]
    if requested != AUTO:
        if requested not in registry.platforms:
            raise DeviceUnavailableError(
                f"Device {requested!r} is not a registered platform. {_platform_summary(availability)} "
                f"Choose one of: {', '.join(available + [AUTO])} (or install the plugin that provides {requested!r})."
            )
        if not availability[requested].ok:
            raise DeviceUnavailableError(
                f"Device {requested!r} is unavailable: {availability[requested].reason}. "
                f"{_platform_summary(availability, skip=requested)} "
                f"Use --device {available[0] if available else AUTO} instead, or fix the cause above."
            )
        return PlatformChoice(
            registry.platforms[requested], availability, [f"device {requested} (requested)"]
        )
    if not available:
        raise DeviceUnavailableError(f"No device platform is available. {_platform_summary(availability)}")
    ranked = sorted(available, key=lambda n: (-registry.platforms[n].priority, n))
    chosen = ranked[0]
    explanation = [
        f"device {chosen} (auto: highest-priority available platform; {availability[chosen].reason})"
    ]
    explanation += [f"  also available, lower priority: {n}" for n in ranked[1:]]
    explanation += [f"  unavailable: {n}: {a.reason}" for n, a in availability.items() if not a.ok]
    return PlatformChoice(registry.platforms[chosen], availability, explanation)


def _platform_summary(availability: dict[str, Availability], skip: str | None = None) -> str:
    parts = [
        f"{name} ({'available' if a.ok else 'unavailable: ' + a.reason})"
        for name, a in availability.items()
        if name != skip
    ]
    return "Platforms found: " + ("; ".join(parts) if parts else "none") + "."


def backend_ranking(registry: Registry, platform: type[Platform]) -> list[str]:
    """Every registered backend: the platform's preference order first, then the rest by name."""
    preferred = [n for n in platform.preferred_attention_backends() if n in registry.attention_backends]
    return preferred + sorted(n for n in registry.attention_backends if n not in preferred)


def candidate_spec(
    backend: type[AttentionBackend], spec: AttentionSpec, choose_block_size: bool
) -> AttentionSpec:
    """`spec` as `backend` would run it: with the backend's preferred block size when the user gave none
    (`choose_block_size`), else exactly as given."""
    if not choose_block_size:
        return spec
    return dataclasses.replace(spec, block_size=backend.preferred_block_size())


def backend_reasons(
    registry: Registry, platform: type[Platform], spec: AttentionSpec, choose_block_size: bool = False
) -> dict[str, list[str]]:
    """name -> reasons it cannot run `spec` on `platform`, in ranking order (empty list: compatible).
    With `choose_block_size` each backend is checked with its own preferred block size."""
    result = {}
    for name in backend_ranking(registry, platform):
        backend = registry.attention_backends[name]
        try:
            result[name] = backend.unsupported_reasons(
                candidate_spec(backend, spec, choose_block_size), platform
            )
        except Exception as exc:
            result[name] = [f"compatibility check raised {type(exc).__name__}: {exc}"]
    return result


Timer = Callable[[type[AttentionBackend], AttentionSpec, type[Platform]], float]


def select_attention_backend(
    registry: Registry,
    platform: type[Platform],
    spec: AttentionSpec,
    requested: str | None = AUTO,
    timer: Timer | None = None,
    cache: TimingCache | None = None,
    choose_block_size: bool = False,
    load_probe: Callable[[], Callable[[], float | None]] | None = None,
) -> BackendChoice:
    """Pick the attention backend. `timer` measures one backend on `spec` (seconds, lower is better);
    without one, auto takes the first compatible backend in the platform's preference order.

    `choose_block_size` (no --block-size given): every candidate is checked and timed with its own
    `preferred_block_size()`, so a backend that needs large blocks (FLASH_ATTN: 256) can win, and the
    choice's `spec` carries the winner's block size. Otherwise `spec.block_size` binds every candidate.

    `load_probe()` starts a measure of other processes' CPU use and returns what reads it (default
    `timing.CpuLoad`): timings taken while the machine was busy pick the platform's order and are not
    cached."""
    requested = (requested or AUTO).strip()
    load_probe = load_probe or _cpu_load
    reasons = backend_reasons(registry, platform, spec, choose_block_size)
    compatible = [n for n, r in reasons.items() if not r]
    rejected = {n: r for n, r in reasons.items() if r}
    specs = {n: candidate_spec(registry.attention_backends[n], spec, choose_block_size) for n in compatible}
    if requested.lower() != AUTO:
        return _requested_backend(
            registry, platform, requested, reasons, compatible, rejected, specs, choose_block_size
        )
    if not compatible:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
        shapes = spec.shape_key() + (
            ", each backend at its preferred block size" if choose_block_size else ""
        )
        raise BackendUnsupportedError(
            f"No attention backend can run this model on {platform.name} ({shapes}). {detail or 'none registered'}."
        )
    chosen, how, timings = _auto_backend(
        registry, platform, compatible, specs, timer, cache, load_probe, choose_block_size
    )
    explanation = [f"attention backend {chosen} (auto: {how})"]
    ranking = list(reasons)
    for name in ranking[: ranking.index(chosen)]:
        if name in rejected:
            explanation.append(f"  rejected {name}: {'; '.join(rejected[name])}")
        else:
            explanation.append(f"  slower: {name}")
    explanation.append(_block_size_line(chosen, specs, choose_block_size))
    return BackendChoice(registry.attention_backends[chosen], specs[chosen], rejected, timings, explanation)


def _requested_backend(
    registry: Registry,
    platform: type[Platform],
    requested: str,
    reasons: dict[str, list[str]],
    compatible: list[str],
    rejected: dict[str, list[str]],
    specs: dict[str, AttentionSpec],
    choose_block_size: bool,
) -> BackendChoice:
    """The backend named by --attention-backend, or an error naming the compatible ones when it does not
    exist or cannot run the model."""
    name = requested.upper()
    if name not in registry.attention_backends:
        raise BackendUnsupportedError(
            f"Attention backend {requested!r} does not exist. Registered backends: "
            f"{', '.join(reasons) or 'none'}; compatible here: {', '.join(compatible) or 'none'}. "
            f"Use --attention-backend {compatible[0] if compatible else AUTO}."
        )
    if rejected.get(name):
        raise BackendUnsupportedError(
            f"Attention backend {name} cannot run this model on {platform.name}: "
            f"{'; '.join(rejected[name])}. Compatible here: {', '.join(compatible) or 'none'}. "
            f"Use --attention-backend {compatible[0] if compatible else AUTO}."
        )
    explanation = [
        f"attention backend {name} (requested)",
        _block_size_line(name, specs, choose_block_size),
    ]
    return BackendChoice(registry.attention_backends[name], specs[name], rejected, {}, explanation)


def _auto_backend(
    registry: Registry,
    platform: type[Platform],
    compatible: list[str],
    specs: dict[str, AttentionSpec],
    timer: Timer | None,
    cache: TimingCache | None,
    load_probe: Callable[[], Callable[[], float | None]],
    choose_block_size: bool,
) -> tuple[str, str, dict[str, float]]:
    """Auto's choice among the compatible backends, how it was made (for the explanation) and the
    timings: the first in preference order, or, when a `timer` measured them while the machine was not
    busy, the first that no other beats by more than `TIMING_MARGIN` (`_within_margin`)."""
    timings: dict[str, float] = {}
    chosen = compatible[0]
    how = "the only compatible backend" if len(compatible) == 1 else "first compatible in preference order"
    if len(compatible) > 1 and timer is not None:
        backends = {n: registry.attention_backends[n] for n in compatible}
        measured, busy = _timed(backends, specs, platform, timer, cache, load_probe)
        timings = {n: m.best for n, m in measured.items()}
        shown = ", ".join(
            f"{n} {t * 1e3:.2f} ms" + (f" (block size {specs[n].block_size})" if choose_block_size else "")
            for n, t in timings.items()
        )
        if busy is not None:
            how = f"first compatible in preference order: {busy}, so its timings are not trusted ({shown})"
        else:
            chosen = _within_margin(compatible, measured)
            fastest = min(timings.values())
            why = (
                "fastest measured"
                if timings[chosen] == fastest
                else "first in preference order within 10% of the fastest"
            )
            how = f"{why}: {shown}"
    return chosen, how, timings


TIMING_MARGIN = 0.10
"""How much faster a backend must time than one earlier in the platform's preference order to be chosen over
it. The timing is one layer's eager forward on a prefill chunk and a decode batch, where two cores' noise is a
few percent; it does not see what an earlier backend may do better outside it (CPU_ATTN's decode runs in the
compiled graph without Python, and a one-request decode step's attention is ~1.8 ms with it against ~17 ms
with TORCH_SDPA on model S, AVX2 EPYC, which the timing had put 4% ahead)."""


def _block_size_line(name: str, specs: dict[str, AttentionSpec], chosen: bool) -> str:
    why = f"{name}'s preferred, as no --block-size was given" if chosen else "as given by --block-size"
    return f"KV-cache block size {specs[name].block_size} ({why})"


def _cpu_load() -> Callable[[], float | None]:
    from pagellm.core.timing import CpuLoad

    return CpuLoad().others


TIMING_ROUNDS = 5
"""Timed steps per backend (after an untimed one), taken in rounds that run every candidate once, so that a
burst of other work slows all of them alike."""

BUSY_SHARE = 0.25
"""Other processes' share of the machine's CPU time over the timings above which they are not trusted."""


@dataclass
class Measured:
    best: float  # seconds: the fastest round
    median: float  # seconds: the middle round


def _within_margin(order: list[str], measured: dict[str, Measured]) -> str:
    """The first backend in preference order that no other beats by more than TIMING_MARGIN both in its
    fastest round and in its median one: a later backend must be clearly faster, and repeatedly."""
    fastest = min(m.best for m in measured.values())
    typical = min(m.median for m in measured.values())
    return next(
        n
        for n in order
        if measured[n].best <= fastest * (1 + TIMING_MARGIN)
        or measured[n].median <= typical * (1 + TIMING_MARGIN)
    )


def _timed(
    backends: dict[str, type[AttentionBackend]],
    specs: dict[str, AttentionSpec],
    platform: type[Platform],
    timer: Timer,
    cache: TimingCache | None,
    load_probe: Callable[[], Callable[[], float | None]],
) -> tuple[dict[str, Measured], str | None]:
    """Each backend's timing, from the cache or measured in TIMING_ROUNDS interleaved rounds; and why the
    measurements are not to be trusted (the machine was busy), else None. Only trusted ones are cached."""
    keys = {
        n: "|".join([platform.name, platform.device_name(), b.name, b.version, specs[n].shape_key()])
        for n, b in backends.items()
    }
    measured = {n: hit for n in backends if cache is not None and (hit := cache.get(keys[n])) is not None}
    todo = [n for n in backends if n not in measured]
    if not todo:
        return measured, None
    for name in todo:  # a first, untimed call: inputs built, kernels compiled (a build is not "other work")
        timer(backends[name], specs[name], platform)
    others = load_probe()
    rounds: dict[str, list[float]] = {n: [] for n in todo}
    for _ in range(TIMING_ROUNDS):
        for name in todo:
            rounds[name].append(timer(backends[name], specs[name], platform))
    for name, times in rounds.items():
        times.sort()
        measured[name] = Measured(times[0], times[len(times) // 2])
    share = others()
    if share is not None and share > BUSY_SHARE:
        logger.info(
            "backend timings not cached: other processes used %.0f%% of the CPU meanwhile", 100 * share
        )
        return measured, f"other processes used {100 * share:.0f}% of the CPU while timing"
    if cache is not None:
        for name in todo:
            cache.put(keys[name], measured[name])
    return measured, None


class TimingCache:
    """Backend timings on disk (JSON), keyed by platform, device, backend, backend version and shapes. An
    entry of the older format (one number, measured without a check for other work) is measured again."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _load(self) -> dict[str, float]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> Measured | None:
        entry = self._load().get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return Measured(float(entry["best"]), float(entry["median"]))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, measured: Measured) -> None:
        data = self._load()
        data[key] = dataclasses.asdict(measured)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)


def quant_method_reasons(
    method: type[QuantMethod], platform: type[Platform], dtype: torch.dtype | None = None
) -> list[str]:
    """Why `method` cannot run on `platform` (in `dtype`, when given); empty: it can. Decided by the
    method's declared needs against the platform's facts (`QuantMethod.unsupported_reasons`); a check that
    raises is a reason too."""
    try:
        if dtype is None:  # methods written before the dtype argument keep working
            return method.unsupported_reasons(platform)
        return method.unsupported_reasons(platform, dtype)
    except Exception as exc:
        return [f"compatibility check raised {type(exc).__name__}: {exc}"]


def select_quant_method(
    registry: Registry,
    platform: type[Platform],
    requested: str | None,
    checkpoint_config: dict | None,
    dtype: torch.dtype | None = None,
) -> type[QuantMethod] | None:
    """The quantization method from --quantization or the checkpoint's quantization_config, or None.
    Refused, with every reason, where a need the method declares is unmet on `platform`."""
    name = requested
    if name is None and checkpoint_config:
        matches = [
            n for n, m in sorted(registry.quant_methods.items()) if m.matches_checkpoint(checkpoint_config)
        ]
        if not matches:
            raise QuantizationUnsupportedError(
                f"the checkpoint is quantized as {checkpoint_config.get('quant_method')!r}, which no installed "
                f"quantization method reads; installed: {', '.join(sorted(registry.quant_methods)) or 'none'}"
            )
        name = matches[0]
    if name is None:
        return None
    if name not in registry.quant_methods:
        raise QuantizationUnsupportedError(
            f"quantization method {name!r} does not exist; installed: {', '.join(sorted(registry.quant_methods)) or 'none'}"
        )
    method = registry.quant_methods[name]
    reasons = quant_method_reasons(method, platform, dtype)
    if reasons:
        raise QuantizationUnsupportedError(
            f"quantization {name} cannot run on {platform.name}: {'; '.join(reasons)}"
        )
    return method
