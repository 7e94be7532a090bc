"""`pagellm run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the server's endpoints,
without a server (see pagellm/server/batch.py for the format)."""

from __future__ import annotations

import asyncio

import click

from pagellm.cli.options import config_from_options, engine_options
from pagellm.cli.serve_cmd import _read_template
from pagellm.engine.default_model import GGUF_FILE
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
    "--served-model-name",
    "served_model_names",
    multiple=True,
    help="Name the requests' `model` may use (repeatable; the first is the default). [default: MODEL]",
)
@click.option("--chat-template", default=None, help="Chat template: a Jinja file, or the template itself.")
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.',
)
@click.option(
    "--tool-call-parser", default=None, help="How to find tool calls in replies: hermes, llama3_json, ..."
)
@click.option(
    "--max-concurrency",
    default=DEFAULT_BATCH_CONCURRENCY,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most requests given to the engine at once.",
)
@engine_options()
def run_batch(
    input_file: str,
    output_file: str,
    served_model_names: tuple[str, ...],
    chat_template: str | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    max_concurrency: int,
    **options,
) -> None:
    """Run a batch file in OpenAI's format: each line {"custom_id", "method": "POST", "url", "body"}, url one
    of /v1/completions and /v1/chat/completions; each result line {"id", "custom_id", "response", "error"},
    in input order."""
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.server.app import build_app
    from pagellm.server.batch import run_batch as run

    if enable_auto_tool_choice and not tool_call_parser:
        raise click.UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, ...)"
        )
    config = config_from_options(options)
    with open(input_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    names = list(served_model_names) or [config.model or GGUF_FILE.split(".")[0]]
    llm = AsyncLLM.from_config(config)
    try:
        app = build_app(
            llm,
            names,
            chat_template=_read_template(chat_template),
            log_requests=False,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
        )
        with open(output_file, "w", encoding="utf-8") as out:
            failed = asyncio.run(run(app, lines, out, max_concurrency))
    finally:
        llm.shutdown()
    click.echo(f"{len(lines)} requests, {failed} with errors: {output_file}", err=True)
