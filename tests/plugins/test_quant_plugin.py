"""A vendor's quantization method runs on every platform that can run it (issue 28): it declares what it
needs, each platform what it has, and no platform names the methods it runs. Registered through an entry
point like any plugin (the `fake_beside_installed` fixture), next to pagellm's own platforms and models."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from sim_platforms import SimAccelerator
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.cli.main import cli
from pagellm.core.errors import QuantizationUnsupportedError
from pagellm.core.platform import Availability, Platform
from pagellm.core.selector import select_quant_method
from pagellm.plugins import load_plugins

VENDOR_QUANT = """
import torch
from torch import nn

from pagellm.core.quant import QuantMethod


class AcmeW8(QuantMethod):
    '''Weight-only int8, one scale per output channel, quantized after loading: needs nothing special.'''

    name = "acme_w8"

    def create_weights(self, layer, in_features, out_features, params_dtype):
        weight = torch.empty(out_features, in_features, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def process_weights_after_loading(self, layer):
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        del layer.weight
        layer.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
        layer.register_buffer("scale", scale.view(-1))

    def apply(self, layer, x, bias=None):
        y = torch.nn.functional.linear(x, layer.qweight.to(x.dtype)) * layer.scale.to(x.dtype)
        return y if bias is None else y + bias


class AcmeNpuW4(AcmeW8):
    '''Runs only where Acme's matmul library is: a capability no platform of pagellm's declares.'''

    name = "acme_npu_w4"
    requires = ("acme_npu_matmul",)


class AcmeHalf(AcmeW8):
    '''Computes in float16 only.'''

    name = "acme_half"
    dtypes = (torch.float16,)


@hookimpl
def pagellm_quant_methods():
    return [AcmeW8, AcmeNpuW4, AcmeHalf]
"""


ENGINE = dict(
    device="cpu", dtype="float32", max_model_len=256, attention_backend="TORCH_SDPA", kv_cache_space=0.05
)
"""A tiny engine on the CPU, started quickly (no attention-backend timing, a small KV cache)."""


class FakeGpu(Platform):
    """A stand-in accelerator: facts only, as a vendor's GPU would declare them."""

    name, device_type, priority = "fake_gpu", "cuda", 100
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    capabilities = frozenset({"float8", "dtype_views", "triton"})

    @classmethod
    def availability(cls):
        return Availability.yes("stand-in")

    @classmethod
    def device_capability(cls, index: int = 0):
        return (8, 0)


class FakeTpu(Platform):
    """A stand-in XLA device that declares no capability and computes in bfloat16 and float32."""

    name, device_type, priority = "fake_tpu", "xla", 80
    supported_dtypes = (torch.bfloat16, torch.float32)

    @classmethod
    def availability(cls):
        return Availability.yes("stand-in")


@pytest.fixture
def registry(fake_beside_installed):
    fake_beside_installed.add("acme_quant", VENDOR_QUANT, dist="acme-quant")
    registry = load_plugins()
    assert registry.owner("quant_methods", "acme_w8") == "acme-quant 1.2 (plugin 'acme_quant')"
    assert "cpu" in registry.platforms and "acme_w8" in registry.quant_methods
    return registry


def stand_ins(registry) -> list[type[Platform]]:
    """The built-in platform classes (their facts; none of them is available here but cpu), the simulated
    host-run accelerator of tests/models, and the stand-ins above: no platform file names acme_w8."""
    builtins = [registry.platforms[name] for name in ("cuda", "rocm", "xpu", "tpu", "cpu")]
    return [*builtins, SimAccelerator, FakeGpu, FakeTpu]


def test_the_vendor_method_loads_and_generates_on_cpu(registry, tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    llm = LLM(str(path), quantization="acme_w8", **ENGINE)
    assert llm.engine.setup.quant_method is registry.quant_methods["acme_w8"]
    assert "quantization acme_w8" in llm.engine.setup.explanation
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert type(layer.quant_method).__name__ == "AcmeW8" and layer.qweight.dtype == torch.int8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(["Hello", "The capital of France is"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_the_selector_accepts_it_on_every_platform_and_by_checkpoint_name(registry):
    for platform in stand_ins(registry):
        assert select_quant_method(registry, platform, "acme_w8", None).name == "acme_w8", platform.name
        found = select_quant_method(registry, platform, None, {"quant_method": "acme_w8"})
        assert found is registry.quant_methods["acme_w8"]


def test_an_unmet_need_is_refused_with_the_need_named(registry):
    for platform in stand_ins(registry):
        with pytest.raises(QuantizationUnsupportedError) as err:
            select_quant_method(registry, platform, "acme_npu_w4", None)
        assert str(err.value) == (
            f"quantization acme_npu_w4 cannot run on {platform.name}: "
            f"needs acme_npu_matmul, which platform {platform.name} does not declare"
        )


def test_a_dtype_need_is_checked_against_the_platform_and_the_model(registry):
    method = registry.quant_methods["acme_half"]
    assert select_quant_method(registry, FakeGpu, "acme_half", None) is method
    assert select_quant_method(registry, FakeGpu, "acme_half", None, dtype=torch.float16) is method
    with pytest.raises(QuantizationUnsupportedError, match="dtype bfloat16 not in float16"):
        select_quant_method(registry, FakeGpu, "acme_half", None, dtype=torch.bfloat16)
    with pytest.raises(
        QuantizationUnsupportedError, match="computes in float16; fake_tpu supports bfloat16, float32"
    ):
        select_quant_method(registry, FakeTpu, "acme_half", None)


def test_the_engine_refuses_it_before_loading_and_pagellm_plugins_says_why(registry, tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(QuantizationUnsupportedError, match="needs acme_npu_matmul, which platform cpu"):
        LLM(str(path), quantization="acme_npu_w4", **ENGINE)
    result = CliRunner().invoke(cli, ["plugins", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = {
        line.split()[0]: line for line in result.output.split("Quantization methods")[1].splitlines()[1:]
    }
    assert "runs here" in lines["acme_w8"] and "acme-quant 1.2" in lines["acme_w8"]
    assert "not here: needs acme_npu_matmul, which platform cpu does not declare" in lines["acme_npu_w4"]
    assert "runs here" in lines["fp8"] and "runs here" in lines["gguf"]
