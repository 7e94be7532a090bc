"""What the `pagellm bench` command tests share: the engine, floor and workload flags, and running a
command."""

from __future__ import annotations

from click.testing import CliRunner

from pagellm.cli.main import cli

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-space", "0.05"]
FLOOR_ARGS = ["--peak-tflops", "0.5", "--read-gb-s", "20"]  # given, so tests do not measure the machine
SMALL_W1 = ["--num-prompts", "4", "--input-len-min", "8", "--input-len-max", "24"]  # a W1 small enough to run
SMALL_W1 += ["--output-len-min", "2", "--output-len-max", "6"]


def run_bench(args: list[str]):
    """`pagellm bench ARGS...` in-process; it must exit 0."""
    result = CliRunner().invoke(cli, ["--log-level", "WARNING", "bench", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result
