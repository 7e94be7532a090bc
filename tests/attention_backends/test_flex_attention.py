import importlib.util
import logging

import pytest
import torch

from pagellm.attention_backends import flex_attention
from pagellm.attention_backends.flex_attention import FlexAttentionBackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import blocks_needed, check_backend, make_paged_batch

# (seq_lens, query_lens): prefill, chunked prefill, decode batch, mixed steps
CASES = [
    ([40, 33], [8, 17]),
    ([15, 16, 17, 70, 1], [1] * 5),
    ([40, 17, 5, 33], [8, 1, 1, 17]),
    ([5, 40, 6, 64], [1, 8, 1, 64]),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


class _TPU(Platform):
    name = "testtpu"
    device_type = "xla"


@pytest.mark.parametrize("heads, block_size", [((8, 2), 16), ((4, 4), 32)], ids=["gqa-16", "mha-32"])
def test_matches_reference(heads, block_size):
    spec = AttentionSpec(*heads, head_size=32, dtype=torch.float32, block_size=block_size)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < 1e-5


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.bfloat16, marks=pytest.mark.slow),
        pytest.param(torch.float16, marks=pytest.mark.slow),
    ],
    ids=["fp32", "bf16", "fp16"],
)
@pytest.mark.parametrize("sliding_window", [None, 7, 20])
def test_dtypes_and_sliding_window(dtype, sliding_window):
    spec = AttentionSpec(9, 3, 64, dtype, block_size=16, sliding_window=sliding_window)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < TOLERANCE[dtype]


def test_logits_soft_cap():
    spec = AttentionSpec(8, 2, 32, torch.float32, sliding_window=9, logits_soft_cap=5.0)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < 1e-5


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(
    "features",
    [dict(has_sinks=True), dict(has_sinks=True, sliding_window=7, logits_soft_cap=5.0)],
    ids=["sinks", "sinks-window-soft_cap"],
)
def test_sinks(dtype, features):
    """Sink logits rescale flex_attention's output by the log-sum-exp it returns."""
    spec = AttentionSpec(8, 2, 32, dtype, **features)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < TOLERANCE[dtype]


def test_block_masks_are_built_once_per_step():
    spec = AttentionSpec(4, 2, 32, torch.float32)
    batch = make_paged_batch([40, 17, 5], [8, 17, 1], 16)
    metadata = FlexAttentionBackend.build_metadata(batch)
    kv_cache = torch.zeros(FlexAttentionBackend.kv_cache_shape(blocks_needed([40, 17, 5], 16), 16, 2, 32))
    q, k = torch.randn(26, 4, 32), torch.randn(26, 2, 32)
    layers = [FlexAttentionBackend(spec) for _ in range(3)]
    layers[0].forward(q, k, k, kv_cache, metadata)
    masks = {key: value[1] for key, value in metadata.block_masks.items()}
    assert len(masks) == 3  # the chunk over cached context, the fresh prefill (causal), the decode
    for layer in layers[1:]:
        layer.forward(q, k, k, kv_cache, metadata)
    assert {key: value[1] for key, value in metadata.block_masks.items()} == masks


def test_unsupported_reasons(monkeypatch):
    spec = AttentionSpec(8, 2, 64, torch.bfloat16, sliding_window=4096, logits_soft_cap=30.0, has_sinks=True)
    assert FlexAttentionBackend.unsupported_reasons(spec, _CPU) == []
    assert FlexAttentionBackend.unsupported_reasons(spec, _TPU) == [
        "runs on device types cpu, cuda, xpu, not xla"
    ]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == flex_attention.FLEX_MODULE else real_find_spec(name, *a),
    )
    assert FlexAttentionBackend.unsupported_reasons(spec, _CPU) == [
        f"torch {torch.__version__} has no flex_attention (needs torch >= 2.5)"
    ]


def test_plugin_registration(monkeypatch):
    assert flex_attention.PAGELLM_PLUGIN_API == "1.0"
    monkeypatch.setenv("PAGELLM_PLUGINS", "flex_attention")
    assert load_plugins().attention_backends == {"FLEX_ATTENTION": FlexAttentionBackend}


@pytest.fixture
def fresh_variants():
    """No compiled variant left over from another test, and none left behind."""
    flex_attention._compiled_flex.cache_clear()
    yield
    flex_attention._compiled_flex.cache_clear()


REAL_COMPILE = torch.compile


class _CountingCompile:
    """Stands in for torch.compile on the variants' functions (eager flex_attention compiles its own
    wrapper, which goes to the real one): records what it is asked to compile and how often each result
    runs, and runs flex_attention eagerly; `fail` makes the results raise as a failed compile does."""

    def __init__(self, fail: BaseException | None = None):
        self.compiled = []
        self.calls = {}
        self.fail = fail

    def __call__(self, fn, **options):
        if not fn.__code__.co_name.startswith("flex_attention_"):
            return REAL_COMPILE(fn, **options)
        self.compiled.append((fn, options))
        self.calls[fn.__code__.co_name] = 0

        def run(*args, **kwargs):
            self.calls[fn.__code__.co_name] += 1
            if self.fail is not None:
                raise self.fail
            return flex_attention._eager(*args, **kwargs)

        return run


STEPS = [([40, 17, 5], [8, 17, 1])]  # one of each mask kind: prefill over context, causal, decode


def test_compiled_once_per_variant_and_reused(monkeypatch, caplog, fresh_variants):
    """Issue 17: one compiled callable per dtype, head size, mask kind and GQA, each with its own code
    object (Dynamo's graph cache and recompile limit are per code object), built once and reused."""
    compile_ = _CountingCompile()
    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    fp32 = AttentionSpec(4, 2, 32, torch.float32)
    bf16 = AttentionSpec(4, 2, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        assert check_backend(FlexAttentionBackend, fp32, "cpu", STEPS) < 1e-5
        assert check_backend(FlexAttentionBackend, bf16, "cpu", STEPS) < 3e-2
    names = [fn.__code__.co_name for fn, _ in compile_.compiled]
    assert sorted(names) == sorted(
        f"flex_attention_cpu_{dtype}_{kind}"
        for dtype in ("float32_d32", "bfloat16_d64")
        for kind in ("prefill_gqa", "causal_gqa", "decode")
    )
    assert len({fn.__code__ for fn, _ in compile_.compiled}) == 6
    assert all(options == {"dynamic": True, "fullgraph": True} for _, options in compile_.compiled)
    calls = dict(compile_.calls)
    assert check_backend(FlexAttentionBackend, fp32, "cpu", STEPS) < 1e-5
    assert len(compile_.compiled) == 6  # nothing compiled again
    assert sum(compile_.calls.values()) == 2 * sum(calls.values()) - sum(
        n for name, n in calls.items() if "bfloat16" in name
    )
    logged = [r.getMessage() for r in caplog.records if "compiled flex_attention" in r.getMessage()]
    assert len(logged) == 6
    assert logged[0].startswith("FLEX_ATTENTION: compiled flex_attention for cpu float32 d32 ")
    assert logged[-1].endswith(" s in all)") and "(6 variants, " in logged[-1]


def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch, caplog, fresh_variants):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    compile_ = _CountingCompile(fail=FailOnRecompileLimitHit("Hard failure due to fullgraph=True"))
    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    spec = AttentionSpec(4, 2, 32, torch.float32)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        assert check_backend(FlexAttentionBackend, spec, "cpu", STEPS + STEPS) < 1e-5
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 3 and all("runs eagerly from now on" in w for w in warnings_)
    assert "FailOnRecompileLimitHit" in warnings_[0]
    # each variant tried for all sizes, then with Dynamo's defaults, then eager
    assert set(compile_.calls.values()) == {2}


def test_cpu_runs_eagerly_without_compiling(monkeypatch, fresh_variants):
    compile_ = _CountingCompile()
    monkeypatch.setattr(torch, "compile", compile_)
    assert check_backend(FlexAttentionBackend, AttentionSpec(4, 2, 32, torch.float32), "cpu", STEPS) < 1e-5
    assert compile_.compiled == []


def test_real_dynamo_keeps_variants_apart_past_its_limit(monkeypatch, caplog, fresh_variants):
    """Real Dynamo (its "eager" backend: no C++ compiler or GPU needed) with its limit at 1: every variant
    still compiles, and recompiles for new sizes, and soft-capping compiles (a float cap reaches
    flex_attention as a symbolic float, which it refuses)."""
    import torch._dynamo

    def compile_(fn, **options):
        if fn.__code__.co_name.startswith("flex_attention_"):
            options["backend"] = "eager"
        return REAL_COMPILE(fn, **options)

    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    try:
        spec = AttentionSpec(4, 2, 16, torch.float32, logits_soft_cap=5.0)
        # config.patch, not monkeypatch: undoing a monkeypatch deletes (hides) a torch config setting
        with caplog.at_level(logging.INFO, logger="pagellm"), torch._dynamo.config.patch(recompile_limit=1):
            assert check_backend(FlexAttentionBackend, spec, "cpu", [([6, 9], [6, 1])]) < 1e-5
    finally:
        torch._dynamo.reset()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in caplog.records if "compiled flex_attention" in r.getMessage()]) == 2


def test_real_dynamo_traces_the_sink_variant(monkeypatch, caplog, fresh_variants):
    """With sinks flex_attention also returns its log-sum-exp (`return_aux` or `return_lse`): that variant
    traces under fullgraph too (Dynamo's "eager" backend), named apart from the plain one."""
    import torch._dynamo

    def compile_(fn, **options):
        if fn.__code__.co_name.startswith("flex_attention_"):
            options["backend"] = "eager"
        return REAL_COMPILE(fn, **options)

    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    try:
        spec = AttentionSpec(4, 2, 16, torch.float32, logits_soft_cap=5.0, has_sinks=True, sliding_window=4)
        with caplog.at_level(logging.INFO, logger="pagellm"):
            assert check_backend(FlexAttentionBackend, spec, "cpu", [([6, 9], [6, 1])]) < 1e-5
    finally:
        torch._dynamo.reset()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    compiled = [r.getMessage() for r in caplog.records if "compiled flex_attention" in r.getMessage()]
    assert compiled and all(" softcap5" in m and " lse in " in m for m in compiled)


def test_real_dynamo_traces_each_variant_once_for_all_sizes(monkeypatch, fresh_variants):
    """On an H200 a decode variant first traced at batch 1 (one block, one query token) compiled four more
    times over its first steps, 5-8 s each: Dynamo pinned the sizes that were 1, or equal, in the first call.
    Traced size-obliviously, each variant compiles once however the batch, query and context sizes move
    through 1 (Dynamo's "eager" backend, counting the graphs it is handed)."""
    import torch._dynamo

    graphs = {}

    def compile_(fn, **options):
        name = fn.__code__.co_name
        if name.startswith("flex_attention_"):
            graphs[name] = 0

            def backend(gm, example_inputs):
                graphs[name] += 1
                return gm.forward

            options["backend"] = backend
        return REAL_COMPILE(fn, **options)

    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    spec = AttentionSpec(4, 2, 16, torch.float32)
    steps = [
        ([5], [1]),  # decode, batch 1
        ([9, 34, 3, 2, 7, 12], [1] * 6),  # decode, batch 6
        ([1], [1]),  # causal, one token
        ([7], [7]),
        ([2], [2]),
        ([40], [8]),  # prefill over context
        ([3], [1]),
        ([20], [3]),
    ]
    try:
        for step in steps:
            assert check_backend(FlexAttentionBackend, spec, "cpu", [step]) < 1e-5
    finally:
        torch._dynamo.reset()
    assert graphs == {
        "flex_attention_cpu_float32_d16_decode": 1,
        "flex_attention_cpu_float32_d16_causal_gqa": 1,
        "flex_attention_cpu_float32_d16_prefill_gqa": 1,
    }


def test_a_failed_size_oblivious_trace_traces_again_with_dynamo_defaults(monkeypatch, caplog, fresh_variants):
    from torch._dynamo.exc import TorchRuntimeError
    from torch.fx.experimental import _config as shapes

    seen = {}

    def compile_(fn, **options):
        tries = seen.setdefault(fn.__code__.co_name, [])

        def run(*args, **kwargs):
            tries.append(shapes.backed_size_oblivious)
            if shapes.backed_size_oblivious:
                raise TorchRuntimeError("size-oblivious reasoning failed")
            return flex_attention._eager(*args, **kwargs)

        return run if fn.__code__.co_name.startswith("flex_attention_") else REAL_COMPILE(fn, **options)

    monkeypatch.setattr(flex_attention, "_compiles", lambda device_type: True)
    monkeypatch.setattr(torch, "compile", compile_)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        spec = AttentionSpec(4, 2, 32, torch.float32)
        assert check_backend(FlexAttentionBackend, spec, "cpu", [([5, 3], [1, 1]), ([6], [1])]) < 1e-5
    variants = {name: tries for name, tries in seen.items() if name.startswith("flex_attention_")}
    assert sorted(variants) == [
        "flex_attention_cpu_float32_d32_causal_gqa",
        "flex_attention_cpu_float32_d32_decode",
    ]
    # one failed size-oblivious try each, then Dynamo's defaults for good
    assert all(tries[0] and len(tries) > 2 and not any(tries[1:]) for tries in variants.values())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    retried = [r.getMessage() for r in caplog.records if "traced again with sizes 0 and 1" in r.getMessage()]
    assert len(retried) == 2


def test_a_model_on_it_runs_eagerly_where_a_compiled_forward_was_asked(tmp_path, caplog):
    """A compiled forward cannot build the block masks (torch's vmap inside the ahead-of-time graph's call of
    the attention op): the runner runs the model eagerly and says why, where the start had failed."""
    from tiny import make_tiny_checkpoint

    from pagellm import LLM, SamplingParams

    path = str(make_tiny_checkpoint("llama", tmp_path))
    settings = dict(dtype="float32", max_model_len=128, num_kv_blocks=64)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(path, attention_backend="FLEX_ATTENTION", enforce_eager=False, **settings)
    runner = llm.engine.runner
    assert runner.forward is runner.model
    assert "compiled forward: off (FLEX_ATTENTION: its block masks come from torch.vmap" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=6)
    prompt = [{"prompt_token_ids": list(range(5, 40))}]
    reference = LLM(path, attention_backend="TORCH_SDPA", enforce_eager=True, **settings)
    assert (
        llm.generate(prompt, params)[0].outputs[0].token_ids
        == reference.generate(prompt, params)[0].outputs[0].token_ids
    )
