"""`load_tokenizer` keeps each directory's tokenizer pickled in the cache and reads it from there at later
starts; an edited tokenizer file makes a new one, and a pickle that does not load is loaded afresh."""

from __future__ import annotations

import pytest
import transformers
from tiny import make_tiny_checkpoint

from pagellm.engine import tokenizer as tokenizer_module
from pagellm.engine.tokenizer import load_tokenizer

TEXTS = ["Hello world, the capital of France is", "  spaces\tand\nlines ", "ünïcode 你好 🙂", "1234 + 5678"]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        ids = a(text).input_ids
        assert b(text).input_ids == ids and b.decode(ids) == a.decode(ids)
    assert b.get_vocab() == a.get_vocab() and b.all_special_ids == a.all_special_ids
    assert b.chat_template == a.chat_template and b.eos_token_id == a.eos_token_id


def test_a_second_load_reads_the_pickle_and_gives_the_same_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    first = load_tokenizer(str(model))
    kept = list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))
    assert len(kept) == 1

    def not_called(*args, **kwargs):
        raise AssertionError("AutoTokenizer ran although the pickle was there")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", not_called)
        second = load_tokenizer(str(model))
    _same(first, second)


def test_an_edited_tokenizer_file_is_loaded_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    load_tokenizer(str(model))
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (model / "chat_template.jinja").write_text(template)  # transformers 5 saves the template here
    edited = load_tokenizer(str(model))
    assert edited.chat_template == template
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "not a pickle"])
def test_a_pickle_that_does_not_load_is_loaded_afresh(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    first = load_tokenizer(str(model))
    pickled = tokenizer_module._pickled_path(str(model))
    data = open(pickled, "rb").read()
    open(pickled, "wb").write(data[: len(data) // 2] if damage == "truncated" else b"junk")
    _same(first, load_tokenizer(str(model)))
