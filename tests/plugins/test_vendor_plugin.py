"""The example vendor package (examples/plugins/), pip-installed, seen through pagellm as a user sees it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pagellm.cli.main import cli
from pagellm.core.attention import AttentionSpec
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError, DeviceUnavailableError, PluginError
from pagellm.core.selector import (
    backend_reasons,
    select_attention_backend,
    select_platform,
    select_quant_method,
)
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_backend

pytestmark = pytest.mark.usefixtures("vendor_plugin")

BUILTINS_ONLY = "cpu,torch_sdpa,models"
VENDOR_DIST = "pagellm-vendor-example"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("PAGELLM_PLUGINS", raising=False)
    monkeypatch.delenv("PAGELLM_DEVICE", raising=False)
    monkeypatch.delenv("PAGELLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("VENDOR_SIM_DISABLE", raising=False)


def run_cli(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_vendor_parts_are_registered_with_their_distribution(vendor_plugin):
    registry = load_plugins()
    info = next(p for p in registry.plugins if p.name == "vendor_example")
    assert (info.distribution, info.version, info.loaded, info.error) == (
        VENDOR_DIST,
        vendor_plugin.version,
        True,
        None,
    )
    assert registry.platforms["vendor_sim"].__module__ == "pagellm_vendor_example.platform"
    assert registry.attention_backends["VENDOR_ATTN"].__module__ == "pagellm_vendor_example.attention"
    assert registry.quant_methods["vendor_int8"].__module__ == "pagellm_vendor_example.quant"
    for kind, name in [
        ("platforms", "vendor_sim"),
        ("attention_backends", "VENDOR_ATTN"),
        ("quant_methods", "vendor_int8"),
    ]:
        assert registry.owner(kind, name).startswith(f"{VENDOR_DIST} {vendor_plugin.version}")
    assert "vendor-info" in [c.name for c in registry.cli_commands]


def test_select_platform_by_name_but_never_by_auto(monkeypatch):
    registry = load_plugins()
    choice = select_platform(registry, "vendor_sim")
    assert choice.platform is registry.platforms["vendor_sim"]
    assert choice.availability["vendor_sim"].reason == "simulated device on the host CPU"
    assert select_platform(registry, "auto").platform.name != "vendor_sim"

    monkeypatch.setenv("VENDOR_SIM_DISABLE", "1")
    with pytest.raises(DeviceUnavailableError, match="vendor_sim.*disabled by VENDOR_SIM_DISABLE=1"):
        select_platform(registry, "vendor_sim")


def test_vendor_platform_facts():
    platform = load_plugins().platforms["vendor_sim"]
    assert platform.preferred_attention_backends() == ["VENDOR_ATTN", "TORCH_SDPA"]
    assert platform.kv_cache_bytes(EngineConfig(), model_bytes=1 << 20, peak_bytes=1 << 24) == 1 << 30
    assert platform.kv_cache_bytes(EngineConfig(kv_cache_space=0.5), 0, 0) == 1 << 29
    assert 0 < platform.free_memory() <= platform.total_memory()
    platform.check_and_update_config(EngineConfig())
    with pytest.raises(ConfigError, match="tensor-parallel-size 1"):
        platform.check_and_update_config(EngineConfig(tensor_parallel_size=2))


def test_vendor_platform_prefers_its_backend_and_falls_back_with_reasons():
    registry = load_plugins()
    platform = registry.platforms["vendor_sim"]
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16)
    assert select_attention_backend(registry, platform, spec).backend.name == "VENDOR_ATTN"

    windowed = AttentionSpec(4, 2, 32, torch.float32, block_size=16, sliding_window=8)
    choice = select_attention_backend(registry, platform, windowed)
    assert choice.backend.name == "TORCH_SDPA"
    assert choice.rejected["VENDOR_ATTN"] == ["no sliding-window support"]
    with pytest.raises(ConfigError, match=r"VENDOR_ATTN cannot run.*block size 8 not in \[16, 32\]"):
        select_attention_backend(registry, platform, AttentionSpec(4, 2, 32, torch.float32, 8), "VENDOR_ATTN")


def test_vendor_backend_stays_off_the_host_cpu_platform():
    registry = load_plugins()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16)
    reasons = backend_reasons(registry, registry.platforms["cpu"], spec)
    assert reasons["VENDOR_ATTN"] == ["needs the vendor_sim device, not cpu"]


def test_cli_plugins_lists_the_vendor_package(vendor_plugin):
    out = run_cli("plugins")
    line = next(line for line in out.splitlines() if "vendor_example" in line)
    assert f"{VENDOR_DIST} {vendor_plugin.version}" in line and "loaded" in line
    line = next(line for line in out.splitlines() if line.split()[:1] == ["vendor_sim"])
    assert "available" in line and "simulated device on the host CPU" in line
    assert "VENDOR_ATTN" in out and "vendor_int8" in out


def test_cli_plugins_on_vendor_device_shows_its_backend_compatible():
    out = run_cli("plugins", "--device", "vendor_sim")
    line = next(line for line in out.splitlines() if line.split()[:1] == ["VENDOR_ATTN"])
    assert line.split()[1] == "compatible"


def test_every_quantization_method_runs_on_the_vendor_device_by_what_it_declares():
    """vendor_sim names no method: it declares float8 and dtype_views, so the built-in methods and the
    vendor's run there, as on the host CPU."""
    out = run_cli("plugins", "--device", "vendor_sim")
    methods = out.split("Quantization methods (on vendor_sim):")[1].split("Models:")[0].splitlines()[1:]
    verdicts = {line.split()[0]: " ".join(line.split()[1:3]) for line in methods}
    assert verdicts == {name: "runs here" for name in ("awq", "fp8", "gguf", "gptq", "int8", "vendor_int8")}


def test_pagellm_plugins_subprocess_sees_the_vendor_package(vendor_plugin):
    script = Path(sys.executable).with_name("pagellm")
    env = {k: v for k, v in os.environ.items() if k != "PAGELLM_PLUGINS"}
    result = subprocess.run(
        [str(script), "plugins"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "vendor_example" in result.stdout and f"{VENDOR_DIST} {vendor_plugin.version}" in result.stdout
    assert "vendor_sim" in result.stdout and "VENDOR_ATTN" in result.stdout and "vendor_int8" in result.stdout


def test_cli_env_selects_the_vendor_platform():
    out = run_cli("env", "--device", "vendor_sim")
    assert "platform: vendor_sim" in out
    assert "VendorSim-1 (simulated)" in out


def test_cli_vendor_command_is_added_by_the_plugin():
    out = run_cli("vendor-info")
    assert "platform: vendor_sim (available: simulated device on the host CPU)" in out
    assert "preferred attention backends: VENDOR_ATTN, TORCH_SDPA" in out


def test_allow_list_leaves_the_vendor_package_out(monkeypatch):
    monkeypatch.setenv("PAGELLM_PLUGINS", BUILTINS_ONLY)
    registry = load_plugins()
    assert "vendor_sim" not in registry.platforms and "VENDOR_ATTN" not in registry.attention_backends
    info = next(p for p in registry.plugins if p.name == "vendor_example")
    assert not info.loaded and "left out" in info.error
    out = run_cli("plugins")
    line = next(line for line in out.splitlines() if "vendor_example" in line)
    assert "left out" in line
    assert "vendor_sim" not in out


def test_broken_plugin_is_skipped_with_a_warning(broken_plugin, caplog):
    with caplog.at_level(logging.WARNING, logger="pagellm.plugins"):
        registry = load_plugins()
    warning = next(r for r in caplog.records if repr(broken_plugin.name) in r.getMessage())
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert broken_plugin.dist in message and broken_plugin.error in message and "ImportError" in message
    assert "vendor_sim" in registry.platforms and "cpu" in registry.platforms
    info = next(p for p in registry.plugins if p.name == broken_plugin.name)
    assert not info.loaded and broken_plugin.error in info.error

    out = run_cli("plugins")
    assert broken_plugin.name in out and "vendor_sim" in out


def test_broken_plugin_asked_for_by_name_stops_loading(broken_plugin, monkeypatch):
    monkeypatch.setenv("PAGELLM_PLUGINS", f"{BUILTINS_ONLY},{broken_plugin.name}")
    with pytest.raises(
        PluginError, match=rf"{broken_plugin.name}.*{broken_plugin.dist}.*{broken_plugin.error}"
    ):
        load_plugins()


@pytest.mark.parametrize(
    "dtype, block_size, tolerance",
    [(torch.float32, 16, 1e-5), (torch.float32, 32, 1e-5), (torch.bfloat16, 16, 3e-2)],
)
def test_vendor_attention_matches_the_reference(dtype, block_size, tolerance):
    backend = load_plugins().attention_backends["VENDOR_ATTN"]
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, block_size=block_size)
    cases = [
        ([7, 40], [7, 40]),  # prefills
        ([1, 33, 70], [1, 1, 1]),  # decodes
        ([50, 3, 65, 20], [18, 3, 1, 5]),  # prefill chunks after cached context, mixed with decodes
    ]
    assert check_backend(backend, spec, "cpu", cases) < tolerance


def test_vendor_int8_reproduces_the_dequantized_matmul():
    method_cls = load_plugins().quant_methods["vendor_int8"]
    assert method_cls.matches_checkpoint({"quant_method": "vendor_int8"})
    assert not method_cls.matches_checkpoint({"quant_method": "fp8"})
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    method = method_cls()
    method.create_weights(layer, in_features=64, out_features=48, params_dtype=torch.float32)
    assert layer.weight.shape == (48, 64) and layer.weight.dtype == torch.float32
    weight = torch.randn(48, 64, generator=gen) * torch.rand(48, 1, generator=gen)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)

    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int8 and layer.scale.shape == (48,)
    assert layer.qweight.abs().amax(dim=1).eq(127).all()  # each output channel uses the full int8 range
    x, bias = torch.randn(5, 64, generator=gen), torch.randn(48, generator=gen)
    dequantized = layer.qweight.float() * layer.scale[:, None]
    torch.testing.assert_close(method.apply(layer, x, bias), x @ dequantized.T + bias)
    assert (dequantized - weight).abs().max() <= layer.scale.max() / 2 + 1e-6
    reference = x @ weight.T
    assert (method.apply(layer, x) - reference).norm() < 0.01 * reference.norm()


def test_checkpoint_naming_vendor_int8_selects_it():
    registry = load_plugins()
    platform = registry.platforms["vendor_sim"]
    assert (
        select_quant_method(registry, platform, None, {"quant_method": "vendor_int8"}).name == "vendor_int8"
    )
