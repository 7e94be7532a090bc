"""`pagellm serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import logging
from typing import Any

import click

from pagellm.cli.options import (
    bind,
    check_tool_choice,
    config_from_options,
    listen_options,
    name_path_pairs,
    serve_options,
    served_names,
)
from pagellm.cli.router_cmd import router_options, serve_router, wants_router
from pagellm.core.config import EngineConfig
from pagellm.engine.process_launch import EngineLaunch
from pagellm.server.limits import (
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_N,
    DEFAULT_RESPONSES_STORE_AGE_S,
    DEFAULT_RESPONSES_STORE_ENTRIES,
)

logger = logging.getLogger("pagellm")


@click.command()
@click.argument("model_arg", metavar="[MODEL]", required=False)
@listen_options
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
@click.option("--disable-log-requests", is_flag=True, help="Do not log each request.")
@click.option("--no-web-ui", is_flag=True, help="Do not serve the chat page at / (the API alone).")
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
    "--lora-modules",
    multiple=True,
    callback=name_path_pairs,
    help="Serve a LoRA adapter as a model: NAME=PATH (repeatable; needs --enable-lora).",
)
@click.option(
    "--allow-runtime-lora-updating",
    is_flag=True,
    help="Add POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
)
@click.option(
    "--enable-responses-store",
    is_flag=True,
    help="Keep /v1/responses responses in memory (unless a request sends store: false), for "
    "previous_response_id, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel.",
)
@click.option(
    "--responses-store-max-entries",
    default=DEFAULT_RESPONSES_STORE_ENTRIES,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most responses the store keeps; the oldest go first.",
)
@click.option(
    "--responses-store-max-age",
    "responses_store_max_age_s",
    default=DEFAULT_RESPONSES_STORE_AGE_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds the store keeps a response.",
)
@router_options
@serve_options(skip=("model",))
def serve(
    model_arg: str | None,
    host: str,
    port: int,
    api_keys: tuple[str, ...],
    disable_log_requests: bool,
    no_web_ui: bool,
    max_n: int,
    max_request_body_mb: float,
    lora_modules: tuple[tuple[str, str], ...],
    allow_runtime_lora_updating: bool,
    enable_responses_store: bool,
    responses_store_max_entries: int,
    responses_store_max_age_s: float,
    served_model_names: tuple[str, ...],
    chat_template: str | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    **options,
) -> None:
    """Serve MODEL (default: the embedded SmolLM2) over the OpenAI API: /v1/completions,
    /v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /health, /version, /metrics;
    and a chat page at / (--no-web-ui: none)."""
    models = options.pop("models")
    routed = {k: options.pop(k) for k in ("models_dir", "max_loaded_models", "keep_alive_s")}
    if wants_router(models, routed["models_dir"], routed["keep_alive_s"]):  # several models: the router
        routed.update(host=host, port=port, api_keys=api_keys, served_model_names=served_model_names)
        return serve_router(click.get_current_context(), model_arg, models, routed)
    options["model"] = models[0] if models else None
    if model_arg and options.get("model") and model_arg != options["model"]:
        raise click.UsageError(f"MODEL {model_arg!r} and --model {options['model']!r} disagree; give one")
    if options.get("compile_in_background") is None:  # serve answers first and gets faster after
        options = {**options, "compile_in_background": True}
    config = config_from_options(options, model=model_arg)
    check_tool_choice(enable_auto_tool_choice, tool_call_parser)
    names = served_names(served_model_names, config)
    app_options = dict(
        api_keys=[k for k in api_keys if k],
        chat_template=chat_template,
        log_requests=not disable_log_requests,
        max_n=max_n,
        max_body_bytes=int(max_request_body_mb * 2**20),
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        lora_modules=dict(lora_modules),
        allow_runtime_lora_updating=allow_runtime_lora_updating,
        responses_store=(responses_store_max_entries, responses_store_max_age_s)
        if enable_responses_store
        else None,
        web_ui=not no_web_ui,
    )
    # the engine process starts importing now, beside the server's imports below (one engine process: data
    # parallelism starts its own); nothing above imported torch
    launched = EngineLaunch() if config.data_parallel_size == 1 else None
    try:
        _serve(config, launched, host, port, names, app_options)
    finally:
        if launched is not None:
            launched.discard()  # nothing once the engine adopted it


def _serve(
    config: EngineConfig,
    launched: EngineLaunch | None,
    host: str,
    port: int,
    names: list[str],
    app_options: dict[str, Any],
) -> None:
    import uvicorn

    from pagellm.server.starting import EngineStarter, StartingGate

    with bind(host, port) as sock:
        gate = StartingGate(", ".join(names))
        level = logging.getLogger("pagellm").getEffectiveLevel()
        server = uvicorn.Server(uvicorn.Config(gate, host=host, port=port, log_level=level, lifespan="off"))
        starter = EngineStarter(config, names, app_options, gate, server, launched)
        logger.info("listening on http://%s:%d; /health answers 503 until the engine has started", host, port)
        starter.start()
        try:
            server.run(sockets=[sock])
        finally:
            starter.stop()
    starter.raise_failure()
