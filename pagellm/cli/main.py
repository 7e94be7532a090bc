"""The `pagellm` command line. Plugins add commands through the `pagellm_cli_commands` hook."""

from __future__ import annotations

import logging
import sys

import click

from pagellm.core.errors import PagellmError


class PagellmGroup(click.Group):
    """A group that adds plugin commands lazily and turns pagellm errors into one clear message."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        from pagellm.plugins import load_plugins

        return {c.name: c for c in load_plugins().cli_commands if c.name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.commands, *self._plugin_commands()])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self.commands.get(name) or self._plugin_commands().get(name)

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


def _register_builtin_commands() -> None:
    from pagellm.cli import bench_cmd, env_cmd, generate_cmd, plugins_cmd, proxy_cmd, run_batch_cmd, serve_cmd

    for command in (
        plugins_cmd.plugins,
        env_cmd.env,
        generate_cmd.generate,
        generate_cmd.chat,
        bench_cmd.bench,
        serve_cmd.serve,
        run_batch_cmd.run_batch,
        proxy_cmd.proxy,
    ):
        cli.add_command(command)


_register_builtin_commands()


def main() -> None:
    cli(prog_name="pagellm")
