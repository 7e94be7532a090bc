"""`pagellm serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import logging
import os

import click

from pagellm.cli.options import config_from_options, engine_options
from pagellm.engine.default_model import GGUF_FILE

logger = logging.getLogger("pagellm")


@click.command()
@click.argument("model_arg", metavar="[MODEL]", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--served-model-name",
    "served_model_names",
    multiple=True,
    help="Name clients use for the model (repeatable; the first is the default). [default: MODEL]",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    envvar="PAGELLM_API_KEY",
    show_envvar=True,
    help="Require `Authorization: Bearer KEY` on every path but /health and /metrics (repeatable; "
    "the variable may hold several, separated by spaces).",
)
@click.option("--chat-template", default=None, help="Chat template: a Jinja file, or the template itself.")
@click.option("--disable-log-requests", is_flag=True, help="Do not log each request.")
@engine_options()
def serve(
    model_arg: str | None,
    host: str,
    port: int,
    served_model_names: tuple[str, ...],
    api_keys: tuple[str, ...],
    chat_template: str | None,
    disable_log_requests: bool,
    **options,
) -> None:
    """Serve MODEL (default: the embedded SmolLM2) over the OpenAI API: /v1/completions,
    /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /version, /metrics."""
    import uvicorn

    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.server.app import build_app

    if model_arg and options.get("model") and model_arg != options["model"]:
        raise click.UsageError(f"MODEL {model_arg!r} and --model {options['model']!r} disagree; give one")
    config = config_from_options(options, model=model_arg)
    names = list(served_model_names) or [config.model or GGUF_FILE.split(".")[0]]
    llm = AsyncLLM.from_config(config)
    try:
        app = build_app(
            llm,
            names,
            api_keys=[k for k in api_keys if k],
            chat_template=_read_template(chat_template),
            log_requests=not disable_log_requests,
        )
        logger.info("serving %s on http://%s:%d", ", ".join(names), host, port)
        uvicorn.run(app, host=host, port=port, log_level=logging.getLogger("pagellm").getEffectiveLevel())
    finally:
        llm.shutdown()


def _read_template(value: str | None) -> str | None:
    """--chat-template names a file, or is the template itself (vLLM accepts both)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()
