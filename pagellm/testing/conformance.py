"""Attention-backend conformance suite: every registered backend against `reference_attention`.

One command, run where pagellm and the backend's package are installed:

    PAGELLM_DEVICE=<platform> PAGELLM_ATTENTION_BACKEND=<NAME> pytest --pyargs pagellm.testing.conformance

Both variables are optional, with the same meaning as for the engine: no device means the one `--device
auto` would pick, no backend means every registered backend, built-in or plugin (a comma-separated list
also works). Each backend runs every case its facts claim it supports on that platform (its dtypes, head
sizes and block sizes, GQA and MQA, prefill, chunked prefill, decode, mixed batches, sequences ending on
and around block boundaries, long contexts); a case it declares unsupported via `unsupported_reasons` is
not run. The per-layer features are cases for every backend: sliding windows of several sizes, logit
soft-capping, attention sinks, the latent KV layout of Multi-head Latent Attention (one cached row per
token, V its prefix), their combinations, and models whose layers mix them in one step; those a backend
refuses (it does not claim the feature) are reported as skipped, with its reasons. A backend with
no case it can run is reported as skipped, with why.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.dtypes import dtype_name
from pagellm.core.platform import Platform
from pagellm.core.selector import select_platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_layers

Step = tuple[tuple[int, ...], tuple[int, ...]]  # (seq_lens, query_lens), as check_backend takes them

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Largest absolute difference from the float32 reference allowed, by compute dtype."""

KV_CACHE_TOLERANCE = {torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.5, torch.int8: 0.06}
"""The same for one-byte KV caches, whose rounding of K and V dominates (fp8: 3 or 2 mantissa bits; int8:
max |x| / 254 per row): the reference attends over unrounded K/V, so this bounds the cache's error, not
the kernel's."""

MIXED: tuple[Step, ...] = (
    ((17,), (17,)),  # prefill
    ((40, 33), (8, 17)),  # chunked prefill over cached context
    ((15, 1, 33, 70), (1, 1, 1, 1)),  # decode batch
    ((40, 17, 5, 33), (8, 1, 1, 17)),  # prefill chunks and decodes in one step
)


LONG: tuple[Step, ...] = (
    ((1500, 700, 20), (1, 1, 1)),  # long decodes beside a short one (split contexts, flash-decoding)
    ((1500, 300), (1, 64)),  # a long decode beside a chunk over cached context
)


def _block_boundary_steps(block_size: int) -> tuple[Step, ...]:
    """Sequences and chunks that end just before, on and just after block boundaries."""
    b = block_size
    lens = (b - 1, b, b + 1, 2 * b)
    return (
        (lens, lens),
        (lens, (1, 1, 1, 1)),
        ((2 * b, 2 * b + 1, 3 * b), (b, b + 1, 1)),
    )


@dataclass(frozen=True)
class ConformanceCase:
    id: str
    spec: AttentionSpec
    steps: tuple[Step, ...]
    more_layers: tuple[AttentionSpec, ...] = ()
    """Further layers run in the same steps beside `spec`'s, each with its own spec (a mixed model)."""
    feature: bool = False
    """A per-layer feature (window, soft-cap, sinks): reported as skipped, with why, where refused."""

    @property
    def layers(self) -> tuple[AttentionSpec, ...]:
        return (self.spec, *self.more_layers)

    @property
    def tolerance(self) -> float:
        return max(
            KV_CACHE_TOLERANCE.get(spec.cache_dtype) or TOLERANCE.get(spec.dtype, 3e-2)
            for spec in self.layers
        )

    def unsupported_reasons(self, backend: type[AttentionBackend], platform: type[Platform]) -> list[str]:
        reasons = (r for spec in self.layers for r in backend.unsupported_reasons(spec, platform))
        return list(dict.fromkeys(reasons))


def candidate_cases(backend: type[AttentionBackend], platform: type[Platform]) -> list[ConformanceCase]:
    """The cases `backend`'s facts claim: one axis at a time around a base spec the backend supports."""
    dtypes = [d for d in backend.dtypes if d in platform.supported_dtypes] or list(backend.dtypes)
    dtype = platform.default_dtype if platform.default_dtype in dtypes else dtypes[0]
    head_sizes = list(backend.head_sizes or (64, 80, 128))
    head_size = 64 if 64 in head_sizes else head_sizes[0]
    block_sizes = list(backend.block_sizes or (16, 32, 256))
    base = AttentionSpec(8, 2, head_size, dtype)

    def spec(**changes) -> AttentionSpec:
        return dataclasses.replace(base, **changes)

    # the other axes vary around a block size the backend takes (a rule beyond its facts may refuse some)
    taken = [b for b in block_sizes if not backend.unsupported_reasons(spec(block_size=b), platform)]
    block_size = 16 if 16 in taken else (taken or block_sizes)[0]
    base = spec(block_size=block_size)

    cases = [ConformanceCase(f"dtype-{dtype_name(d)}", spec(dtype=d), MIXED) for d in dtypes]
    cases += [ConformanceCase(f"head_size-{h}", spec(head_size=h), MIXED[-1:]) for h in head_sizes]
    cases += [
        ConformanceCase(f"block_size-{b}", spec(block_size=b), _block_boundary_steps(b)) for b in block_sizes
    ]
    for heads, kv_heads in ((4, 4), (8, 1), (9, 3)):
        cases.append(
            ConformanceCase(
                f"heads-{heads}-kv{kv_heads}", spec(num_heads=heads, num_kv_heads=kv_heads), MIXED
            )
        )
    cases.append(ConformanceCase("long_context", base, LONG))
    cases += [
        ConformanceCase(f"kv_cache_dtype-{dtype_name(d)}", spec(kv_cache_dtype=d), MIXED + LONG[:1])
        for d in KV_CACHE_TOLERANCE
        if d in (backend.kv_cache_dtypes or ())
    ]
    return cases + feature_cases(base)


def feature_cases(base: AttentionSpec) -> list[ConformanceCase]:
    """The per-layer features around `base`, whether or not a backend claims them (`conformance_cases`
    sorts them): sliding windows of 1 token (itself only), a few tokens, one block, more than a block and
    more than any sequence; soft-caps tight enough to bend most scores (5) and as models set them (30,
    after a scale other than head_size ** -0.5); sinks alone, with a window and over long contexts (where
    contexts are split and merged); the latent layout (DeepSeek's MLA in the weight-absorbed form: MQA over
    one row of head_size + 16 per token whose first head_size elements are V), alone and over long contexts;
    chunked local attention (Llama 4) in chunks of a few tokens, one block and more than a block; and
    models whose layers mix them in each step."""
    b = base.block_size

    def case(name: str, steps: tuple[Step, ...], **changes) -> ConformanceCase:
        return ConformanceCase(name, dataclasses.replace(base, **changes), steps, feature=True)

    windows = dict.fromkeys((1, 7, b, 20, 4096))  # 7 and 20: shorter than most sequences in MIXED
    cases = [case(f"sliding_window-{w}", MIXED, sliding_window=w) for w in windows]
    cases += [
        case("long_context-sliding_window-300", LONG, sliding_window=300),
        case("soft_cap-5", MIXED, logits_soft_cap=5.0),
        case("soft_cap-30-scale-0.1", MIXED, logits_soft_cap=30.0, scale=0.1),
        case("soft_cap-5-sliding_window-7", MIXED, logits_soft_cap=5.0, sliding_window=7),
        case("long_context-soft_cap-5", LONG, logits_soft_cap=5.0),
        case("sinks", MIXED, has_sinks=True),
        case("sinks-sliding_window-7", MIXED, has_sinks=True, sliding_window=7),
        case("long_context-sinks", LONG, has_sinks=True),
        case(
            "sinks-soft_cap-5-sliding_window-20",
            MIXED,
            has_sinks=True,
            logits_soft_cap=5.0,
            sliding_window=20,
        ),
    ]
    # chunked local attention (Llama 4): chunks of a few tokens, one block, more than a block
    chunks = dict.fromkeys((7, b, 20))
    cases += [case(f"attention_chunk-{c}", MIXED, attention_chunk=c) for c in chunks]
    cases.append(case("long_context-attention_chunk-300", LONG, attention_chunk=300))
    chunked = (
        dataclasses.replace(base, attention_chunk=20),
        base,
        dataclasses.replace(base, sliding_window=7),
    )
    cases.append(
        ConformanceCase("mixed_layers-attention_chunk", chunked[0], MIXED, chunked[1:], feature=True)
    )
    latent = dict(num_kv_heads=1, head_size=base.head_size + 16, v_head_size=base.head_size, latent_kv=True)
    cases += [case("latent_kv", MIXED, **latent), case("long_context-latent_kv", LONG, **latent)]
    # Gemma 2/3- and GPT-OSS-like: local and global layers, capped or with sinks, over one step's metadata
    mixed = [
        dataclasses.replace(base, sliding_window=7),
        base,
        dataclasses.replace(base, logits_soft_cap=5.0),
        dataclasses.replace(base, sliding_window=20, has_sinks=True),
        dataclasses.replace(base, has_sinks=True),
        dataclasses.replace(base, sliding_window=b, logits_soft_cap=30.0, scale=0.1),
    ]
    windowed = [
        mixed[0],
        base,
        dataclasses.replace(base, sliding_window=20),
        dataclasses.replace(base, sliding_window=b),
    ]
    cases.append(
        ConformanceCase("mixed_layers-sliding_window", windowed[0], MIXED, tuple(windowed[1:]), feature=True)
    )
    cases.append(ConformanceCase("mixed_layers", mixed[0], MIXED, tuple(mixed[1:]), feature=True))
    # latent layers beside a plain one, one of them windowed, over one step's metadata
    latent_layers = (
        dataclasses.replace(base, **latent),
        base,
        dataclasses.replace(base, **latent, sliding_window=7),
    )
    cases.append(
        ConformanceCase("mixed_layers-latent_kv", latent_layers[0], MIXED, latent_layers[1:], feature=True)
    )
    return cases


def conformance_cases(
    backend: type[AttentionBackend], platform: type[Platform]
) -> tuple[list[ConformanceCase], list[str]]:
    """The candidate cases `backend` accepts on `platform`, and every reason it gave for those it refused."""
    runnable, refused = [], []
    for case in candidate_cases(backend, platform):
        reasons = case.unsupported_reasons(backend, platform)
        if reasons:
            refused += reasons
        else:
            runnable.append(case)
    return runnable, refused


def skipped_features(
    backend: type[AttentionBackend], platform: type[Platform]
) -> list[tuple[ConformanceCase, list[str]]]:
    """The feature cases `backend` refuses on `platform`, each with its reasons (reported as skips)."""
    refused = []
    for case in candidate_cases(backend, platform):
        reasons = case.unsupported_reasons(backend, platform)
        if case.feature and reasons:
            refused.append((case, reasons))
    return refused


def selected() -> tuple[type[Platform], dict[str, type[AttentionBackend]]]:
    """The platform and backends named by PAGELLM_DEVICE and PAGELLM_ATTENTION_BACKEND (default: all)."""
    registry = load_plugins()
    platform = select_platform(registry, os.environ.get("PAGELLM_DEVICE")).platform
    backends = registry.attention_backends
    wanted = os.environ.get("PAGELLM_ATTENTION_BACKEND", "").strip()
    if wanted and wanted.lower() != "auto":
        names = [n.strip().upper() for n in wanted.split(",") if n.strip()]
        missing = [n for n in names if n not in backends]
        if missing:
            raise pytest.UsageError(
                f"PAGELLM_ATTENTION_BACKEND names {', '.join(missing)}, which no installed plugin registers; "
                f"registered: {', '.join(sorted(backends)) or 'none'}"
            )
        backends = {n: backends[n] for n in names}
    return platform, dict(sorted(backends.items()))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    platform, backends = selected()
    params = []
    for name, backend in backends.items():
        runnable, refused = conformance_cases(backend, platform)
        params += [pytest.param(backend, platform, case, id=f"{name}-{case.id}") for case in runnable]
        if runnable:
            params += [
                pytest.param(
                    backend,
                    platform,
                    None,
                    id=f"{name}-{case.id}",
                    marks=pytest.mark.skip("; ".join(reasons)),
                )
                for case, reasons in skipped_features(backend, platform)
            ]
        else:
            why = f"{name} runs no claimed case on {platform.name}: " + "; ".join(dict.fromkeys(refused))
            params.append(
                pytest.param(backend, platform, None, id=f"{name}-none", marks=pytest.mark.skip(why))
            )
    metafunc.parametrize("backend, platform, case", params)


def test_matches_reference(
    backend: type[AttentionBackend], platform: type[Platform], case: ConformanceCase
) -> None:
    errors = check_layers(backend, case.layers, platform.device(), case.steps)
    for spec, error in zip(case.layers, errors, strict=True):
        assert error <= case.tolerance, (
            f"{backend.name} on {platform.name}, {case.id} ({spec.shape_key()}): largest difference from "
            f"the reference {error:.3g} > {case.tolerance:g}"
        )
