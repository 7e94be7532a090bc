"""Request ids: a caller may use an id again as soon as its request finished, before the engine's next step
has told the runner so. The engine's own ids are unique, so the runner, which learns of requests only from
each step's `SchedulerOutput`, never releases the new request's state for the old one's finish."""

from __future__ import annotations

import pytest
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.config import EngineConfig
from pagellm.core.pooling import PoolingParams
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling.params import SamplingParams

SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("ids"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=128))


def run(engine: LLMEngine, request_id: str, params: SamplingParams | PoolingParams = SEEDED, prompt="Hello"):
    """Add a request and step until its final output, which comes back under the caller's id."""
    assert engine.add_request(prompt, params, request_id=request_id) == request_id
    for _ in range(100):
        for output in engine.step():
            assert output.request_id == request_id
            if output.finished:
                return output
    raise AssertionError(f"request {request_id} did not finish")


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left in the scheduler, every block free, and (after one more step) nothing in the runner."""
    assert not engine.has_unfinished_requests()
    engine.step()  # hands the runner the ids that finished since the last step
    runner = engine.runner
    assert runner.generators == {} and runner.input_batch.rows == {} and runner.pooling_states == {}
    assert engine.scheduler.kv_cache_manager.num_free_blocks == runner.num_blocks - 1


def test_an_id_used_again_right_after_its_request_finished_runs_again(engine):
    first = run(engine, "session")
    again = [run(engine, "session") for _ in range(8)]
    assert first.error is None and len(first.outputs[0].token_ids) == 6
    for output in again:  # each gets a fresh generator of the same seed: the same tokens
        assert output.error is None
        assert output.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(engine)


def test_n_samples_under_a_reused_id(engine):
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, ignore_eos=True)
    outputs = [run(engine, "n2", params) for _ in range(3)]
    for output in outputs:
        assert output.error is None and [c.index for c in output.outputs] == [0, 1]
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in outputs[0].outputs]
    assert_idle(engine)


def test_abort_by_the_callers_id_then_the_id_again(engine):
    engine.add_request("Hello", SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.step()
    aborted = engine.abort_request("a")
    assert aborted.request_id == "a" and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None  # gone: aborting again does nothing
    assert run(engine, "a").error is None
    assert_idle(engine)


def test_an_id_still_running_is_refused(engine):
    engine.add_request("Hello", SEEDED, request_id="busy")
    with pytest.raises(ValueError, match="busy"):
        engine.add_request("Hello", SEEDED, request_id="busy")
    engine.abort_request("busy")
    assert_idle(engine)


def test_a_pooling_request_id_used_again(model_dir):
    pooling = LLMEngine(
        EngineConfig(
            model=str(model_dir), runner="pooling", dtype="float32", num_kv_blocks=16, max_model_len=128
        )
    )
    vectors = [run(pooling, "doc", PoolingParams()).outputs.embedding for _ in range(3)]
    assert vectors[0] and vectors[1] == vectors[0] and vectors[2] == vectors[0]
    assert_idle(pooling)


def test_a_preempted_seeded_request_resumes_with_its_generator(engine, model_dir):
    """Preempted, a request keeps its generator: it draws the same tokens as it would have unpreempted."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    prompts = ["Hello", "The quick brown fox", "Once upon a time"]
    alone = [
        run(engine, f"alone-{i}", params, prompt).outputs[0].token_ids for i, prompt in enumerate(prompts)
    ]
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=6, max_model_len=64)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone
