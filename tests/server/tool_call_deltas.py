"""Reassembling streamed tool-call deltas, as an OpenAI client does, for the tool-parser stream tests."""

from __future__ import annotations


def gather_tool_call_deltas(deltas: list[dict], calls: dict) -> None:
    """Add streamed tool-call deltas to `calls` ({index: [name, arguments]}): a delta with an id opens the
    next call, the others extend their call's arguments."""
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function"
            calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
        else:
            calls[d["index"]][1] += d["function"]["arguments"]
