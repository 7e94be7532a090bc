"""MkDocs hooks (mkdocs.yml `hooks:`): links from docs pages to sections of README.md that moved into the site.

The README is outside `docs_dir`, so a link such as `../README.md#benchmarks` is a missing page to MkDocs and
fails `mkdocs build --strict`. Each README section the site now holds is pointed at its page; a link to any
other README anchor is left alone, so it still fails the build.
"""

from __future__ import annotations

import posixpath
import re

# the README's former section anchors -> the page (relative to docs/) that holds them now
MOVED = {
    "benchmarks": "benchmarks.md",
    "use-it-from-python": "usage/python.md",
    "models": "models.md",
    "supported-models": "models.md#supported-models",
    "the-command-line": "usage/cli.md",
    "devices-and-attention-backends": "backends.md",
    "speed-settings": "speed.md",
    "batch-invariant-results": "batch-invariant.md",
    "images": "multimodal.md",
    "lora-adapters": "lora.md",
    "structured-output": "structured-output.md",
    "speculative-decoding": "speculative-decoding.md",
    "parallelism": "parallelism.md",
    "plugins": "plugins.md",
    "serve-it-openai-compatible": "serving.md",
    "quantization": "quantization.md",
}

LINK = re.compile(r"\]\((?P<up>(?:\.\./)+)README\.md#(?P<anchor>[\w-]+)\)")


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")

    def repoint(match: re.Match) -> str:
        target = MOVED.get(match["anchor"])
        if target is None or len(match["up"]) != 3 * (depth + 1):
            return match[0]
        return f"]({posixpath.relpath(target, posixpath.dirname(page.file.src_uri) or '.')})"

    return LINK.sub(repoint, markdown)
