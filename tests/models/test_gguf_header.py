"""A GGUF file's header fields read without the gguf package's reader (`models/gguf_header.py`): the
architecture the GGUF default checks, and the file type Ollama's routes report, past the vocabulary arrays."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagellm.models.gguf_header import gguf_architecture, gguf_file_type, gguf_header_field


def _write(path, file_type=None, arch="llama"):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])  # strings to step over
    writer.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.125])  # scalars to step over
    if file_type is not None:
        writer.add_file_type(file_type)  # after the arrays, as llama-quantize leaves it
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fields_are_read_past_the_arrays(tmp_path):
    path = _write(tmp_path / "q.gguf", gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert gguf_architecture(path) == "llama"
    assert gguf_header_field(path, "llama.block_count") == 2
    assert gguf_file_type(path) == "Q4_K_M"
    assert gguf_header_field(path, "tokenizer.ggml.tokens") is None  # an array: not a scalar field
    assert gguf_header_field(path, "no.such.key") is None


@pytest.mark.parametrize("content", [b"", b"GGU", b"GGUF", b"not a gguf file at all"])
def test_other_files_give_none(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert gguf_architecture(path) is None and gguf_file_type(path) is None


def test_a_file_without_a_file_type(tmp_path):
    assert gguf_file_type(_write(tmp_path / "f.gguf")) is None
    assert gguf_file_type(tmp_path / "missing.gguf") is None
