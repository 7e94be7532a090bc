"""`pagellm proxy --prefill URL --decode URL --port N`: disaggregated prefill and decode behind one
OpenAI-compatible address (see pagellm/kv_transfer/proxy.py and docs/serving.md)."""

from __future__ import annotations

import logging

import click

from pagellm.cli.options import bind, listen_options

logger = logging.getLogger("pagellm")


@click.command()
@click.option(
    "--prefill",
    "prefill_urls",
    multiple=True,
    required=True,
    help="Base URL of a prefill engine (`pagellm serve` with a kv_producer --kv-transfer-config); repeatable.",
)
@click.option(
    "--decode",
    "decode_urls",
    multiple=True,
    required=True,
    help="Base URL of a decode engine (`pagellm serve` with a kv_consumer --kv-transfer-config); repeatable.",
)
@listen_options
@click.option(
    "--timeout", default=600.0, show_default=True, type=float, help="Seconds an engine may take to answer."
)
def proxy(
    prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], host: str, port: int, timeout: float
) -> None:
    """Send each /v1/completions and /v1/chat/completions request to a prefill engine for its prompt's KV
    (max_tokens 1), then to a decode engine with the kv_transfer_params it returned, and answer with the
    decode engine's reply (streamed when asked). A failed prefill engine means the decode engine computes
    the prompt itself."""
    import uvicorn

    from pagellm.kv_transfer.proxy import build_proxy_app

    with bind(host, port) as sock:
        app = build_proxy_app(list(prefill_urls), list(decode_urls), timeout)
        logger.info("proxying on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
        level = logging.getLogger("pagellm").getEffectiveLevel()
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level)).run(sockets=[sock])
