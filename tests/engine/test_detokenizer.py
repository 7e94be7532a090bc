import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling.params import SamplingParams

CORPUS = [
    "héllo 世界 🙂 hello world, the quick brown fox jumps over the lazy dog.",
    "naïve café 日本語のテキスト 😀👍 the end of the story is near.",
    "hello world hello world the end",
]


@pytest.fixture(scope="module")
def byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<sep>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class SlowWrapper:
    """A tokenizer without a Rust backend, so the detokenizer takes its pure-Python path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(params=["rust", "python"])
def tokenizer(request, byte_bpe):
    return byte_bpe if request.param == "rust" else SlowWrapper(byte_bpe)


def _encode(tokenizer, text):
    return getattr(tokenizer, "tokenizer", tokenizer).encode(text, add_special_tokens=False)


def _stream(detok, ids, chunk=1):
    """Feed ids in chunks; return the matched stop string and the deltas."""
    deltas = []
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.get_delta())
        if stop is not None:
            return stop, deltas
    deltas.append(detok.get_delta(finished=True))
    return None, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_equals_full_decode_for_random_tokens(tokenizer, byte_bpe, skip_special_tokens):
    rng = random.Random(0)
    prompt = _encode(tokenizer, "hello world")
    end = _encode(tokenizer, " end")  # ends on a whole character, so nothing is left pending
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(30):
        ids = [rng.randrange(len(byte_bpe)) for _ in range(rng.randrange(1, 25))] + end
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        _, deltas = _stream(detok, ids, chunk=rng.randrange(1, 4))
        assert detok.output_text == full
        assert "".join(deltas) == full
        assert detok.output_token_ids == ids


def test_multibyte_character_split_across_tokens(tokenizer):
    ids = _encode(tokenizer, "a🎉b")  # not in the corpus: the emoji stays several byte tokens
    assert len(ids) >= 4
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "hello"), SamplingParams())
    seen = []
    for token_id in ids:
        detok.update([token_id])
        seen.append(detok.output_text)
    assert seen == ["a"] * (len(ids) - 2) + ["a🎉", "a🎉b"]


def test_prompt_ending_inside_a_character(tokenizer):
    ids = _encode(tokenizer, "hi 🎉!")
    detok = IncrementalDetokenizer(tokenizer, ids[:-3], SamplingParams())
    detok.update(ids[-3:])
    # The character completed by the output is emitted whole (with the prompt's pending bytes).
    assert detok.output_text.strip() == "🎉!"


def test_skip_special_tokens(tokenizer):
    ids = _encode(tokenizer, "hello") + [0] + _encode(tokenizer, " world")
    for skip, expected in ((True, "hello world"), (False, "hello<eos> world")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        detok.update(ids)
        assert detok.output_text == expected


def test_stop_string_spanning_tokens_is_cut_and_held_back(tokenizer):
    ids = _encode(tokenizer, "the lazy dog. the end of the story")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["the end"]))
    visible = []
    for token_id in ids:
        stop = detok.update([token_id])
        visible.append(detok.visible_text())
        if stop:
            break
    assert stop == "the end" and detok.stop_string == "the end"
    assert detok.output_text == "the lazy dog. "
    # Every visible text is a prefix of the final one: "the" was held back, never shown then retracted.
    assert all("the lazy dog. ".startswith(v) for v in visible)
    assert "the lazy dog. the" not in visible
    assert detok.update(_encode(tokenizer, " more")) is None
    assert detok.output_text == "the lazy dog. "


def test_false_start_of_a_stop_string_is_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world!"]))
    detok.update(_encode(tokenizer, "hello world"))
    assert detok.visible_text() == "hello " and detok.get_delta() == "hello "
    detok.update(_encode(tokenizer, ","))
    assert detok.get_delta() == "world,"
    detok.update(_encode(tokenizer, " wor"))
    assert detok.get_delta() == " " and detok.get_delta(finished=True) == "wor"


def test_include_stop_str_in_output_and_earliest_match(tokenizer):
    text = "hello world, the quick brown fox"
    params = SamplingParams(stop=["quick", "world"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    stop, deltas = _stream(detok, _encode(tokenizer, text), chunk=len(text))
    assert stop == "world" and detok.output_text == "hello world" and "".join(deltas) == "hello world"


def test_stream_with_stop_emits_nothing_after_it(tokenizer):
    text = "héllo 世界 🙂 hello world"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["界 🙂"]))
    stop, deltas = _stream(detok, _encode(tokenizer, text + " the end"), chunk=2)
    assert stop == "界 🙂" and "".join(deltas) == "héllo 世" == detok.output_text


def test_min_tokens_ignores_early_stop_strings(tokenizer):
    ids = _encode(tokenizer, "the end the end")
    n = len(_encode(tokenizer, "the end"))
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["the end"], min_tokens=n))
    stop, _ = _stream(detok, ids)
    assert stop == "the end" and detok.output_text == "the end "


def test_stop_token_text_is_left_out(tokenizer):
    ids = _encode(tokenizer, "hello") + [0]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "hello" and detok.output_token_ids == ids
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "hello<eos>"


def test_first_token_keeps_its_leading_space():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # strips the space of the first token of a text
    tok.train_from_iterator(["hello world hello there world"] * 5, trainers.BpeTrainer(vocab_size=60))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    prompt, output = hf.encode("hello world", add_special_tokens=False)
    assert hf.decode([output]) == "world"
    for tokenizer in (hf, SlowWrapper(hf)):
        detok = IncrementalDetokenizer(tokenizer, [prompt], SamplingParams())
        detok.update([output])
        assert detok.output_text == " world"


def test_spaces_between_special_tokens():
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "<x>": 3, "<y>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins tokens with spaces
    tok.add_special_tokens(["<x>", "<y>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    for spaces, expected in ((True, "a <x> <y> b"), (False, "a <x><y> b")):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(hf, [], params)
        for token_id in (1, 3, 4, 2):
            detok.update([token_id])
        assert detok.output_text == expected


def test_decoder_that_rewrites_earlier_text_does_not_break_the_stream(caplog):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert hf.decode([1, 2, 3]) == "Xc"
    for tokenizer in (hf, SlowWrapper(hf)):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
        for token_id in (1, 2, 3):
            detok.update([token_id])
        assert detok.output_text == "ac"
    assert "restarting the decode stream" in caplog.text
