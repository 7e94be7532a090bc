"""`pagellm vendor-info`: a command this plugin adds to the pagellm command line."""

from __future__ import annotations

import click

from .platform import VendorSimPlatform


@click.command("vendor-info")
def vendor_info() -> None:
    """Print the simulated vendor device's facts."""
    availability = VendorSimPlatform.availability()
    state = "available" if availability.ok else "unavailable"
    click.echo(f"platform: {VendorSimPlatform.name} ({state}: {availability.reason})")
    click.echo(f"preferred attention backends: {', '.join(VendorSimPlatform.preferred_attention_backends())}")
    for key, value in VendorSimPlatform.describe().items():
        click.echo(f"{key}: {value}")
