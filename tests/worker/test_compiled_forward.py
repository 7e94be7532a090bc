"""The compiled forward kept on disk (worker/compiled_forward.py): a start compiles and saves it, the next loads
it instead of compiling, a broken or foreign file is refused, and with compile_in_background the engine serves
on the eager forward while a process of its own compiles, then swaps the compiled one in between steps with
the same greedy tokens."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from parity import mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.worker import compiled_forward, runner_compile

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def engine(path, **overrides) -> LLM:
    settings = dict(
        dtype="float32",
        num_kv_blocks=200,
        max_model_len=256,
        attention_backend="CPU_ATTN",
        enforce_eager=True,
    )
    return LLM(str(path), **{**settings, **overrides})


def greedy(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_key_follows_every_module_setting_and_tensor_layout():
    """The artifact keeps no guards, so whatever a guard would have checked must change the key."""

    def model(features=8, eps=1e-6):
        m = torch.nn.Sequential(torch.nn.Linear(4, features), torch.nn.LayerNorm(features, eps=eps))
        return m

    facts = {"dtype": "float32"}
    key = compiled_forward.artifact_key(model(), facts)
    assert compiled_forward.artifact_key(model(), facts) == key  # weights' values are not part of it
    assert compiled_forward.artifact_key(model(features=16), facts) != key  # a shape
    assert compiled_forward.artifact_key(model(eps=1e-5), facts) != key  # a module's setting
    assert compiled_forward.artifact_key(model(), {"dtype": "bfloat16"}) != key  # an engine choice
    half = model().to(torch.bfloat16)
    assert compiled_forward.artifact_key(half, facts) != key  # a dtype


def test_agrees_takes_rounding_and_refuses_another_model():
    eager = torch.randn(3, 16)
    assert compiled_forward.agrees(eager, eager + 1e-3)
    assert compiled_forward.agrees(eager, eager * 1.05)  # bfloat16's drift through 30 layers
    assert not compiled_forward.agrees(eager, eager * 1.5)
    assert not compiled_forward.agrees(eager, torch.randn(3, 16))
    assert not compiled_forward.agrees(eager, eager[:2])
    assert not compiled_forward.agrees(eager, eager.clone().fill_(float("nan")))


def test_the_next_start_loads_the_saved_forward(tiny_llama, compiled_forwards_of_this_test, caplog):
    """The first start compiles and saves; the second loads the file (no compile) and runs the same tokens."""
    prompts = mixed_prompts(300)[:3]
    eager = greedy(engine(tiny_llama), prompts)
    first = engine(tiny_llama, enforce_eager=False)
    assert first.engine.runner.forward is not first.engine.runner.model
    saved = list(compiled_forwards_of_this_test.glob("*.bin"))
    assert len(saved) == 1
    assert greedy(first, prompts) == eager
    with caplog.at_level(logging.INFO, logger="pagellm"):
        second = engine(tiny_llama, enforce_eager=False)
    assert "compiled forward loaded" in caplog.text
    assert "model compiled" not in caplog.text
    assert greedy(second, prompts) == eager
    assert second.engine.stats().forward_compiled


def test_a_broken_saved_forward_is_replaced(tiny_llama, compiled_forwards_of_this_test, caplog):
    """A truncated file (a crash while saving, a torch upgrade) is reported, removed, and compiled afresh."""
    llm = engine(tiny_llama, enforce_eager=False)
    (path,) = compiled_forwards_of_this_test.glob("*.bin")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.INFO, logger="pagellm"):
        again = engine(tiny_llama, enforce_eager=False)
    assert "cannot be used" in caplog.text and "model compiled" in caplog.text
    assert greedy(again, mixed_prompts(300)[:2]) == greedy(llm, mixed_prompts(300)[:2])


def test_background_compile_swaps_in_between_steps_with_the_same_tokens(
    tiny_llama, compiled_forwards_of_this_test, monkeypatch
):
    """Ready on the eager forward at once; requests stream across both swaps (the regional forward, then the
    whole graph, compiled only once the engine idles) and every one's tokens equal the eager engine's."""
    prompts = mixed_prompts(300)[:2]
    expected = greedy(engine(tiny_llama), prompts)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a two-core machine's engine
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    llm = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
    runner = llm.engine.runner
    assert runner.forward is runner.model and runner.compiler.pending
    assert not llm.engine.stats().forward_compiled
    assert threads == [1], "the steps leave the compile process a core"
    monkeypatch.setattr(runner_compile, "WHOLE_PUT_OFF_AT_MOST_S", 3600.0)

    def stage() -> str:
        stats = llm.engine.stats()
        return "regional" if stats.forward_regional else "whole" if stats.forward_compiled else "eager"

    paths = []
    for wanted in ("regional", "whole"):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            paths.append(stage())
            assert greedy(llm, prompts) == expected
            if paths[-1] == wanted:
                break
            time.sleep(0.5)
        if wanted == "regional":
            assert runner.compiler.process is None and llm.engine.waits_for_idle(), "the whole graph waits"
            assert threads == [1, 2], "the core is taken back once the regional compile ended"
            llm.engine.on_idle()
            assert runner.compiler.process is not None and not runner.compiler.process.request.regional
    stages = list(dict.fromkeys(paths))
    assert stages == ["eager", "regional", "whole"], f"the forwards swapped in: {stages}"
    assert not runner.compiler.pending
    saved = sorted(path.name for path in compiled_forwards_of_this_test.glob("*.bin"))
    assert [name.endswith(".regional.bin") for name in saved] == [False, True], saved
    assert threads == [1, 2, 1, 2], "the core is taken back once each compile ended"
    assert greedy(llm, prompts) == expected


def test_a_warm_start_serves_at_once_and_loads_the_saved_forward_in_the_background(
    tiny_llama, compiled_forwards_of_this_test, caplog
):
    """With compile_in_background a start that finds the saved forward does not wait for it: the eager forward
    serves while a thread loads the file, the loaded one is checked and swapped in between two steps, and
    nothing compiles; the tokens are the eager engine's throughout."""
    prompts = mixed_prompts(300)[:2]
    expected = greedy(engine(tiny_llama), prompts)
    engine(tiny_llama, enforce_eager=False)  # compiles and saves
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
        runner = llm.engine.runner
        loading = runner.compiler.loading
        assert runner.forward is runner.model and loading is not None and runner.compiler.process is None
        assert greedy(llm, prompts) == expected  # may swap it in midway
        loading.wait()
        assert greedy(llm, prompts) == expected
    assert llm.engine.stats().forward_compiled and not runner.compiler.pending
    assert "compiled forward swapped in" in caplog.text and "compiling the model" not in caplog.text


def test_a_warm_start_puts_the_load_off_while_requests_run_and_loads_once_idle(
    tiny_llama, compiled_forwards_of_this_test, monkeypatch
):
    """The load holds the GIL for seconds, so a warm start does not begin it while requests run: the engine
    starts it when it idles (`on_idle`), or at the first step after LOAD_PUT_OFF_AT_MOST_S when it never
    does; the tokens are the eager engine's throughout."""
    prompts = mixed_prompts(300)[:2]
    expected = greedy(engine(tiny_llama), prompts)
    engine(tiny_llama, enforce_eager=False)  # compiles and saves
    monkeypatch.setattr(runner_compile, "LOAD_PUT_OFF_AT_MOST_S", 3600.0)
    llm = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
    compiler = llm.engine.runner.compiler
    assert llm.engine.waits_for_idle() and compiler.loading.poll() is None
    assert greedy(llm, prompts) == expected
    assert compiler.loading.started is None, "loaded while requests ran"
    llm.engine.on_idle()
    assert compiler.loading.started is not None and not llm.engine.waits_for_idle()
    compiler.loading.wait()
    assert greedy(llm, prompts) == expected and llm.engine.stats().forward_compiled

    monkeypatch.setattr(runner_compile, "LOAD_PUT_OFF_AT_MOST_S", 0.0)
    busy = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
    assert greedy(busy, prompts) == expected
    loading = busy.engine.runner.compiler.loading
    assert loading is None or loading.started is not None, (
        "a busy engine loads it after the wait all the same"
    )


def test_a_broken_saved_forward_found_at_a_warm_start_is_compiled_again_in_the_background(
    tiny_llama, compiled_forwards_of_this_test, caplog
):
    """A truncated file found by a background start is reported and removed, and the compile process makes it
    again while the eager forward serves."""
    prompts = mixed_prompts(300)[:2]
    expected = greedy(engine(tiny_llama), prompts)
    engine(tiny_llama, enforce_eager=False)
    (path,) = compiled_forwards_of_this_test.glob("*.bin")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
        runner = llm.engine.runner
        runner.compiler.loading.wait()
        assert greedy(llm, prompts) == expected
    assert "cannot be used" in caplog.text and "compiling the model in a separate process" in caplog.text
    assert runner.compiler.process is not None and not llm.engine.stats().forward_compiled
    runner.compiler.stop()


def test_a_start_that_finds_only_the_regional_forward_loads_it_and_compiles_the_whole_graph_later(
    tiny_llama, compiled_forwards_of_this_test
):
    """A server stopped before its whole graph compiled left only the regional file: the next start loads that
    (once idle) and compiles the whole graph when idle again, never the regional one anew."""
    prompts = mixed_prompts(300)[:2]
    expected = greedy(engine(tiny_llama), prompts)
    first = engine(tiny_llama, enforce_eager=False)
    compiler = first.engine.runner.compiler
    key = compiler.key()
    regional = compiled_forward.artifact_path(key, regional=True)
    compiled_forward.save(compiler.compile_ahead(regional=True), regional)
    compiled_forward.artifact_path(key).unlink()
    llm = engine(tiny_llama, enforce_eager=False, compile_in_background=True)
    compiler = llm.engine.runner.compiler
    assert compiler.loading.path == regional and compiler.process is None
    assert compiler.whole_later == compiled_forward.artifact_path(key)
    llm.engine.on_idle()
    compiler.loading.wait()
    assert greedy(llm, prompts) == expected
    assert llm.engine.stats().forward_regional and llm.engine.waits_for_idle()
    llm.engine.on_idle()
    assert compiler.process is not None and not compiler.process.request.regional
    compiler.stop()
