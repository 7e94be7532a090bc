"""A GGUF file's converted copy (`gguf_checkpoint_dir`): its config and tokenizer at once, its float32
weights only when a start reads them (`gguf_checkpoint_weights`), so a start that reads the file's blocks
(`--quantization gguf`) writes none."""

from __future__ import annotations

from pathlib import Path

from parity import mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.gguf_convert import convert_hf_checkpoint
from pagellm.core.paths import cache_dir
from pagellm.models import gguf_checkpoint


def test_the_float_weights_are_converted_only_for_a_start_that_reads_them(tmp_path):
    path = convert_hf_checkpoint(
        make_tiny_checkpoint("llama", tmp_path / "hf"), tmp_path / "m.gguf", "float32"
    )
    copy = gguf_checkpoint._converted_path(Path(path).resolve(), cache_dir())
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(200)[:4]]
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)

    packed = LLM(str(path), quantization="gguf", **engine)
    assert (copy / "config.json").exists() and (copy / "tokenizer.json").exists()
    assert not (copy / "model.safetensors").exists(), "the blocks came from the file itself"
    tokens = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    del packed

    plain = LLM(str(path), quantization="none", **engine)
    assert (copy / "model.safetensors").exists()
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == tokens
    assert gguf_checkpoint.converted_copy(path, cache_dir()) == copy
    assert not list(copy.glob("*.tmp*")), "no partial file left"
