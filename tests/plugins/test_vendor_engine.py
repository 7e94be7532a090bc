"""The engine end to end on the example vendor's platform, attention backend and quantization method."""

from __future__ import annotations

import pytest
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.plugins import reset_plugins


@pytest.fixture(scope="module")
def model(vendor_plugin, tmp_path_factory):
    reset_plugins()
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("vendor"))
    return path, Reference(path, max_tokens=8)


def test_greedy_parity_on_the_vendor_device_and_backend(model):
    path, reference = model
    llm = LLM(
        str(path), device="vendor_sim", attention_backend="VENDOR_ATTN", dtype="float32", max_model_len=400
    )
    setup = llm.engine.setup
    assert (setup.platform.name, setup.backend.name) == ("vendor_sim", "VENDOR_ATTN")
    assert_greedy_parity(llm, reference, mixed_prompts(300)[:8])


def test_auto_backend_on_the_vendor_device(model, monkeypatch, idle_machine):
    path, _ = model
    monkeypatch.setenv("PAGELLM_ATTENTION_TIMING", "0")  # no timing: the platform's first preference
    llm = LLM(str(path), device="vendor_sim", dtype="float32", max_model_len=400)
    assert llm.engine.setup.backend.name == "VENDOR_ATTN"
    # timed: the first in preference order within 10% of the fastest (in its best round or its median one:
    # tests/core/test_selector.py checks that rule), with the numbers (two backends a hair apart, as CPU_ATTN
    # and TORCH_SDPA on this tiny model, keep the preference order)
    monkeypatch.setenv("PAGELLM_ATTENTION_TIMING", "1")
    choice = LLM(
        str(path), device="vendor_sim", dtype="float32", max_model_len=400
    ).engine.setup.backend_choice
    fastest = min(choice.timings.values())
    assert "VENDOR_ATTN" in choice.timings
    why = (
        "fastest measured" if choice.timings[choice.backend.name] == fastest else "within 10% of the fastest"
    )
    assert why in choice.explanation[0]


def test_vendor_quantization_runs_in_the_engine(model):
    path, _ = model
    llm = LLM(str(path), device="vendor_sim", quantization="vendor_int8", dtype="float32", max_model_len=400)
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert type(layer.quant_method).__name__ == "VendorInt8Method" and layer.qweight.dtype.is_signed
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
