"""The `pagellm` command line. Plugins add commands through the `pagellm_cli_commands` hook."""

from __future__ import annotations

import importlib
import logging
import sys

import click

from pagellm.core.errors import PagellmError

BUILTIN_COMMANDS = {
    "plugins": ("pagellm.cli.plugins_cmd", "plugins"),
    "env": ("pagellm.cli.env_cmd", "env"),
    "generate": ("pagellm.cli.generate_cmd", "generate"),
    "chat": ("pagellm.cli.generate_cmd", "chat"),
    "bench": ("pagellm.cli.bench_cmd", "bench"),
    "serve": ("pagellm.cli.serve_cmd", "serve"),
    "run-batch": ("pagellm.cli.run_batch_cmd", "run_batch"),
    "proxy": ("pagellm.cli.proxy_cmd", "proxy"),
    "pull": ("pagellm.cli.models_cmd", "pull"),
    "list": ("pagellm.cli.models_cmd", "list_models"),
    "ps": ("pagellm.cli.models_cmd", "ps"),
    "rm": ("pagellm.cli.models_cmd", "rm"),
}
"""Command name -> (module, attribute). A command's module is imported when it runs (or help lists it), so
`pagellm serve` imports no benchmark code and no torch before it has started its engine process."""


class PagellmGroup(click.Group):
    """A group that adds the built-in commands and plugin commands lazily and turns pagellm errors into one
    clear message."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        from pagellm.plugins import load_plugins

        return {c.name: c for c in load_plugins().cli_commands if c.name not in BUILTIN_COMMANDS}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*BUILTIN_COMMANDS, *self._plugin_commands()])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in BUILTIN_COMMANDS:
            module, attribute = BUILTIN_COMMANDS[name]
            return getattr(importlib.import_module(module), attribute)
        return self._plugin_commands().get(name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PagellmError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=PagellmGroup)
@click.option(
    "--log-level",
    default="INFO",
    envvar="PAGELLM_LOG_LEVEL",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.version_option(package_name="pagellm")
def cli(log_level: str) -> None:
    """pagellm: fast LLM inference and serving."""
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def main() -> None:
    cli(prog_name="pagellm")
