"""Tool-call and reasoning parsers are typed plugin kinds (`pagellm.core.parsers`): a third-party class with
the Protocol's members is registered and served without importing pagellm's; a class without them is
refused when plugins load, naming what it lacks."""

from __future__ import annotations

import logging

import pytest

from pagellm.core.errors import PluginError
from pagellm.core.parsers import ReasoningParser, ToolCallParse, ToolParser, check_parser
from pagellm.plugins import load_plugins
from pagellm.server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pagellm.server.serving_chat import tool_parser
from pagellm.server.tool_parsers import HermesToolParser, Llama3JsonToolParser

THIRD_PARTY = """
    from pagellm.core.parsers import ToolCallParse

    class PipeTools:  # a ToolParser by its members alone
        name = "pipe"

        def parse(self, text, final=True):
            head, _, call = text.partition("|")
            return ToolCallParse(head, [(call, "{}")] if call else [])

    class BracketThinking:  # a ReasoningParser by its members alone
        name, end_tag = "bracket", "]"

        def split(self, text, final=True):
            thinking, _, answer = text.partition("]")
            return thinking.lstrip("["), answer

    @hookimpl
    def pagellm_tool_parsers():
        return [PipeTools]

    @hookimpl
    def pagellm_reasoning_parsers():
        return [BracketThinking]
    """

NOT_A_PARSER = """
    class Tools:
        name = "half"

        def parse_reply(self, text):  # not parse(text, final)
            return text

    @hookimpl
    def pagellm_tool_parsers():
        return [Tools]
    """


def test_the_built_in_parsers_are_the_kinds():
    for cls in (HermesToolParser, Llama3JsonToolParser):
        check_parser(cls, ToolParser)
        assert isinstance(cls(), ToolParser)
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        check_parser(cls, ReasoningParser)
        assert isinstance(cls(), ReasoningParser)


def test_a_third_party_parser_implementing_the_protocol_is_registered_and_served(fake):
    fake.add("vendor", THIRD_PARTY, api="1.1")
    registry = load_plugins()
    assert isinstance(registry.reasoning_parsers["bracket"](), ReasoningParser)
    parser = tool_parser("pipe")  # what --tool-call-parser pipe serves with
    assert isinstance(parser, ToolParser)
    assert parser.parse("ok|lookup") == ToolCallParse("ok", [("lookup", "{}")])


def test_a_class_that_is_not_a_parser_is_refused_naming_what_it_lacks(fake, monkeypatch, caplog):
    fake.add("half", NOT_A_PARSER, api="1.1")
    fake.add("vendor", THIRD_PARTY, api="1.1")
    with caplog.at_level(logging.WARNING, logger="pagellm.plugins"):
        registry = load_plugins()
    assert list(registry.tool_parsers) == ["pipe"]  # the other plugin still loads
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'half'" in warning and "pagellm_tool_parsers" in warning
    assert "Tools is not a ToolParser: it needs a method parse()" in warning
    with pytest.raises(ValueError, match="--tool-call-parser half: no such tool-call parser; known: pipe"):
        tool_parser("half")

    monkeypatch.setenv("PAGELLM_PLUGINS", "half")  # asked for by name: start-up fails
    with pytest.raises(PluginError, match="'half'.*Tools is not a ToolParser: it needs a method parse()"):
        load_plugins()


def test_the_check_names_every_missing_member_and_refuses_instances():
    class Nothing:
        pass

    with pytest.raises(TypeError, match="needs a str attribute 'name' and a str attribute 'end_tag' and a"):
        check_parser(Nothing, ReasoningParser)
    with pytest.raises(TypeError, match="is not a class; return the ToolParser classes"):
        check_parser(HermesToolParser(), ToolParser)
