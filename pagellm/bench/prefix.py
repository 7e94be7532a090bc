"""`pagellm bench prefix`: W3, requests sharing one prefix, with prefix caching on and then off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.bench.common import COLUMNS, BenchArgs, echo, progress, table, with_floor, write_json
from pagellm.bench.floor import format_floor
from pagellm.bench.throughput import run_prefix_comparison
from pagellm.bench.workloads import w3
from pagellm.engine.setup import resolve_engine

PREFIX_COLUMNS = (
    *COLUMNS,
    ("mean TTFT s", "mean_ttft_s", "{:.3f}"),
    ("hit rate", "prefix_cache_hit_rate", "{:.1%}"),
)


@dataclass(kw_only=True)
class PrefixArgs(BenchArgs):
    """W3's size."""

    num_prompts: int = 64
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 64


def main(args: PrefixArgs) -> dict[str, Any]:
    """Run W3 with prefix caching on, then off (see `run_prefix_comparison`): prints the table with the hit
    rates and each run's floor, writes `args.output_json`, and returns the report's sections."""
    config = args.engine_config()
    vocab = resolve_engine(config).hf_config.vocab_size
    requests = w3(vocab, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len)
    results = run_prefix_comparison(config, requests, on_result=progress, machine=args.llm_machine)
    rows = [with_floor(r.as_dict()) for r in results]
    echo(table(rows, PREFIX_COLUMNS))
    for result in results:
        echo(format_floor(result.extra["floor"], f"{result.engine} floor"))
    sections = {"workload": requests.describe(), "results": rows}
    write_json(args.output_json, "prefix", config, **sections)
    return sections
