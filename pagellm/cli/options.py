"""Options that several commands take, declared once: the engine's (from EngineConfig's fields), the OpenAI
app's (`serve`, `run-batch`) and the listening address (`serve`, `proxy`); and what turns them into values."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import click

from pagellm.core.config import EngineConfig
from pagellm.engine.default_model import GGUF_FILE

_TYPES = {"int": int, "float": float, "str": str}


def _option_for(f: dataclasses.Field) -> Callable:
    flag = "--" + f.name.replace("_", "-")
    meta = f.metadata
    type_name = str(f.type).replace(" | None", "")
    if type_name == "bool":
        return click.option(
            f"{flag}/--no-{flag[2:]}",
            f.name,
            default=None,
            envvar=meta.get("envvar"),
            show_envvar=bool(meta.get("envvar")),
            help=f"{meta['help']} [default: {f.default}]",
        )
    if type_name == "list[str]":
        return click.option(
            flag,
            f.name,
            multiple=True,
            callback=lambda ctx, param, value: list(value) or None,
            help=f"{meta['help']} [default: {f.default}]",
        )
    if meta.get("json"):
        kind: Any = click.STRING
    else:
        kind = click.Choice(meta["choices"]) if "choices" in meta else _TYPES[type_name]
    return click.option(
        flag,
        f.name,
        type=kind,
        default=None,
        envvar=meta.get("envvar"),
        show_envvar=bool(meta.get("envvar")),
        help=f"{meta['help']} [default: {f.default}]",
    )


def engine_options(skip: tuple[str, ...] = ()) -> Callable:
    """Decorator adding one option per EngineConfig field (except `skip`) to a click command."""

    def decorate(command: Callable) -> Callable:
        for f in reversed(dataclasses.fields(EngineConfig)):
            if f.name not in skip:
                command = _option_for(f)(command)
        return command

    return decorate


def config_from_options(options: dict[str, Any], **overrides: Any) -> EngineConfig:
    """EngineConfig from the options a command received; options left unset keep their defaults."""
    names = EngineConfig.field_names()
    given = {k: v for k, v in options.items() if k in names and v is not None}
    given.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(**given)


# -- the OpenAI app: `serve` and `run-batch` ----------------------------------------------------------------


def read_template(value: str | None) -> str | None:
    """--chat-template names a file, or is the template itself (vLLM accepts both)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def serve_options(skip: tuple[str, ...] = ()) -> Callable:
    """Decorator adding the options of the OpenAI app that `serve` and `run-batch` build (the command gets
    `served_model_names`, `chat_template` as the template's text, `enable_auto_tool_choice` and
    `tool_call_parser`), then the engine options (except `skip`)."""
    app_options = (
        click.option(
            "--served-model-name",
            "served_model_names",
            multiple=True,
            help="Name requests give as `model` (repeatable; the first is the default). [default: MODEL]",
        ),
        click.option(
            "--chat-template",
            default=None,
            callback=lambda ctx, param, value: read_template(value),
            help="Chat template: a Jinja file, or the template itself.",
        ),
        click.option(
            "--enable-auto-tool-choice",
            is_flag=True,
            help='Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.',
        ),
        click.option(
            "--tool-call-parser",
            default=None,
            help="How to find tool calls in replies: hermes, llama3_json, openai, or a plugin's "
            "(see `pagellm plugins`).",
        ),
    )

    def decorate(command: Callable) -> Callable:
        command = engine_options(skip)(command)
        for option in reversed(app_options):
            command = option(command)
        return command

    return decorate


def check_tool_choice(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    if enable_auto_tool_choice and not tool_call_parser:
        raise click.UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, ...)"
        )


def served_names(names: tuple[str, ...], config: EngineConfig) -> list[str]:
    """--served-model-name's values, or the model's name (the embedded model's file name without it)."""
    return list(names) or [config.model or GGUF_FILE.split(".")[0]]


# -- option values --------------------------------------------------------------------------------------------


def name_path_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
    """Callback: NAME=PATH values (--lora-modules) as (name, path) pairs."""
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{value!r}: give NAME=PATH")
        pairs.append((name, path))
    return tuple(pairs)


def json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """Callback: a JSON value given as text (None stays None)."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from exc


def comma_ints(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """Callback: "8,16,64" as (8, 16, 64)."""
    try:
        return tuple(int(s) for s in value.split(",") if s.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: give integers separated by commas") from exc


def comma_choices(what: str, *choices: str) -> Callable:
    """Callback factory: repeated and comma-separated values, each one of `choices` (`what` names one in
    the error), as one tuple."""

    def convert(ctx: click.Context, param: click.Parameter, values: str | tuple[str, ...]) -> tuple[str, ...]:
        values = (values,) if isinstance(values, str) else values
        given = tuple(v.strip() for value in values for v in value.split(",") if v.strip())
        unknown = sorted(set(given) - set(choices))
        if unknown:
            raise click.BadParameter(f"unknown {what}(s) {', '.join(unknown)}; choose {', '.join(choices)}")
        return given

    return convert


# -- the listening address: `serve` and `proxy` -------------------------------------------------------------


def listen_options(command: Callable) -> Callable:
    """Decorator adding --host and --port."""
    command = click.option("--port", default=8000, show_default=True, type=int)(command)
    return click.option(
        "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all)."
    )(command)


def bind(host: str, port: int) -> socket.socket:
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
