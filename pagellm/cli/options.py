"""Engine options, declared once (from EngineConfig's fields) and shared by every engine command."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click

from pagellm.core.config import EngineConfig

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
