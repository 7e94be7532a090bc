"""The Hugging Face cache as `pagellm pull / list / rm` see it, through huggingface_hub's own functions.

Models are huggingface_hub's cache entries (`models--ORG--NAME/...`, HF_HUB_CACHE / HF_HOME), the same that
`pagellm serve ORG/NAME[:QUANT]` resolves (pagellm/models/hub.py), so whatever `pull` fetched is what a
later `serve` (offline too) finds, and what `hf download` fetched is listed here.

- pull: one listing of the repository (`HfApi.model_info`, bounded by HF_HUB_ETAG_TIMEOUT), then the files
  `serve` would read (config, tokenizer, one weight format; or the one GGUF file of the quant asked for)
  through `snapshot_download`, with the hub's own progress bars. Offline (HF_HUB_OFFLINE) or with the Hub
  out of reach it fails at once with the reason, unless the files asked for are already cached (offline).
- list: `scan_cache_dir`, one row per model repository: size on disk, format, last use.
- rm ORG/NAME: the whole repository, by the hub's `delete_revisions` strategy. rm ORG/NAME:QUANT: only
  that quant's GGUF file(s) in every cached revision and the blobs no other file links to (the hub has no
  per-file delete); when they are all the repository holds, the repository goes whole as above.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.core.errors import ConfigError
from pagellm.core.progress import progress_enabled
from pagellm.models import hub

# a GGUF file's quantization tag: the last -, . or _ separated part of its name (before a split suffix),
# llama.cpp's types (Q4_K_M, IQ2_XXS, Q8_0, TQ1_0, MXFP4) and the float ones
_QUANT = re.compile(
    r"[-._]((?:I|T)?Q\d(?:_[A-Z0-9]+)*|MXFP4(?:_MOE)?|BF16|F16|F32|FP16|FP32)(?:-\d{5}-of-\d{5})?\.gguf$",
    re.IGNORECASE,
)


def quant_of(filename: str) -> str | None:
    """The quantization tag a GGUF file's name ends in (`model-Q4_K_M.gguf` -> `Q4_K_M`), upper case."""
    match = _QUANT.search(filename.rsplit("/", 1)[-1])
    return match.group(1).upper() if match else None


def quants(files: Iterable[str]) -> list[str]:
    """The quantization tags of the GGUF files among `files`, sorted, each once."""
    return sorted({q for f in files if f.endswith(".gguf") and (q := quant_of(f)) is not None})


def model_format(files: Iterable[str]) -> str:
    """What the files are, as `list` shows it: safetensors, `GGUF Q4_K_M, Q8_0`, pytorch .bin, or other."""
    files = list(files)
    if any(f.endswith(".safetensors") for f in files):
        return "safetensors"
    ggufs = [f for f in files if f.endswith(".gguf")]
    if ggufs:
        tags = quants(ggufs)
        return "GGUF " + ", ".join(tags) if tags else "GGUF"
    if any(f.endswith(".bin") for f in files):
        return "pytorch .bin"
    return "other"


def parse_spec(spec: str) -> hub.ModelId:
    """`ORG/NAME`, `ORG/NAME:QUANT` or `ORG/NAME:FILE.gguf`, else a ConfigError saying the spelling."""
    model_id = hub.parse_model_id(spec)
    if model_id is None:
        raise ConfigError(
            f"{spec!r} is not a Hugging Face model id: ORG/NAME, ORG/NAME:QUANT or ORG/NAME:FILE.gguf"
        )
    return model_id


def _endpoint() -> str | None:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


# -- list ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedModel:
    """One model repository in the cache, as `pagellm list` shows it."""

    repo_id: str
    size: int
    format: str
    last_used: float
    """Seconds since the epoch: the latest access of any of its files (huggingface_hub's last_accessed)."""
    path: Path


def cached_models(cache_dir: str | None = None) -> list[CachedModel]:
    """Every model repository in the cache (`scan_cache_dir`), by name; [] where the cache does not exist."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub.hub_cache_dir(cache_dir))
    except CacheNotFound:
        return []
    models = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        files = {_relative(f.file_path, rev.snapshot_path) for rev in repo.revisions for f in rev.files}
        models.append(
            CachedModel(
                repo.repo_id, repo.size_on_disk, model_format(files), repo.last_accessed, repo.repo_path
            )
        )
    return sorted(models, key=lambda m: m.repo_id.lower())


def _relative(path: Path, snapshot: Path) -> str:
    return path.relative_to(snapshot).as_posix()


def human_size(size: float) -> str:
    """Bytes as `list` prints them: 1.2 GB, 512 MB (decimal units, as Ollama and the Hub show sizes)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def human_age(when: float, now: float | None = None) -> str:
    """How long ago `when` was: `just now`, `5 minutes ago`, `3 days ago`."""
    seconds = max(0.0, (time.time() if now is None else now) - when)
    for unit, length in (("year", 31536000), ("month", 2592000), ("week", 604800), ("day", 86400),
                         ("hour", 3600), ("minute", 60)):  # fmt: skip
        if seconds >= length:
            count = int(seconds // length)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


# -- rm --------------------------------------------------------------------------------------------------


@dataclass
class Removal:
    """What `rm` deletes: the files (or the repository) and the bytes it frees; `apply()` does it."""

    description: str
    freed: int
    paths: list[Path]
    strategy: Any = None  # huggingface_hub's DeleteCacheStrategy, for a whole repository

    def apply(self) -> None:
        """Delete: the hub's strategy for a repository, else the snapshot links and then their blobs."""
        if self.strategy is not None:
            self.strategy.execute()
            return
        for path in self.paths:
            path.unlink(missing_ok=True)


def plan_removal(spec: str, cache_dir: str | None = None) -> Removal:
    """What `pagellm rm SPEC` would delete; ConfigError where SPEC is not cached (or names no cached file)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    model_id = parse_spec(spec)
    cache = hub.hub_cache_dir(cache_dir)
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        info = None
    repo = next(
        (r for r in (info.repos if info else ()) if r.repo_type == "model" and r.repo_id == model_id.repo_id),
        None,
    )
    if repo is None:
        raise ConfigError(
            f"{model_id.repo_id} is not in the Hugging Face cache ({cache}); `pagellm list` shows what is"
        )
    whole = info.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
    everything = Removal(f"{repo.repo_id} ({repo.repo_path})", repo.size_on_disk, [repo.repo_path], whole)
    if model_id.gguf is None:
        return everything
    return _plan_file_removal(repo, model_id.gguf, everything)


def _plan_file_removal(repo: Any, spec: str, everything: Removal) -> Removal:
    """The GGUF file(s) of quant (or file name) `spec` in every revision of `repo`, and their blobs that no
    other file of the repository links to; `everything` where nothing else would be left."""
    chosen, kept = [], []
    for rev in repo.revisions:
        for f in rev.files:
            name = _relative(f.file_path, rev.snapshot_path)
            matches = name.endswith(".gguf") and (
                name == spec or name.rsplit("/", 1)[-1] == spec or (quant_of(name) or "") == spec.upper()
            )
            (chosen if matches else kept).append(f)
    if not chosen:
        names = sorted({_relative(f.file_path, r.snapshot_path) for r in repo.revisions for f in r.files})
        available = quants(names)
        raise ConfigError(
            f"{repo.repo_id} has no cached GGUF file for {spec!r}; cached quants: "
            f"{', '.join(available) or 'none'} (`pagellm rm {repo.repo_id}` removes the whole repository)"
        )
    if not kept:
        return everything
    kept_blobs = {f.blob_path for f in kept}
    blobs = {f.blob_path: f.size_on_disk for f in chosen if f.blob_path not in kept_blobs}
    paths = [f.file_path for f in chosen] + list(blobs)
    names = sorted({f.file_name for f in chosen})
    return Removal(f"{', '.join(names)} of {repo.repo_id}", sum(blobs.values()), paths)


# -- pull ------------------------------------------------------------------------------------------------


def pull(spec: str, *, revision: str | None = None, cache_dir: str | None = None) -> tuple[str, bool]:
    """Download what `serve SPEC` reads into the cache; (local path, whether it was downloaded now). Offline,
    the cached path where it is all there (False), else a ConfigError at once with the reason."""
    model_id = parse_spec(spec)
    cache = hub.hub_cache_dir(cache_dir)
    if hub.is_offline():
        return _cached_path(model_id, revision, cache, spec), False
    api_files = _listing(model_id.repo_id, revision, spec)
    wanted = _wanted_files(model_id, revision, cache, api_files, spec)
    return _download(model_id, revision, cache, wanted), True


def _cached_path(model_id: hub.ModelId, revision: str | None, cache: str, spec: str) -> str:
    """Offline: the cached file or snapshot `serve` would use, or why there is none (one sentence)."""
    why = "offline mode (HF_HUB_OFFLINE=1 is set), so nothing is downloaded"
    if hub.cached_snapshot(cache, model_id.repo_id, revision) is None:
        raise ConfigError(
            f"cannot pull {spec}: {why}, and it is not in the Hugging Face cache (revision "
            f"{revision or hub.DEFAULT_REVISION}; looked in {hub.repo_folder(cache, model_id.repo_id)}). "
            "Pull it where the Hub can be reached, without HF_HUB_OFFLINE"
        )
    try:
        if model_id.gguf:
            return hub.gguf_path(
                model_id.repo_id, model_id.gguf, revision=revision, cache_dir=cache, option="pull"
            )
        return hub.model_snapshot(model_id.repo_id, revision=revision, cache_dir=cache, option="pull")
    except ConfigError as exc:  # cached, but not what was asked for, or not all of it
        raise ConfigError(f"cannot pull {spec}: {why}; {exc}") from None


def _listing(repo_id: str, revision: str | None, spec: str) -> list[str]:
    """The repository's files, from one `model_info` call that the Hub has HF_HUB_ETAG_TIMEOUT to answer."""
    from huggingface_hub import HfApi

    timeout = hub.hub_timeout()
    api = HfApi(endpoint=_endpoint())
    try:
        info = hub.bounded_call(
            lambda: api.model_info(repo_id, revision=revision, timeout=timeout), timeout + 1
        )
    except Exception as exc:  # unreachable, timed out, unknown or gated repository, unknown revision
        raise ConfigError(f"cannot pull {spec}: {hub.hub_error(exc)}") from exc
    return [s.rfilename for s in info.siblings or ()]


def _wanted_files(
    model_id: hub.ModelId, revision: str | None, cache: str, files: list[str], spec: str
) -> list[str]:
    what = f"pull {spec}"
    if model_id.gguf:
        try:
            return [hub.select_gguf(files, model_id.gguf, what)]
        except ConfigError as exc:
            available = quants(files)
            if not available:
                raise
            raise ConfigError(
                f"{exc}. Quants in {model_id.repo_id}: {', '.join(available)} "
                f"(e.g. `pagellm pull {model_id.repo_id}:{available[0]}`)"
            ) from None
    available = quants(files)
    if available and not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise ConfigError(
            f"{what}: {model_id.repo_id} is a GGUF repository; name one quant: ORG/NAME:QUANT, one of "
            f"{', '.join(available)} (e.g. `pagellm pull {model_id.repo_id}:{available[0]}`)"
        )

    def read_index(name: str) -> dict[str, Any]:
        import json

        from huggingface_hub import hf_hub_download

        path = hf_hub_download(
            model_id.repo_id, name, revision=revision, cache_dir=cache, endpoint=_endpoint(),
            etag_timeout=hub.hub_timeout(),
        )  # fmt: skip
        with open(path) as f:
            return json.load(f)

    return hub.select_model_files(files, read_index, what)


def _download(model_id: hub.ModelId, revision: str | None, cache: str, wanted: list[str]) -> str:
    """`snapshot_download` of exactly `wanted`, with the hub's bars where stderr is a terminal; the path of
    the GGUF file, or of the snapshot folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    patterns = [re.sub(r"([*?\[])", r"[\1]", name) for name in wanted]  # exact names, globs escaped
    quiet = not progress_enabled(sys.stderr) and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        with hub.download_lock(cache, model_id.repo_id):
            folder = snapshot_download(
                model_id.repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                endpoint=_endpoint(), etag_timeout=hub.hub_timeout(),
            )  # fmt: skip
    except Exception as exc:  # cut off, gated, disk full: one line saying which
        raise ConfigError(f"cannot pull {model_id.repo_id}: {hub.hub_error(exc)}") from exc
    finally:
        if quiet:
            enable_progress_bars()
    return os.path.join(folder, wanted[0]) if model_id.gguf else folder
