"""Regional compilation (worker/regional.py): the decoder layers traced as nested compile regions, one region
for every layer that differs only in its tensors, and the compiled regional forward computes what the eager
one does."""

from __future__ import annotations

import pytest
import torch
from parity import mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.models.llama import LlamaDecoderLayer
from pagellm.worker import compiled_forward
from pagellm.worker.regional import decoder_layers, layers_compiled_once

LAYERS = 5


def tiny_engine(tmp_path, arch: str = "llama", **overrides) -> LLM:
    path = make_tiny_checkpoint(arch, tmp_path, num_hidden_layers=LAYERS)
    settings = dict(dtype="float32", num_kv_blocks=400, max_model_len=256, enforce_eager=True)
    return LLM(str(path), **{**settings, **overrides})


def captured_graph(model: torch.nn.Module, args) -> torch.fx.GraphModule:
    """The graph Dynamo hands its backend for `model(*args)`."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from torch._dynamo.decorators import mark_unbacked

    for arg in args:
        mark_unbacked(arg, 0)  # as the runner compiles: one graph for every token count
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend, dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(specialize_float=True):  # as `CpuPlatform.compile_ahead` traces
        compiled(*args)
    (graph,) = graphs
    return graph


def test_the_layers_after_the_first_share_one_region(tmp_path):
    """Llama's first layer has no residual yet (its own trace, inlined); the other four are one region called
    four times. A per-layer constant in a layer's trace (the attention op's layer number, before it became
    the `layer_index` buffer) would make four regions. Outside the context the layers are as before."""
    llm = tiny_engine(tmp_path, attention_backend="CPU_ATTN")
    runner = llm.engine.runner
    model = runner.model
    layers = decoder_layers(model)
    assert len(layers) == LAYERS
    input_ids, positions, context = runner.compiler._dummy_step(8)
    with torch.inference_mode(), context, layers_compiled_once(model) as marked:
        assert marked == LAYERS
        graph = captured_graph(model, (input_ids, positions))
    calls = [node for node in graph.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == LAYERS - 1
    assert len({node.args[0].target for node in calls}) == 1, "one compiled layer for all of them"
    assert type(layers[0]).forward is LlamaDecoderLayer.forward and not hasattr(
        LlamaDecoderLayer.forward, "__marked_compile_region_fn__"
    )


def test_the_regional_forward_gives_the_eager_tokens(tmp_path, compiled_forwards_of_this_test):
    """Compiled ahead of time with its layers as regions, saved and loaded as a compile process hands it to
    the engine, it agrees with the eager forward and generates the same greedy tokens."""
    assert_regional_tokens(tiny_engine(tmp_path, attention_backend="CPU_ATTN"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["gpt2", "opt", "gemma2", "smollm3", "mixtral", "gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe"]
)
def test_every_family_s_regional_forward_gives_the_eager_tokens(
    arch, tmp_path, compiled_forwards_of_this_test
):
    """The families whose forward compiles ahead of time, one after another in one process (mixtral's
    regions, then gpt-oss's, made inductor fail before `layers_compiled_once` reset Dynamo)."""
    assert_regional_tokens(tiny_engine(tmp_path, arch))


def assert_regional_tokens(llm: LLM) -> None:
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(300)[:3]]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compiled = runner.compiler.compile_ahead(regional=True)
    path = compiled_forward.artifact_path(runner.compiler.key(), regional=True)
    compiled_forward.save(compiled, path)
    forward = compiled_forward.load(path, runner.model)
    assert runner.compiler._agrees(forward)
    runner.forward = forward
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
