"""`pagellm pull / list / ps / rm`: Ollama's model commands over the Hugging Face cache and a running server.

`pull`, `list` and `rm` work on huggingface_hub's cache (pagellm/cli/hub_cache.py), the one `serve` reads;
`ps` asks a running server what it serves: `/v1/models` (each model's `state` where the server reports
one: a multi-model server's "loaded" / "loading" / "unloaded"; a single-model server's model is loaded)
and, for sizes and context lengths, the Ollama-compatible `/api/ps` where the server has it.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

import click

from pagellm.cli import hub_cache


@click.command()
@click.argument("spec", metavar="ORG/NAME[:QUANT]")
@click.option("--revision", default=None, help="Branch, tag or commit to pull (default: main).")
@click.option("--download-dir", default=None, help="Cache folder instead of HF_HUB_CACHE / HF_HOME's.")
def pull(spec: str, revision: str | None, download_dir: str | None) -> None:
    """Download a model from the Hugging Face Hub into its cache, for `serve` / `generate` to find (offline
    too). ORG/NAME fetches config, tokenizer and one weight format; ORG/NAME:QUANT (e.g. :Q4_K_M) the one
    GGUF file of that quantization; ORG/NAME:FILE.gguf that file."""
    path, downloaded = hub_cache.pull(spec, revision=revision, cache_dir=download_dir)
    if downloaded:
        click.echo(f"pulled {spec}: {path}")
    else:
        click.echo(f"{spec} is already in the cache (not checked against the Hub: HF_HUB_OFFLINE): {path}")


@click.command("list")
@click.option("--download-dir", default=None, help="Cache folder instead of HF_HUB_CACHE / HF_HOME's.")
def list_models(download_dir: str | None) -> None:
    """The models in the Hugging Face cache: size on disk, format (safetensors, the GGUF quants cached, ...)
    and when one of its files was last read."""
    models = hub_cache.cached_models(download_dir)
    if not models:
        click.echo(f"no models in the Hugging Face cache ({hub_cache.hub.hub_cache_dir(download_dir)})")
        return
    rows = [
        (m.repo_id, hub_cache.human_size(m.size), m.format, hub_cache.human_age(m.last_used)) for m in models
    ]
    _table(("NAME", "SIZE", "FORMAT", "LAST USED"), rows)


@click.command()
@click.argument("spec", metavar="ORG/NAME[:QUANT]")
@click.option("--yes", "-y", is_flag=True, help="Do not ask; needed where no one can answer (scripts).")
@click.option("--download-dir", default=None, help="Cache folder instead of HF_HUB_CACHE / HF_HOME's.")
def rm(spec: str, yes: bool, download_dir: str | None) -> None:
    """Delete a cached model: ORG/NAME the whole repository (every revision); ORG/NAME:QUANT only that
    quantization's GGUF file(s), keeping the repository's other files."""
    removal = hub_cache.plan_removal(spec, download_dir)
    question = f"delete {removal.description}, freeing {hub_cache.human_size(removal.freed)}?"
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(f"{question} Pass --yes to delete without a prompt")
        click.confirm(question, abort=True)
    removal.apply()
    click.echo(f"deleted {removal.description} ({hub_cache.human_size(removal.freed)} freed)")


@click.command()
@click.option("--url", default="http://localhost:8000", show_default=True, help="The server's base URL.")
@click.option(
    "--api-key",
    envvar="PAGELLM_API_KEY",
    default=None,
    help="The server's key (PAGELLM_API_KEY).",
    show_envvar=True,
)
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
def ps(url: str, api_key: str | None, timeout: float) -> None:
    """The models a running server serves and their state (loaded, loading, unloaded), with size and context
    length where the server reports them."""
    base = url.rstrip("/")
    key = (api_key or "").split()[0] if (api_key or "").split() else None
    models = _get_json(f"{base}/v1/models", key, timeout)
    if models is None:
        raise click.ClickException(
            f"{base}/v1/models: not found; is {base} a pagellm (OpenAI-compatible) server?"
        )
    running = _get_json(f"{base}/api/ps", key, timeout) or {}
    facts = {m.get("name"): m for m in running.get("models", []) if isinstance(m, dict)}
    rows = []
    for card in models.get("data", []):
        name = card.get("id", "?")
        fact = facts.get(name, {})
        size = fact.get("size")
        context = fact.get("context_length") or card.get("max_model_len")
        rows.append(
            (
                name,
                card.get("state", "loaded"),
                hub_cache.human_size(size) if isinstance(size, int) and size > 0 else "-",
                str(context) if context else "-",
            )
        )
    if not rows:
        click.echo(f"{base} serves no models")
        return
    _table(("NAME", "STATE", "SIZE", "CONTEXT"), rows)


def _get_json(url: str, api_key: str | None, timeout: float) -> dict[str, Any] | None:
    """GET `url`'s JSON; None on 404 (an endpoint this server lacks); a ClickException when nothing answers or
    the server refuses."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        hint = " (pass --api-key or set PAGELLM_API_KEY)" if exc.code == 401 else ""
        raise click.ClickException(f"{url}: HTTP {exc.code} {exc.reason}{hint}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise click.ClickException(
            f"no pagellm server answers at {url} ({reason}); start one with `pagellm serve`"
        ) from exc


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("   ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
