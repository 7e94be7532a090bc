import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.core.selector import select_platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_layers
from pagellm.testing.conformance import candidate_cases, conformance_cases, skipped_features

COMMAND = [
    sys.executable,
    "-m",
    "pytest",
    "--pyargs",
    "pagellm.testing.conformance",
    "-q",
    "-p",
    "no:cacheprovider",
]


def run_suite(cwd, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The documented command, as a vendor runs it: outside our repo, chosen by environment variables.
    One thread each: small shapes gain nothing from two, and the test runs beside others."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([*COMMAND, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_vendor_backend_passes_on_its_platform(vendor_plugin, tmp_path):
    result = run_suite(tmp_path, PAGELLM_DEVICE="vendor_sim", PAGELLM_ATTENTION_BACKEND="VENDOR_ATTN")
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


WRONG_PLUGIN = '''
import dataclasses

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"


class WrongAttn(TorchSDPABackend):
    """Claims sliding-window support, then attends to the whole context."""

    name = "WRONG_ATTN"

    def __init__(self, spec):
        super().__init__(dataclasses.replace(spec, sliding_window=None))


@hookimpl
def pagellm_attention_backends():
    return [WrongAttn]
'''


@pytest.mark.slow
def test_wrong_backend_fails(tmp_path):
    """A plugin installed the lightest way (a module and its dist-info on the path) that gets windows wrong."""
    (tmp_path / "wrong_attn.py").write_text(WRONG_PLUGIN)
    dist = tmp_path / "wrong_attn-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: wrong-attn\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pagellm.plugins]\nwrong_attn = wrong_attn\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = run_suite(
        tmp_path, PYTHONPATH=path, PAGELLM_DEVICE="cpu", PAGELLM_ATTENTION_BACKEND="WRONG_ATTN"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    failed = sorted(
        line.split("[")[1].rstrip("]").split("]")[0]
        for line in result.stdout.splitlines()
        if line.startswith("FAILED")
    )
    assert failed == [
        "WRONG_ATTN-long_context-sliding_window-300",
        "WRONG_ATTN-mixed_layers",
        "WRONG_ATTN-mixed_layers-attention_chunk",  # its windowed layer
        "WRONG_ATTN-mixed_layers-latent_kv",
        "WRONG_ATTN-mixed_layers-sliding_window",
        "WRONG_ATTN-sinks-sliding_window-7",
        "WRONG_ATTN-sinks-soft_cap-5-sliding_window-20",
        "WRONG_ATTN-sliding_window-1",
        "WRONG_ATTN-sliding_window-16",
        "WRONG_ATTN-sliding_window-20",
        "WRONG_ATTN-sliding_window-7",
        "WRONG_ATTN-soft_cap-5-sliding_window-7",
    ], result.stdout
    # a window longer than every sequence is no window: that case passes
    assert (
        "12 failed, 27 passed" in result.stdout and "largest difference from the reference" in result.stdout
    )


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16)
    default_dtype = torch.bfloat16


class _GPU(Platform):
    name = "testgpu"
    device_type = "cuda"


def test_cases_follow_the_backends_claims():
    class Narrow(TorchSDPABackend):
        name = "NARROW"
        dtypes = (torch.float16, torch.float32)
        head_sizes = (64, 128)
        block_sizes = (32,)
        supports_sliding_window = False
        supports_logits_soft_cap = False
        supports_sinks = False
        supports_attention_chunk = False

    ids = [case.id for case in candidate_cases(Narrow, _CPU)]
    claimed = [
        "dtype-float32",
        "head_size-64",
        "head_size-128",
        "block_size-32",
        "heads-4-kv4",
        "heads-8-kv1",
        "heads-9-kv3",
        "long_context",
        "kv_cache_dtype-float8_e4m3fn",
        "kv_cache_dtype-float8_e5m2",
    ]
    assert ids == claimed + FEATURES
    assert all(
        c.spec.block_size == 32 and c.spec.dtype == torch.float32
        for case in candidate_cases(Narrow, _CPU)
        for c in [case, *(dataclasses.replace(case, spec=s) for s in case.more_layers)]
    )
    # the features it does not claim are skipped, each with its reasons
    runnable, refused = conformance_cases(Narrow, _CPU)
    assert [case.id for case in runnable] == claimed
    skipped = {case.id: reasons for case, reasons in skipped_features(Narrow, _CPU)}
    assert list(skipped) == FEATURES
    assert skipped["sinks"] == ["no attention-sink support"]
    assert skipped["soft_cap-5-sliding_window-7"] == [
        "no sliding-window support",
        "no logits soft-cap support",
    ]
    assert skipped["mixed_layers"] == [
        "no sliding-window support",
        "no logits soft-cap support",
        "no attention-sink support",
    ]
    ids = [case.id for case in candidate_cases(TorchSDPABackend, _CPU)]
    assert "sliding_window-7" in ids and "soft_cap-5" in ids and "sinks" in ids and "dtype-bfloat16" in ids
    runnable, refused = conformance_cases(TorchSDPABackend, _CPU)
    assert len(runnable) == len(ids) and refused == [] and skipped_features(TorchSDPABackend, _CPU) == []


FEATURES = [
    "sliding_window-1",
    "sliding_window-7",
    "sliding_window-32",
    "sliding_window-20",
    "sliding_window-4096",
    "long_context-sliding_window-300",
    "soft_cap-5",
    "soft_cap-30-scale-0.1",
    "soft_cap-5-sliding_window-7",
    "long_context-soft_cap-5",
    "sinks",
    "sinks-sliding_window-7",
    "long_context-sinks",
    "sinks-soft_cap-5-sliding_window-20",
    "attention_chunk-7",
    "attention_chunk-32",
    "attention_chunk-20",
    "long_context-attention_chunk-300",
    "mixed_layers-attention_chunk",
    "latent_kv",
    "long_context-latent_kv",
    "mixed_layers-sliding_window",
    "mixed_layers",
    "mixed_layers-latent_kv",
]
"""The per-layer feature cases for a backend whose block size is 32, in order."""


@pytest.mark.parametrize(
    "name", ["TORCH_SDPA", pytest.param("FLEX_ATTENTION", marks=pytest.mark.slow), "CPU_ATTN"]
)
def test_builtin_cpu_backends_pass_the_feature_cases(name):
    """Every built-in backend that runs on CPU claims windows, soft-cap, sinks and chunked local attention,
    and passes those cases
    (the long-context ones are left to each backend's own tests: minutes here, on one thread); TORCH_SDPA
    and CPU_ATTN also claim the latent (MLA) layout, and FLEX_ATTENTION refuses it."""
    registry = load_plugins()
    backend = registry.attention_backends[name]
    platform = select_platform(registry, "cpu").platform
    runnable, _ = conformance_cases(backend, platform)
    cases = [case for case in runnable if case.feature and not case.id.startswith("long_context")]
    skipped = {case.id: reasons for case, reasons in skipped_features(backend, platform)}
    if name == "FLEX_ATTENTION":
        assert len(cases) == 17 and list(skipped) == [
            "latent_kv",
            "long_context-latent_kv",
            "mixed_layers-latent_kv",
        ]
        assert set(skipped["latent_kv"]) == {"no latent KV cache (MLA) support"}
    else:
        assert len(cases) == 19 and skipped == {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for case in cases:
            errors = check_layers(backend, case.layers, "cpu", case.steps)
            assert max(errors) <= case.tolerance, f"{name} {case.id}: {errors}"
    finally:
        torch.set_num_threads(threads)


def test_refused_cases_carry_the_backends_reasons():
    class CudaOnly(TorchSDPABackend):
        name = "CUDA_ONLY"
        device_types = ("cuda",)

    runnable, refused = conformance_cases(CudaOnly, _CPU)
    assert runnable == [] and set(refused) == {"runs on device types cuda, not cpu"}
    spec = AttentionSpec(8, 2, 64, torch.float32)
    assert CudaOnly.unsupported_reasons(spec, _GPU) == []
