"""The floor model (pagellm.bench.floor) on a tiny config whose FLOPs and bytes are counted by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagellm.bench import floor as fl
from pagellm.bench.floor import Floor, Machine, ModelShape, min_steps, min_steps_for_intervals, workload_work

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import make_tiny_checkpoint  # noqa: E402

# hidden 8, 2 layers, 2 heads of 4, 1 KV head, MLP 16, vocab 10:
#   per layer: qkv 8 * (8 + 4 + 4) = 128, o 8 * 8 = 64, gate/up/down 3 * 8 * 16 = 384 -> 576; 2 layers: 1152
#   lm_head 8 * 10 = 80; bf16 weights read per step (1152 + 80) * 2 = 2464 bytes
#   KV per token: 2 layers * (K and V) * 1 head * 4 * 2 bytes = 32 bytes
TINY = SimpleNamespace(
    model_type="llama",
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)
MACHINE = Machine(peak_flops=1e4, read_bytes_s=1e4, dtype="bfloat16", device="cpu", threads=1, measured=False)


def test_shape_of_a_tiny_config():
    shape = ModelShape.from_hf_config(TINY, torch.bfloat16)
    assert shape.linear_params == 1152
    assert shape.lm_head_params == 80
    assert shape.weight_bytes == 2464
    assert shape.kv_bytes_per_token == 32
    assert ModelShape.from_hf_config(TINY, torch.bfloat16, torch.float8_e4m3fn).kv_bytes_per_token == 16


def test_one_request_by_hand():
    """Prompt 3, output 3, one request: a prefill step (positions 0-2 attend to 1, 2, 3 tokens) that
    samples token 1, then decode steps attending to 4 and 5 tokens."""
    shape = ModelShape.from_hf_config(TINY, torch.bfloat16)
    work = workload_work(shape, [3], [3], steps=3)
    assert work.linear_flops == 2 * 1152 * 5  # 5 tokens through every linear
    # 4 * heads * head_size per attended (token, layer): prefill 1+2+3, decode 4+5, each over 2 layers
    assert work.attention_flops == 4 * 2 * 4 * (1 + 2 + 3 + 4 + 5) * 2
    assert work.lm_head_flops == 2 * 80 * 3  # one per output token: sampled positions only
    assert work.flops == 11520 + 960 + 480
    assert work.weight_bytes == 3 * 2464
    assert work.kv_bytes == (3 + 4) * 32  # decode tokens read their cached context; the prompt's is fresh
    floor = Floor(work, MACHINE)
    assert floor.compute_s == pytest.approx(12960 / 1e4)
    assert floor.memory_s == pytest.approx((3 * 2464 + 224) / 1e4)
    assert floor.floor_s == floor.compute_s and floor.bound == "compute"
    report = floor.report(measured_s=2.592, output_tokens=3)
    assert report["fraction_of_floor"] == pytest.approx(0.5)
    assert report["floor_output_tok_s"] == pytest.approx(3 / 1.296)
    assert "50% of the floor" in fl.format_floor(report)


def test_cached_prefix_costs_no_flops_but_is_read():
    shape = ModelShape.from_hf_config(TINY, torch.bfloat16)
    work = workload_work(shape, [3], [1], steps=1, cached=[2])
    assert work.linear_flops == 2 * 1152  # only position 2 runs
    assert work.attention_flops == 4 * 2 * 4 * 3 * 2  # ... attending to 3 tokens in both layers
    assert work.kv_bytes == 2 * 32  # the cached 2 tokens read once


def test_sliding_window_caps_the_context():
    shape = ModelShape.from_hf_config(SimpleNamespace(**vars(TINY), sliding_window=4), torch.bfloat16)
    assert shape.layer_windows == (4, 4)
    work = workload_work(shape, [3], [3], steps=3)
    assert work.attention_flops == 4 * 2 * 4 * (1 + 2 + 3 + 4 + 4) * 2
    assert work.kv_bytes == (3 + 3) * 32  # at most window - 1 cached tokens per query
    # the closed form agrees with summing token by token, across the window
    for first, last in [(1, 3), (2, 9), (5, 9), (4, 4)]:
        assert shape.attended_range(first, last) == sum(shape.attended(c) for c in range(first, last + 1))


def test_step_work_of_a_mixed_step():
    """A step with one decode (context 10) and a prompt chunk of 4 tokens after 8 earlier ones."""
    shape = ModelShape.from_hf_config(TINY, torch.bfloat16)
    work = fl.step_work(shape, [(9, 1, True), (8, 4, False)])
    assert work.linear_flops == 2 * 1152 * 5
    assert work.attention_flops == 4 * 2 * 4 * (10 + 9 + 10 + 11 + 12) * 2
    assert work.lm_head_flops == 2 * 80
    assert work.weight_bytes == 2464 and work.steps == 1
    assert work.kv_bytes == 9 * 32 + 8 * 32  # the tokens before each
    assert fl.step_work(shape, [(0, 4, False)]).weight_bytes == 1152 * 2  # no sampling: no lm_head read


def test_model_s_matches_the_reference_numbers():
    """SmolLM2-135M's shape on W1: 6.38 TFLOP (shared/reference/cpu-performance.md)."""
    from pagellm.bench.workloads import w1

    s = SimpleNamespace(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    )
    shape = ModelShape.from_hf_config(s, torch.bfloat16)
    assert shape.weight_bytes / 1e9 == pytest.approx(0.27, abs=0.005)
    workload = w1(49152)
    work = workload_work(shape, [len(p) for p in workload.prompts], workload.output_lens, steps=256)
    assert work.flops / 1e12 == pytest.approx(6.38, abs=0.01)


def test_min_steps():
    assert min_steps([3, 7, 5]) == 7
    assert min_steps_for_intervals([(0, 1, 5), (2, 3, 4)]) == 9  # disjoint: no shared steps
    assert min_steps_for_intervals([(0, 2, 5), (1, 3, 4)]) == 5  # overlapping: may share
    assert min_steps_for_intervals([(0, 10, 3), (0, 1, 2), (2, 3, 2), (4, 5, 2)]) == 6
    assert min_steps_for_intervals([]) == 0


def test_measure_machine_is_quick_and_cached(monkeypatch):
    monkeypatch.setattr(fl, "GEMM_SIZE", 64)
    monkeypatch.setattr(fl, "STREAM_BYTES", 1 << 20)
    monkeypatch.setattr(fl, "BUDGET_S", 0.01)
    monkeypatch.setattr(fl, "_MEASURED", {})
    machine = fl.measure_machine(torch.float32)
    assert machine.peak_flops > 0 and machine.read_bytes_s > 0 and machine.measured
    assert fl.measure_machine(torch.float32) == machine
    given = fl.measure_machine(torch.float32, peak_tflops=2.0, read_gb_s=30.0)
    assert (given.peak_flops, given.read_bytes_s, given.measured) == (2e12, 30e9, False)


def test_half_precision_floor_on_cpu_uses_float32_where_it_is_faster(monkeypatch):
    """On a CPU without native bf16 dot products torch's bf16 GEMM is far below float32's, while pagellm's
    panel kernel multiplies bf16 weights at float32's rate: the floor must not be the slow path's."""
    rates = {torch.bfloat16: 1e10, torch.float32: 1e11, torch.float16: 3e11}
    monkeypatch.setattr(fl, "measure_matmul_peak", lambda dtype, device: rates[dtype])
    monkeypatch.setattr(fl, "measure_read_bandwidth", lambda device: 2e10)
    monkeypatch.setattr(fl, "_MEASURED", {})
    assert fl.measure_machine(torch.bfloat16).peak_flops == 1e11
    assert fl.measure_machine(torch.float16).peak_flops == 3e11  # its own where faster


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt", "gemma2"])
def test_loaded_engine_agrees_with_its_config(arch, tmp_path):
    from pagellm import LLM

    llm = LLM(str(make_tiny_checkpoint(arch, tmp_path)), dtype="float32", kv_cache_space=0.01)
    from_model = ModelShape.from_llm(llm)
    from_config = ModelShape.from_hf_config(llm.engine.setup.hf_config, torch.float32)
    assert from_model.linear_params == from_config.linear_params
    assert from_model.lm_head_params == from_config.lm_head_params
    assert from_model.kv_bytes_per_token == from_config.kv_bytes_per_token
    # the engine's parameters include biases, which the config-only count leaves out
    assert 0 <= from_model.weight_bytes - from_config.weight_bytes < 0.05 * from_config.weight_bytes


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_engine_agrees_with_its_config_and_counts_the_state(arch, tmp_path):
    """Gated DeltaNet layers: their linears, their state (read and written each step a sequence runs) and
    the delta rule's FLOPs; only the attention layers have KV."""
    from pagellm import LLM
    from pagellm.bench.floor import step_work

    llm = LLM(str(make_tiny_checkpoint(arch, tmp_path)), dtype="float32", kv_cache_space=0.01, max_num_seqs=4)
    from_model = ModelShape.from_llm(llm)
    from_config = ModelShape.from_hf_config(llm.engine.setup.hf_config, torch.float32)
    for field in ("num_layers", "linear_params", "lm_head_params", "kv_bytes_per_token", "state_bytes"):
        assert getattr(from_model, field) == getattr(from_config, field), field
    assert from_model.recurrent_flops_per_token == from_config.recurrent_flops_per_token > 0
    # 3 delta nets: conv window 3 x (2 x 32 + 64) float32, and 4 value heads of 16 x 16 float32 each
    assert from_model.state_bytes == 3 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
    decode = step_work(from_model, [(10, 1, True), (20, 1, True)])
    assert decode.state_bytes == 2 * 2 * from_model.state_bytes  # two sequences, read and written
    assert step_work(from_model, [(0, 8, True)]).state_bytes == from_model.state_bytes  # written only


def test_recorded_steps_match_the_closed_form(tmp_path):
    """One request through the engine: the steps it scheduled add up to the closed form."""
    from pagellm import LLM, SamplingParams
    from pagellm.bench.steps import StepRecorder, records_work

    llm = LLM(str(make_tiny_checkpoint("llama", tmp_path)), dtype="float32", kv_cache_space=0.01)
    shape = ModelShape.from_llm(llm)
    with StepRecorder(llm.engine) as recorder:
        llm.generate(
            [{"prompt_token_ids": list(range(3, 23))}],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    assert "step" not in vars(llm.engine)  # unwrapped again
    assert len(recorder.steps) == 5 and recorder.steps[0].chunks == [(0, 20, True)]
    assert all(s.is_decode for s in recorder.steps[1:])
    assert records_work(shape, recorder.steps) == workload_work(shape, [20], [5], steps=5)
