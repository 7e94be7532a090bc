"""`pagellm plugins`: what is installed, what can run here, and why not."""

from __future__ import annotations

import click

from pagellm.cli.options import config_from_options, engine_options
from pagellm.core.attention import DEFAULT_BLOCK_SIZE, AttentionSpec
from pagellm.core.dtypes import DTYPES
from pagellm.core.selector import backend_reasons, candidate_spec, platform_availability, select_platform
from pagellm.plugins import API_VERSION, load_plugins


@click.command()
@click.option(
    "--explain",
    "explain_model",
    metavar="MODEL",
    default=None,
    help="Print the start-up decision (device, backend, dtype, quantization) for MODEL without loading weights.",
)
@engine_options(skip=("model",))
def plugins(explain_model: str | None, **options) -> None:
    """List plugins, platforms, attention backends and quantization methods."""
    registry = load_plugins()
    if explain_model is not None:
        from pagellm.engine.setup import resolve_engine

        setup = resolve_engine(config_from_options(options, model=explain_model))
        click.echo("\n".join(setup.explanation))
        return
    click.echo(f"Plugins (entry-point group pagellm.plugins, plugin API {API_VERSION}):")
    for p in registry.plugins:
        state = "loaded" if p.loaded and not p.error else f"not loaded: {p.error}"
        click.echo(f"  {p.name:<20} {p.distribution} {p.version:<10} {state}")
    availability = platform_availability(registry)
    click.echo("Platforms:")
    for name, avail in availability.items():
        cls = registry.platforms[name]
        status = "available" if avail.ok else "unavailable"
        click.echo(
            f"  {name:<10} {status:<12} priority {cls.priority:<4} {avail.reason}  [{registry.owner('platforms', name)}]"
        )
    platform = select_platform(registry, options.get("device")).platform
    spec = _probe_spec(platform, options)
    choose = options.get("block_size") is None
    shapes = spec.shape_key()
    if choose:  # each backend is checked at its own preferred block size, shown on its line
        shapes = shapes.replace(f"-bs{spec.block_size}-", "-bs(preferred)-") + ", no --block-size given"
    click.echo(
        f"Attention backends (on {platform.name}, for {shapes}; preference: "
        f"{', '.join(platform.preferred_attention_backends()) or 'none'}):"
    )
    for name, reasons in backend_reasons(registry, platform, spec, choose).items():
        verdict = "compatible" if not reasons else "incompatible: " + "; ".join(reasons)
        if choose and not reasons:
            backend = registry.attention_backends[name]
            verdict += f" (block size {candidate_spec(backend, spec, choose).block_size})"
        click.echo(f"  {name:<16} {verdict}  [{registry.owner('attention_backends', name)}]")
    click.echo(f"Quantization methods (on {platform.name}):")
    for name, method in sorted(registry.quant_methods.items()):
        reasons = method.unsupported_reasons(platform)
        verdict = "runs here" if not reasons else "not here: " + "; ".join(reasons)
        click.echo(f"  {name:<16} {verdict}  [{registry.owner('quant_methods', name)}]")
    click.echo(f"Models: {', '.join(sorted(registry.models)) or 'none'}")
    click.echo(f"Reasoning parsers: {', '.join(sorted(registry.reasoning_parsers)) or 'none'}")
    click.echo(f"Tool-call parsers: {', '.join(sorted(registry.tool_parsers)) or 'none'}")
    connectors = [
        f"{name} [{registry.owner('kv_connectors', name)}]" for name in sorted(registry.kv_connectors)
    ]
    click.echo(f"KV connectors (--kv-transfer-config): {', '.join(connectors) or 'none'}")


def _probe_spec(platform, options) -> AttentionSpec:
    """A typical spec (SmolLM2's shapes) to report compatibility when no model is named."""
    dtype = DTYPES.get(options.get("dtype") or "", platform.default_dtype)
    return AttentionSpec(
        num_heads=9,
        num_kv_heads=3,
        head_size=64,
        dtype=dtype,
        block_size=options.get("block_size") or DEFAULT_BLOCK_SIZE,
    )
