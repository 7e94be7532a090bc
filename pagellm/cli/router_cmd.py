"""`pagellm serve --model A --model B` / `--models-dir DIR`: several models behind one server
(pagellm/server/router/). This module adds serve's --model (repeatable), --models-dir, --max-loaded-models
and --keep-alive, finds the models, and turns the router's other serve options into each child's."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pagellm.cli.options import bind, served_names
from pagellm.core.config import EngineConfig

logger = logging.getLogger("pagellm")

ROUTER_PARAMS = frozenset(
    {
        "model_arg",
        "models",
        "models_dir",
        "max_loaded_models",
        "keep_alive_s",
        "host",
        "port",
        "api_keys",
        "served_model_names",
        "no_web_ui",
    }
)
"""serve's parameters the router keeps for itself; every other one given is passed on to each child."""


def _model_help() -> str:
    meta = next(f for f in dataclasses.fields(EngineConfig) if f.name == "model").metadata
    return f"{meta['help']} Repeat it (NAME=PATH names one) to serve several models. [default: None]"


def router_options(command: Callable) -> Callable:
    """Decorator adding --model (repeatable: the command gets `models`), --models-dir, --max-loaded-models
    and --keep-alive."""
    options = (
        click.option("--model", "models", multiple=True, help=_model_help()),
        click.option(
            "--models-dir",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="Serve every model in DIR: each subfolder with a config.json, and each .gguf file, named by "
            "its folder or file stem. Each loads on its first request.",
        ),
        click.option(
            "--max-loaded-models",
            type=click.IntRange(min=1),
            default=None,
            help="With several models: most loaded at once; the least recently used idle one is unloaded "
            "to load another. [default: no limit]",
        ),
        click.option(
            "--keep-alive",
            "keep_alive_s",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Unload a model idle this many seconds (it loads again on its next request); given with "
            "one model, that model is served this way too. [default: never]",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


def wants_router(models: tuple[str, ...], models_dir: str | None, keep_alive_s: float | None) -> bool:
    """Several models, a models directory or a keep-alive: the router; otherwise the one-model server."""
    return len(models) > 1 or models_dir is not None or keep_alive_s is not None


def model_specs(model_arg: str | None, models: tuple[str, ...], models_dir: str | None) -> list:
    """The models to serve, named: `--model PATH` by PATH as given (as a one-model server names it),
    `--model NAME=PATH` by NAME, a --models-dir entry by its folder or file stem."""
    from pagellm.server.router.children import ModelSpec

    given = ([model_arg] if model_arg else []) + list(models)
    specs = []
    for value in given:
        name, sep, path = value.partition("=")
        specs.append(ModelSpec(name, path) if sep and name and path else ModelSpec(value, value))
    if models_dir:
        for entry in sorted(Path(models_dir).iterdir()):
            if entry.is_dir() and (entry / "config.json").is_file():
                specs.append(ModelSpec(entry.name, str(entry)))
            elif entry.is_file() and entry.suffix == ".gguf":
                specs.append(ModelSpec(entry.stem, str(entry)))
    if not specs and not models_dir:  # --keep-alive alone: the embedded model, named as serve names it
        specs.append(ModelSpec(served_names((), EngineConfig())[0], ""))
    if not specs:
        raise click.UsageError(
            f"no models found in {models_dir} (subfolders with a config.json, .gguf files)"
        )
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise click.UsageError(
            f"several models are named {', '.join(duplicates)}; name them with --model NAME=PATH"
        )
    return specs


def _flag_args(param: click.Parameter, value: Any) -> list[str]:
    """The command-line arguments that give `param` this (already converted) value again."""
    flag = param.opts[-1] if isinstance(param, click.Option) else ""
    if isinstance(param, click.Option) and param.is_flag:
        if value:
            return [param.opts[0]]
        return [param.secondary_opts[0]] if param.secondary_opts else []
    if isinstance(value, list | tuple):
        args = []
        for item in value:
            text = "=".join(item) if isinstance(item, tuple) else str(item)
            args += [flag, text]
        return args
    if isinstance(value, dict):
        import json

        return [flag, json.dumps(value)]
    return [flag, str(value)]


def child_serve_args(ctx: click.Context) -> list[str]:
    """The serve options the router was given (on the command line or in the environment), minus its own,
    as arguments for each child."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.name in ROUTER_PARAMS or not isinstance(param, click.Option):
            continue
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if (
            source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
            and value is not None
        ):
            args += _flag_args(param, value)
    return args


def serve_router(
    ctx: click.Context,
    model_arg: str | None,
    models: tuple[str, ...],
    router_settings: dict[str, Any],
) -> None:
    """Run the router until interrupted: the models of `model_specs`, children started with this command's
    other options. `router_settings`: models_dir, max_loaded_models, keep_alive_s, host, port, api_keys,
    served_model_names."""
    import uvicorn

    from pagellm.server.router.app import build_router_app
    from pagellm.server.router.children import SubprocessLauncher
    from pagellm.server.router.registry import ModelRegistry

    s = router_settings
    if s.get("served_model_names"):
        raise click.UsageError("--served-model-name names one model; with several, use --model NAME=PATH")
    specs = model_specs(model_arg, models, s.get("models_dir"))
    keys = [k for k in s.get("api_keys", ()) if k]
    level = logging.getLogger("pagellm").getEffectiveLevel()
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))  # not a line per proxied request
    env = {"PAGELLM_API_KEY": " ".join(keys)} if keys else {}
    launcher = SubprocessLauncher(child_serve_args(ctx), env=env, log_level=logging.getLevelName(level))
    registry = ModelRegistry(specs, launcher, s.get("max_loaded_models"), s.get("keep_alive_s"))
    host, port = s["host"], s["port"]
    with bind(host, port) as sock:
        max_body_bytes = int((ctx.params.get("max_request_body_mb") or 16) * 2**20)
        app = build_router_app(
            registry, keys, max_body_bytes=max_body_bytes, web_ui=not ctx.params.get("no_web_ui")
        )
        logger.info(
            "serving %d models on http://%s:%d (each loads on its first request): %s",
            len(specs),
            host,
            port,
            ", ".join(spec.name for spec in specs),
        )
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level))
        server.run(sockets=[sock])
