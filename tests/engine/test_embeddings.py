"""Embeddings (`runner="pooling"`, `LLM.embed`): each pooling type equals the transformers base model's final
hidden states pooled by hand (float32, allclose), for batches of prompts of different lengths and for a prompt
longer than the step's token budget (chunked prefill); the pooling comes from pooler_config or the model's
sentence-transformers files; `dimensions` only for Matryoshka models; each runner refuses the other's calls."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, PoolingParams, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.core.pooling import PoolerConfig, resolve_pooler

BUDGET = 32  # tokens per step: the long prompt runs in several chunks
SHORT = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3"]
LONG = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(
        str(model_dir),
        runner="pooling",
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        enforce_eager=True,
    )
    yield llm
    llm.shutdown()


def expected(hf_model, token_ids: list[int], pooling_type: str, normalize: bool, dims=None) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    vector = vector[:dims] if dims else vector
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def check(outputs, hf_model, pooling_type: str, normalize: bool, dims=None) -> None:
    for output in outputs:
        got = torch.tensor(output.outputs.embedding)
        want = expected(hf_model, output.prompt_token_ids, pooling_type, normalize, dims)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (
            pooling_type,
            normalize,
            (got - want).abs().max(),
        )


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_pooling_type_equals_the_hidden_states_pooled_by_hand(llm, hf_model, pooling_type, normalize):
    params = PoolingParams(normalize=normalize, pooling_type=pooling_type)
    outputs = llm.embed([*SHORT, LONG], params, use_tqdm=False)
    assert [o.prompt for o in outputs] == [*SHORT, LONG]
    assert len(outputs[-1].prompt_token_ids) > 2 * BUDGET  # ran in three chunks or more
    assert len({len(o.prompt_token_ids) for o in outputs}) == 4
    assert all(o.finished and o.outputs.hidden_size == 64 for o in outputs)
    check(outputs, hf_model, pooling_type, normalize)
    if normalize:
        assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in outputs)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.usage == 0 and not llm.engine.runner.pooling_states  # nothing kept after they finish


def test_the_default_is_last_normalized_and_prefix_caching_serves_only_last(llm, hf_model):
    pooler = llm.engine.pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.source) == ("LAST", True, "default")
    first, again = llm.embed([LONG], use_tqdm=False), llm.embed({"prompt": LONG}, use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[0].outputs.embedding == pytest.approx(
        first[0].outputs.embedding
    )
    check(again, hf_model, "LAST", True)
    mean = llm.embed([LONG], PoolingParams(pooling_type="mean"), use_tqdm=False)  # every position must run
    assert mean[0].num_cached_tokens == 0
    check(mean, hf_model, "MEAN", True)
    ids = llm.embed({"prompt_token_ids": [5, 6, 7, 8]}, use_tqdm=False)
    assert ids[0].prompt is None and ids[0].prompt_token_ids == [5, 6, 7, 8]
    check(ids, hf_model, "LAST", True)


def test_each_runner_refuses_the_others_calls(llm, model_dir):
    with pytest.raises(ConfigError, match="runner='pooling'.*runner='generate'"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="dimensions: this model does not support Matryoshka"):
        llm.embed(["Hello"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ConfigError, match="pooling_type: 'max' is not a pooling type"):
        llm.embed(["Hello"], PoolingParams(pooling_type="max"), use_tqdm=False)
    generating = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, max_model_len=128, enforce_eager=True)
    with pytest.raises(ConfigError, match="embeddings need an engine started with runner='pooling'"):
        generating.embed(["Hello"], use_tqdm=False)
    assert not generating.engine.has_unfinished_requests()


def sentence_transformers_copy(model_dir, tmp_path, pooling: dict, normalize: bool, **config) -> str:
    out = tmp_path / "st"
    shutil.copytree(model_dir, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    hf_config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf_config, **config}))
    return str(out)


def test_the_pooling_comes_from_modules_json_and_dimensions_from_a_matryoshka_config(
    model_dir, hf_model, tmp_path
):
    path = sentence_transformers_copy(
        model_dir, tmp_path, {"pooling_mode_mean_tokens": True}, False, matryoshka_dimensions=[16, 32]
    )
    llm = LLM(path, runner="pooling", dtype="float32", num_kv_blocks=40, enforce_eager=True)
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", False)
    check(llm.embed(SHORT, use_tqdm=False), hf_model, "MEAN", False)
    truncated = llm.embed(SHORT, PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    check(truncated, hf_model, "MEAN", True, dims=16)
    with pytest.raises(
        ConfigError, match="dimensions: 20 is not one this model was trained for; use one of 16, 32"
    ):
        llm.embed(SHORT, PoolingParams(dimensions=20), use_tqdm=False)
    # the flag overrides the files
    cls = LLM(path, runner="pooling", dtype="float32", num_kv_blocks=40, enforce_eager=True,
              pooler_config='{"pooling_type": "CLS", "normalize": true}')  # fmt: skip
    assert cls.engine.pooler.source == "pooler_config"
    check(cls.embed(SHORT, use_tqdm=False), hf_model, "CLS", True)


def test_resolving_the_pooler_config(tmp_path, model_dir):
    hf = type("Config", (), {"hidden_size": 64})()
    st = sentence_transformers_copy(model_dir, tmp_path, {"pooling_mode_cls_token": True}, True)
    assert resolve_pooler(st, hf, PoolerConfig()).pooling_type == "CLS"
    assert resolve_pooler(st, hf, PoolerConfig()).normalize is True
    assert resolve_pooler(st, hf, PoolerConfig(normalize=False)).pooling_type == "CLS"
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens.*pooler_config"):
        resolve_pooler(st, hf, PoolerConfig())
    assert resolve_pooler(st, hf, PoolerConfig("MEAN")).pooling_type == "MEAN"
    assert PoolerConfig.parse('{"pooling_type": "last"}') == PoolerConfig("LAST")
    for bad, match in (("{", "not valid JSON"), ('{"pooling": 1}', "unknown key"),
                       ('{"pooling_type": "MAX"}', "pooling_type"), ('{"normalize": 1}', "normalize")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"pooler_config.*{match}|{match}"):
            PoolerConfig.parse(bad)
    with pytest.raises(ConfigError, match="runner='pooling'"):
        LLM(str(model_dir), pooler_config='{"pooling_type": "MEAN"}', dtype="float32", num_kv_blocks=16)
