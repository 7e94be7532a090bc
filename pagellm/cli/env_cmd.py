"""`pagellm env`: versions and hardware, for bug reports."""

from __future__ import annotations

import platform as pyplatform

import click

from pagellm.cli.options import engine_options
from pagellm.core.selector import select_platform
from pagellm.plugins import load_plugins

_PACKAGES = (
    "pagellm",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "pluggy",
    "triton",
    "flash-attn",
    "fastapi",
    "uvicorn",
    "click",
)


@click.command()
@engine_options(skip=("model", "tokenizer", "gguf_file"))
def env(**options) -> None:
    """Print versions, the selected device platform and its hardware facts."""
    import importlib.metadata as md

    click.echo(f"python: {pyplatform.python_version()} ({pyplatform.platform()})")
    for name in _PACKAGES:
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            version = "not installed"
        click.echo(f"{name}: {version}")
    choice = select_platform(load_plugins(), options.get("device"))
    click.echo(f"platform: {choice.platform.name}")
    for line in choice.explanation:
        click.echo(f"  {line}")
    for key, value in choice.platform.describe().items():
        click.echo(f"  {key}: {value}")
