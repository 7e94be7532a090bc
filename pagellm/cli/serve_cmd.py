"""`pagellm serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import logging
import os
import socket

import click

from pagellm.cli.options import config_from_options, engine_options
from pagellm.engine.default_model import GGUF_FILE
from pagellm.server.limits import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_N

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
    help="Require `Authorization: Bearer KEY` on every path but /health and /metrics (repeatable). Pass "
    "keys in PAGELLM_API_KEY rather than here (several: space-separated): every user of the machine can "
    "read a flag's value in `ps`.",
)
@click.option("--chat-template", default=None, help="Chat template: a Jinja file, or the template itself.")
@click.option("--disable-log-requests", is_flag=True, help="Do not log each request.")
@click.option(
    "--max-n",
    default=DEFAULT_MAX_N,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most samples (`n`) one request may ask for; more is refused with 400.",
)
@click.option(
    "--max-request-body-mb",
    default=DEFAULT_MAX_BODY_MB,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Largest request body, in MiB; larger ones are refused with 413 before they are read.",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.',
)
@click.option(
    "--tool-call-parser",
    default=None,
    help="How to find tool calls in replies: hermes, llama3_json, or a plugin's (see `pagellm plugins`).",
)
@click.option(
    "--lora-modules",
    multiple=True,
    help="Serve a LoRA adapter as a model: NAME=PATH (repeatable; needs --enable-lora).",
)
@click.option(
    "--allow-runtime-lora-updating",
    is_flag=True,
    help="Add POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
)
@engine_options()
def serve(
    model_arg: str | None,
    host: str,
    port: int,
    served_model_names: tuple[str, ...],
    api_keys: tuple[str, ...],
    chat_template: str | None,
    disable_log_requests: bool,
    max_n: int,
    max_request_body_mb: float,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    lora_modules: tuple[str, ...],
    allow_runtime_lora_updating: bool,
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
    adapters = {}
    for module in lora_modules:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{module!r}: give NAME=PATH", param_hint="--lora-modules")
        adapters[name] = path
    if enable_auto_tool_choice and not tool_call_parser:
        raise click.UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, ...)"
        )
    names = list(served_model_names) or [config.model or GGUF_FILE.split(".")[0]]
    with _bind(host, port) as sock:
        llm = AsyncLLM.from_config(config)
        try:
            app = build_app(
                llm,
                names,
                api_keys=[k for k in api_keys if k],
                chat_template=_read_template(chat_template),
                log_requests=not disable_log_requests,
                max_n=max_n,
                max_body_bytes=int(max_request_body_mb * 2**20),
                tool_call_parser=tool_call_parser,
                enable_auto_tool_choice=enable_auto_tool_choice,
                lora_modules=adapters,
                allow_runtime_lora_updating=allow_runtime_lora_updating,
            )
            logger.info("serving %s on http://%s:%d", ", ".join(names), host, port)
            level = logging.getLogger("pagellm").getEffectiveLevel()
            uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level)).run(sockets=[sock])
        finally:
            llm.shutdown()


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (which takes seconds to minutes), so a busy port
    fails at once; uvicorn then listens on this very socket, so nothing can take the port in between."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror}; stop what uses it or pick another --port"
        ) from exc
    return sock


def _read_template(value: str | None) -> str | None:
    """--chat-template names a file, or is the template itself (vLLM accepts both)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()
