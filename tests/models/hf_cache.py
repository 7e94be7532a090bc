"""A Hugging Face cache on disk, laid out as huggingface_hub writes it, for tests of models given by id.

`put_in_hf_cache(cache, "org/name", directory)` copies a directory's files in as one commit:

    models--org--name/blobs/<sha256>                    the file's bytes
    models--org--name/snapshots/<commit>/<path>         a relative symlink to its blob
    models--org--name/refs/main                         the commit hash (no newline)

`huggingface_hub.scan_cache_dir`, `try_to_load_from_cache` and `snapshot_download(local_files_only=True)`
read it as a cache `hf download` wrote.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def put_in_hf_cache(
    cache: str | os.PathLike,
    repo_id: str,
    source: str | os.PathLike,
    *,
    commit: str | None = None,
    refs: Iterable[str] = ("main",),
    files: Iterable[str] | None = None,
) -> Path:
    """Write `source`'s files (or only `files`, paths relative to it) as commit `commit` (default: a hash of
    their contents) of model `repo_id`, pointed at by each of `refs`; returns the snapshot folder."""
    source = Path(source)
    names = (
        sorted(files)
        if files is not None
        else sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    )
    digests = {name: hashlib.sha256((source / name).read_bytes()).hexdigest() for name in names}
    if commit is None:
        commit = hashlib.sha1("".join(f"{n}:{d}" for n, d in digests.items()).encode()).hexdigest()
    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, digest in digests.items():
        blob = storage / "blobs" / digest
        if not blob.exists():
            blob.write_bytes((source / name).read_bytes())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot
