"""The plugin object pagellm loads: the API version it was written for and the hook implementations."""

from __future__ import annotations

import click

from pagellm.plugins import hookimpl

from .attention import VendorAttentionBackend
from .cli import vendor_info
from .platform import VendorSimPlatform
from .quant import VendorInt8Method

PAGELLM_PLUGIN_API = "1.0"


@hookimpl
def pagellm_platforms() -> list[type[VendorSimPlatform]]:
    return [VendorSimPlatform]


@hookimpl
def pagellm_attention_backends() -> list[type[VendorAttentionBackend]]:
    return [VendorAttentionBackend]


@hookimpl
def pagellm_quant_methods() -> list[type[VendorInt8Method]]:
    return [VendorInt8Method]


@hookimpl
def pagellm_cli_commands() -> list[click.Command]:
    return [vendor_info]
