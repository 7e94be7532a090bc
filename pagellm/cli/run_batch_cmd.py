"""`pagellm run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the server's endpoints,
without a server (see pagellm/server/batch.py for the format)."""

from __future__ import annotations

import asyncio

import click

from pagellm.cli.options import check_tool_choice, config_from_options, serve_options, served_names
from pagellm.server.limits import DEFAULT_BATCH_CONCURRENCY


@click.command("run-batch")
@click.option(
    "-i",
    "--input-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Requests (JSONL).",
)
@click.option("-o", "--output-file", required=True, type=click.Path(dir_okay=False), help="Results (JSONL).")
@click.option(
    "--max-concurrency",
    default=DEFAULT_BATCH_CONCURRENCY,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most requests given to the engine at once.",
)
@serve_options()
def run_batch(
    input_file: str,
    output_file: str,
    max_concurrency: int,
    served_model_names: tuple[str, ...],
    chat_template: str | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    **options,
) -> None:
    """Run a batch file in OpenAI's format: each line {"custom_id", "method": "POST", "url", "body"}, url one
    of /v1/completions and /v1/chat/completions; each result line {"id", "custom_id", "response", "error"},
    in input order."""
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.server.app import build_app
    from pagellm.server.batch import run_batch as run

    check_tool_choice(enable_auto_tool_choice, tool_call_parser)
    config = config_from_options(options)
    with open(input_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    llm = AsyncLLM.from_config(config)
    try:
        app = build_app(
            llm,
            served_names(served_model_names, config),
            chat_template=chat_template,
            log_requests=False,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
        )
        with open(output_file, "w", encoding="utf-8") as out:
            failed = asyncio.run(run(app, lines, out, max_concurrency))
    finally:
        llm.shutdown()
    click.echo(f"{len(lines)} requests, {failed} with errors: {output_file}", err=True)
