"""`pagellm bench` hands its options to `pagellm.bench.<command>.main` as typed arguments: the flags'
defaults are the arguments' defaults, and list-like flags arrive parsed (or are refused at once)."""

from __future__ import annotations

import dataclasses

import click
import pytest

from pagellm.bench.latency import LatencyArgs
from pagellm.bench.prefix import PrefixArgs
from pagellm.bench.serve import ServeArgs
from pagellm.bench.throughput import ThroughputArgs
from pagellm.cli.bench_cmd import bench, bench_args
from pagellm.core.config import EngineConfig


def parse(command: str, args: list[str]):
    cls = {"throughput": ThroughputArgs, "latency": LatencyArgs, "prefix": PrefixArgs, "serve": ServeArgs}
    ctx = bench.commands[command].make_context(command, args)
    return bench_args(cls[command], ctx.params)


@pytest.mark.parametrize("command", ["throughput", "latency", "prefix", "serve"])
def test_the_flags_defaults_are_the_arguments_defaults(command):
    args = parse(command, [])
    assert args.engine["dtype"] is None and set(args.engine) <= EngineConfig.field_names()
    assert {**dataclasses.asdict(args), "engine": {}} == dataclasses.asdict(type(args)())


def test_list_flags_arrive_parsed():
    args = parse(
        "throughput",
        [
            "--compare",
            "transformers",
            "--compare",
            "llama.cpp",
            "--llama-slots",
            "2,4",
            "--llama-flash-attn",
            "off",
        ]
        + ["--llama-args", "-b 512 --mlock", "--lora-modules", "a=/x", "--json-schema", '{"type": "object"}']
        + ["--dtype", "float32", "--model", "M", "--peer-dtype", "float32"],
    )
    assert args.compare == ("transformers", "llama.cpp") and args.llama_slots == (2, 4)
    assert args.llama_flash_attn == ("off",) and args.llama_args == ("-b", "512", "--mlock")
    assert args.lora_modules == (("a", "/x"),) and args.json_schema == {"type": "object"}
    assert args.model == "M" and args.engine["dtype"] == "float32" and args.peer_dtype == "float32"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compare", "vllm"], "unknown peer(s) vllm"),
        (["--llama-flash-attn", "auto"], "unknown setting(s) auto"),
        (["--llama-slots", "8,x"], "give integers separated by commas"),
        (["--lora-modules", "a"], "give NAME=PATH"),
        (["--json-schema", "{"], "not JSON"),
    ],
)
def test_bad_values_are_refused_before_anything_runs(flags, message):
    with pytest.raises(click.BadParameter, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse("throughput", flags)
