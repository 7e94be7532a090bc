"""Device detection of the five built-in platforms: every accelerator's available and unavailable paths with
faked probes, the facts each declares, and loading them through the real entry points."""

from __future__ import annotations

import fnmatch
import importlib.util

import pytest
import torch

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.platform import CAPABILITIES
from pagellm.core.selector import quant_method_reasons
from pagellm.platforms import cpu, cuda, rocm, tpu, xpu
from pagellm.plugins import load_plugins, reset_plugins
from pagellm.quantization.awq import AwqMethod
from pagellm.quantization.fp8 import Fp8Method
from pagellm.quantization.gguf import GgufMethod
from pagellm.quantization.gptq import GptqMethod
from pagellm.quantization.int8 import Int8Method

MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


@pytest.fixture(autouse=True)
def _no_device_masks(monkeypatch):
    for name in MASKS:
        monkeypatch.delenv(name, raising=False)


def fake(monkeypatch, module, **probes):
    for name, value in probes.items():
        monkeypatch.setattr(module, name, value if callable(value) else (lambda *a, v=value: v))


def fake_device(monkeypatch, platform, name="Fake GPU", capability=None):
    monkeypatch.setattr(platform, "device_name", classmethod(lambda cls, index=0: name))
    monkeypatch.setattr(platform, "device_capability", classmethod(lambda cls, index=0: capability))


# CUDA


def test_cuda_unavailable_on_cpu_torch(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version=None)
    a = cuda.CudaPlatform.availability()
    assert not a and a.reason == f"torch was built without CUDA (torch {torch.__version__})"


def test_cuda_unavailable_on_rocm_torch(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version="6.2.4", _torch_cuda_version=None)
    a = cuda.CudaPlatform.availability()
    assert not a and a.reason == "this torch is a ROCm build (HIP 6.2.4); use --device rocm"


def test_cuda_hidden_by_empty_mask(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    a = cuda.CudaPlatform.availability()
    assert not a and a.reason == "no NVIDIA device visible (CUDA_VISIBLE_DEVICES is empty)"


def test_cuda_no_driver(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=0)
    a = cuda.CudaPlatform.availability()
    assert not a and a.reason.startswith("no NVIDIA device visible (")
    assert "found no driver or GPU" in a.reason


def test_cuda_available(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=2)
    a = cuda.CudaPlatform.availability()
    assert a and a.reason == "found 2 NVIDIA device(s) (CUDA 12.8)"


@pytest.mark.parametrize("capability, resolved", [((7, 5), "float16"), ((8, 0), "auto"), ((9, 0), "auto")])
def test_cuda_auto_dtype_follows_capability_after_selection(monkeypatch, capability, resolved):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=1)
    fake_device(monkeypatch, cuda.CudaPlatform, capability=capability)
    monkeypatch.setattr(cuda.CudaPlatform, "device_count", classmethod(lambda cls: 1))
    config = EngineConfig(dtype="auto")
    cuda.CudaPlatform.check_and_update_config(config)
    assert config.dtype == resolved  # auto on a pre-Ampere device: float16; else the checkpoint decides


def test_cuda_dtype_facts_create_no_cuda_context(monkeypatch):
    """Reading the facts of an available CUDA platform must not query the device (issue 17): a capability
    query creates a CUDA context, before the platform is even selected."""
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=1)
    monkeypatch.setattr(cuda.CudaPlatform, "device_capability", classmethod(lambda cls, index=0: 1 / 0))
    assert cuda.CudaPlatform.default_dtype == torch.bfloat16
    assert torch.float16 in cuda.CudaPlatform.supported_dtypes


def test_cuda_refuses_bf16_before_ampere(monkeypatch):
    fake(monkeypatch, cuda, _torch_hip_version=None, _torch_cuda_version="12.8", _cuda_device_count=1)
    fake_device(monkeypatch, cuda.CudaPlatform, name="Tesla T4", capability=(7, 5))
    monkeypatch.setattr(cuda.CudaPlatform, "device_count", classmethod(lambda cls: 1))
    expected = r"dtype bfloat16 .*Tesla T4 \(compute capability 7.5\).*--dtype float16"
    with pytest.raises(ConfigError, match=expected):
        cuda.CudaPlatform.check_and_update_config(EngineConfig(dtype="bfloat16"))
    cuda.CudaPlatform.check_and_update_config(EngineConfig(dtype="float16"))
    cuda.CudaPlatform.check_and_update_config(EngineConfig(dtype="auto"))


@pytest.mark.parametrize("platform", [cuda.CudaPlatform, rocm.RocmPlatform, xpu.XpuPlatform, tpu.TpuPlatform])
@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.2])
def test_accelerators_refuse_bad_memory_utilization(platform, utilization):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        platform.check_and_update_config(EngineConfig(gpu_memory_utilization=utilization))


@pytest.mark.parametrize("platform", [cuda.CudaPlatform, rocm.RocmPlatform, xpu.XpuPlatform, tpu.TpuPlatform])
def test_accelerators_refuse_more_tensor_parallelism_than_devices(monkeypatch, platform):
    monkeypatch.setattr(platform, "device_count", classmethod(lambda cls: 4))
    monkeypatch.setattr(platform, "device_capability", classmethod(lambda cls, index=0: (9, 0)))
    expected = f"tensor_parallel_size 8 .* 4 {platform.name} device.*--tensor-parallel-size 4"
    with pytest.raises(ConfigError, match=expected):
        platform.check_and_update_config(EngineConfig(tensor_parallel_size=8))
    platform.check_and_update_config(EngineConfig(tensor_parallel_size=4))


# ROCm


def test_rocm_unavailable_on_cpu_torch(monkeypatch):
    fake(monkeypatch, rocm, _torch_hip_version=None, _torch_cuda_version=None)
    a = rocm.RocmPlatform.availability()
    assert not a and a.reason == f"torch was built without ROCm (torch {torch.__version__})"


def test_rocm_unavailable_on_cuda_torch(monkeypatch):
    fake(monkeypatch, rocm, _torch_hip_version=None, _torch_cuda_version="12.8")
    a = rocm.RocmPlatform.availability()
    assert not a and a.reason == "this torch is a CUDA build (CUDA 12.8); use --device cuda"


def test_rocm_needs_kfd(monkeypatch):
    fake(monkeypatch, rocm, _torch_hip_version="6.2.4", _path_exists=False, _rocm_device_count=1)
    a = rocm.RocmPlatform.availability()
    assert not a and a.reason.startswith("/dev/kfd is missing")


def test_rocm_hidden_by_mask(monkeypatch):
    fake(monkeypatch, rocm, _torch_hip_version="6.2.4", _path_exists=True, _rocm_device_count=0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    a = rocm.RocmPlatform.availability()
    assert not a and a.reason == "no AMD GPU visible (HIP_VISIBLE_DEVICES is empty)"


def test_rocm_available(monkeypatch):
    seen = []
    fake(monkeypatch, rocm, _torch_hip_version="6.2.4", _rocm_device_count=8)
    monkeypatch.setattr(rocm, "_path_exists", lambda path: seen.append(path) or True)
    a = rocm.RocmPlatform.availability()
    assert a and a.reason == "found 8 AMD GPU(s) (HIP 6.2.4)"
    assert seen == ["/dev/kfd"]


# XPU


def test_xpu_unavailable_when_not_compiled(monkeypatch):
    fake(monkeypatch, xpu, _xpu_compiled=False)
    a = xpu.XpuPlatform.availability()
    assert not a and a.reason == f"torch was built without XPU (torch {torch.__version__})"


def test_xpu_no_device(monkeypatch):
    fake(monkeypatch, xpu, _xpu_compiled=True, _xpu_device_count=0)
    a = xpu.XpuPlatform.availability()
    assert not a and a.reason == "no Intel GPU visible (no Intel GPU or Level Zero driver found)"


def test_xpu_available(monkeypatch):
    fake(monkeypatch, xpu, _xpu_compiled=True, _xpu_device_count=1)
    a = xpu.XpuPlatform.availability()
    assert a and a.reason.startswith("found 1 Intel GPU(s)")


def test_xpu_probe_matches_this_torch():
    assert xpu._xpu_compiled() is torch.xpu._is_compiled()


# TPU


def fake_tpu(monkeypatch, modules=("torch_xla", "libtpu"), nodes=()):
    fake(monkeypatch, tpu, _dist_version="2.8.0")
    monkeypatch.setattr(tpu, "_has_module", lambda name: name in modules)
    monkeypatch.setattr(tpu, "_glob", lambda pattern: sorted(fnmatch.filter(nodes, pattern)))
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)


def test_tpu_needs_torch_xla(monkeypatch):
    fake_tpu(monkeypatch, modules=("libtpu",), nodes=["/dev/accel0"])
    a = tpu.TpuPlatform.availability()
    assert not a and a.reason.startswith("torch_xla is not installed")


def test_tpu_needs_libtpu(monkeypatch):
    fake_tpu(monkeypatch, modules=("torch_xla",), nodes=["/dev/accel0"])
    a = tpu.TpuPlatform.availability()
    assert not a and a.reason.startswith("torch_xla is installed but libtpu is not")


def test_tpu_libtpu_from_library_path(monkeypatch, tmp_path):
    fake_tpu(monkeypatch, modules=("torch_xla",), nodes=["/dev/accel0"])
    (tmp_path / "libtpu.so").write_bytes(b"")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(tmp_path / "libtpu.so"))
    assert tpu.TpuPlatform.availability()


def test_tpu_needs_device_nodes(monkeypatch):
    fake_tpu(monkeypatch, nodes=["/dev/vfio/vfio", "/dev/null"])  # the VFIO container node is not a chip
    a = tpu.TpuPlatform.availability()
    assert not a and a.reason.startswith("no TPU device nodes")


@pytest.mark.parametrize(
    "nodes, count",
    [([f"/dev/accel{i}" for i in range(4)], 4), (["/dev/vfio/vfio", "/dev/vfio/0"], 1)],
)
def test_tpu_available(monkeypatch, nodes, count):
    fake_tpu(monkeypatch, nodes=nodes)
    a = tpu.TpuPlatform.availability()
    assert a and a.reason.startswith(f"found {count} TPU device node(s)") and "torch_xla 2.8.0" in a.reason


def test_tpu_refuses_float16(monkeypatch):
    fake_device(monkeypatch, tpu.TpuPlatform, name="TPU v5")
    monkeypatch.setattr(tpu.TpuPlatform, "device_count", classmethod(lambda cls: 1))
    with pytest.raises(ConfigError, match="dtype float16 is not supported by TPU v5.*--dtype bfloat16"):
        tpu.TpuPlatform.check_and_update_config(EngineConfig(dtype="float16"))


def test_tpu_availability_does_not_import_torch_xla(monkeypatch):
    imported = []
    monkeypatch.setattr(tpu.importlib.util, "find_spec", lambda name: imported.append(name))
    tpu.TpuPlatform.availability()
    assert imported == ["torch_xla"]


# facts and the real machine


GPU_BACKENDS = ("TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")
FACTS = {  # device_type, priority, attention backends, capabilities (less triton, which is looked up)
    "cuda": ("cuda", 100, ("FLASH_ATTN", *GPU_BACKENDS), {"float8", "dtype_views", "fp8_matmul"}),
    "rocm": ("cuda", 100, GPU_BACKENDS, {"float8", "dtype_views"}),
    "xpu": ("xpu", 90, GPU_BACKENDS, {"dtype_views"}),
    "tpu": ("xla", 80, ("TORCH_SDPA",), set()),
    "cpu": ("cpu", 0, ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"), {"float8", "dtype_views"}),
}
TRITON_BACKENDS = {"cuda", "rocm", "xpu"}
"""Platforms that declare `triton` when the triton package is installed."""
RUNS = {  # quantization method -> platforms it is accepted on, from what each needs and each declares
    "int8": {"cuda", "rocm", "xpu", "tpu", "cpu"},
    "awq": {"cuda", "rocm", "xpu", "tpu", "cpu"},  # tpu: refused before only by its allow-list
    "gptq": {"cuda", "rocm", "xpu", "tpu", "cpu"},  # the same
    "gguf": {"cuda", "rocm", "xpu", "cpu"},  # needs dtype_views
    "fp8": {"cuda", "rocm", "cpu"},  # needs float8
}
PLATFORMS = {
    "cuda": cuda.CudaPlatform,
    "rocm": rocm.RocmPlatform,
    "xpu": xpu.XpuPlatform,
    "tpu": tpu.TpuPlatform,
    "cpu": cpu.CpuPlatform,
}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_facts(name):
    platform = PLATFORMS[name]
    device_type, priority, backends, capabilities = FACTS[name]
    assert (platform.name, platform.device_type) == (name, device_type)
    assert platform.priority == priority
    assert platform.preferred_attention_backends() == list(backends)
    assert platform.default_dtype in platform.supported_dtypes
    triton = name in TRITON_BACKENDS and importlib.util.find_spec("triton") is not None
    assert platform.capabilities == capabilities | ({"triton"} if triton else set())
    assert not hasattr(platform, "quantization_methods")  # no allow-list: methods declare their needs


@pytest.mark.parametrize("method", sorted(RUNS))
def test_builtin_quantization_methods_run_where_their_needs_are_declared(method):
    methods = {m.name: m for m in (Int8Method, AwqMethod, GptqMethod, GgufMethod, Fp8Method)}
    reasons = {name: quant_method_reasons(methods[method], platform) for name, platform in PLATFORMS.items()}
    assert {name for name, r in reasons.items() if not r} == RUNS[method]
    need = {"gguf": "dtype_views", "fp8": "float8"}.get(method)
    for name in set(PLATFORMS) - RUNS[method]:
        assert reasons[name] == [
            f"needs {need} ({CAPABILITIES[need]}), which platform {name} does not declare"
        ]


def test_availability_never_initialises_cuda():
    for platform in PLATFORMS.values():
        platform.availability()
        platform.default_dtype, platform.supported_dtypes, platform.capabilities  # noqa: B018 - facts must stay as cheap
    assert not torch.cuda.is_initialized()


CPU_ONLY_TORCH = not (torch.version.cuda or getattr(torch.version, "hip", None) or torch.xpu._is_compiled())


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="describes a machine with a CPU-only torch and no TPU")
def test_entry_points_register_all_five(monkeypatch):
    monkeypatch.delenv("PAGELLM_PLUGINS", raising=False)
    reset_plugins()
    try:
        registry = load_plugins()
    finally:
        reset_plugins()
    assert set(PLATFORMS) <= set(registry.platforms)
    for name, platform in PLATFORMS.items():
        assert registry.platforms[name] is platform
        assert registry.owner("platforms", name).startswith("pagellm ")
    availability = {name: registry.platforms[name].availability() for name in PLATFORMS}
    assert availability["cpu"].ok
    for name in ("cuda", "rocm", "xpu", "tpu"):
        assert not availability[name].ok and availability[name].reason, name
    assert all(a.reason for a in availability.values())
