"""Models named by Hugging Face id: `ORG/NAME` resolved to a snapshot directory in the Hugging Face cache.

The cache is huggingface_hub's own (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
`--download-dir` overrides it): `models--ORG--NAME/snapshots/<commit>/...`, `refs/<branch>`, blobs, exactly as
`hf download` writes it, so a model downloaded by either is found by both.

- Offline (`HF_HUB_OFFLINE=1`): the cached snapshot of the revision is used with no network call; a missing
  one is a ConfigError at once, naming the id, the folder searched and how to download it.
- Online: one listing of the repository's files, bounded by `HF_HUB_ETAG_TIMEOUT` (10 s), chooses what to
  download: config, tokenizer and generation-config files and ONE weight format (safetensors, else
  pytorch_model*.bin; with an index json only the files it names). `snapshot_download` fetches those under a
  lock per repository, so two processes starting on the same model download it once. When the Hub cannot be
  reached, the cached snapshot is used with a warning.

GGUF repositories hold many files of one model; one is chosen: `ORG/NAME:FILE.gguf`, `ORG/NAME/FILE.gguf`,
`ORG/NAME` plus `--gguf-file FILE.gguf`, or `ORG/NAME:QUANT` (vLLM's spelling: the one file whose name ends
in `-QUANT.gguf` or `.QUANT.gguf`, e.g. `:Q4_K_M`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pagellm.core.errors import ConfigError

logger = logging.getLogger("pagellm")

DEFAULT_REVISION = "main"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<spec>[^/:]+)|/(?P<file>[^/:]+\.gguf))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# what a model or a tokenizer needs besides weights: config.json, generation_config.json, tokenizer files
# (tokenizer.json, tokenizer_config.json, vocab/merges, sentencepiece, tiktoken, chat templates), the
# weight index, sentence-transformers' modules.json
_SMALL = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
# (index json, single file, glob) per weight format, in order of preference; the names pagellm's loader reads
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"),
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class ModelId:
    """`ORG/NAME`, and for a GGUF repository the file: a name ending in .gguf, or a quantization type."""

    repo_id: str
    gguf: str | None = None


def parse_model_id(name: str) -> ModelId | None:
    """The id `name` spells (ORG/NAME, ORG/NAME:FILE.gguf, ORG/NAME:QUANT, ORG/NAME/FILE.gguf), else None.
    Callers check for a local path of the same spelling first: a local directory or file wins."""
    match = _ID.match(name)
    if match is None:
        return None
    return ModelId(match["repo"], match["spec"] or match["file"])


def hub_cache_dir(download_dir: str | None = None) -> str:
    """`download_dir`, else the Hugging Face cache huggingface_hub uses, read from the environment now (so a
    test or a launcher that sets HF_HOME after import is obeyed)."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    hub = (
        os.environ.get("HF_HUB_CACHE")
        or os.environ.get("HUGGINGFACE_HUB_CACHE")
        or os.path.join(os.path.expanduser(home), "hub")
    )
    return os.path.abspath(os.path.expandvars(os.path.expanduser(hub)))


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; huggingface_hub's reading at import otherwise."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is not None:
        return value.strip().upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_timeout() -> float:
    """Seconds the Hub has to answer a metadata request at start-up (HF_HUB_ETAG_TIMEOUT, default 10)."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    except ValueError:
        return 10.0


def repo_folder(cache_dir: str, repo_id: str) -> str:
    return os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))


# -- what to download -----------------------------------------------------------------------------------


def select_model_files(
    files: Iterable[str], read_index: Callable[[str], dict[str, Any]], what: str
) -> list[str]:
    """The files of a model repository to download: the small files and one weight format.

    `read_index(name)` returns a weight index json's content (it is read only when the repository has one);
    `what` names the model in errors ("--model ORG/NAME")."""
    files = set(files)
    weights = weight_files(files, read_index, what)
    if not weights:
        raise ConfigError(f"{what}: {_no_weights(files)}")
    if "config.json" not in files:
        raise ConfigError(
            f"{what}: the repository has no config.json (pagellm reads the Hugging Face layout)"
        )
    missing = sorted(set(weights) - files)
    if missing:
        raise ConfigError(
            f"{what}: its weight index names files the repository does not have: {', '.join(missing)}"
        )
    return sorted(set(small_files(files)) | set(weights))


def small_files(files: Iterable[str]) -> list[str]:
    """Config and tokenizer files: top level, plus sentence-transformers module folders' config.json."""
    return sorted(
        f
        for f in files
        if ("/" not in f and any(fnmatch.fnmatchcase(f, p) for p in _SMALL))
        or (f.count("/") == 1 and f.endswith("/config.json"))
    )


def weight_files(files: Iterable[str], read_index: Callable[[str], dict[str, Any]], what: str) -> list[str]:
    """One weight format's files among `files` (top level): safetensors first, then pytorch_model*.bin; with
    an index json, the files its weight_map names; without one, `model.safetensors` (or `pytorch_model.bin`)
    alone when present, else every file of that format. [] when there are none."""
    top = sorted(f for f in files if "/" not in f)
    for index, single, pattern in _WEIGHT_FORMATS:
        if index in top:
            try:
                weight_map = read_index(index)["weight_map"]
            except (KeyError, TypeError, ValueError, OSError) as exc:
                raise ConfigError(f"{what}: cannot read {index}: {exc}") from exc
            return sorted(set(weight_map.values()))
        if single in top:
            return [single]
        matched = [f for f in top if fnmatch.fnmatchcase(f, pattern)]
        if matched:
            return matched
    return []


def _no_weights(files: set[str]) -> str:
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ggufs:
        return (
            "a GGUF repository: choose a file with ORG/NAME:FILE.gguf (or --gguf-file FILE.gguf); it has "
            + _listing(ggufs)
        )
    others = sorted(f for f in files if f.endswith((".pt", ".pth", ".bin", ".safetensors")))
    if others:
        return f"no safetensors or pytorch_model*.bin weights at its top level (pagellm reads no others); it has {_listing(others)}"
    return "no weights (*.safetensors or pytorch_model*.bin)"


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def select_gguf(files: Iterable[str], spec: str, what: str) -> str:
    """The one GGUF file `spec` names: a file name ending in .gguf (at the top or in a folder), or a
    quantization type (Q4_K_M: the file whose name ends in -Q4_K_M.gguf, .Q4_K_M.gguf or _Q4_K_M.gguf, any
    case). ConfigError with the repository's GGUF files when none or several match."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if spec.endswith(".gguf"):
        matched = [f for f in ggufs if f == spec] or [f for f in ggufs if f.rsplit("/", 1)[-1] == spec]
    else:
        suffixes = tuple(f"{sep}{spec}.gguf".lower() for sep in "-._")
        matched = [f for f in ggufs if f.lower().endswith(suffixes)]
    if len(matched) == 1:
        return matched[0]
    has = f"it has {_listing(ggufs)}" if ggufs else "it has no .gguf files"
    if not matched:
        raise ConfigError(f"{what}: no GGUF file matches {spec!r}; {has}")
    raise ConfigError(
        f"{what}: {spec!r} matches several GGUF files ({_listing(matched)}; split files are not supported); "
        "name one with ORG/NAME:FILE.gguf"
    )


def _read_json(folder: str) -> Callable[[str], dict[str, Any]]:
    def read(name: str) -> dict[str, Any]:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)

    return read


def _local_files(folder: str) -> list[str]:
    """Every file under `folder` (symlinks to blobs followed), as repository paths ("a/b.json")."""
    found = []
    for root, _, names in os.walk(folder, followlinks=True):
        rel = os.path.relpath(root, folder)
        for name in names:
            if os.path.exists(os.path.join(root, name)):  # a broken link is a missing file
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


# -- the three kinds of resolution ------------------------------------------------------------------------


def model_snapshot(
    repo_id: str, *, revision: str | None = None, cache_dir: str | None = None, option: str = "--model"
) -> str:
    """The local snapshot directory of model `repo_id` (config, tokenizer and weights), downloaded when
    missing and allowed. ConfigError when it cannot be had."""
    what = f"{option} {repo_id}"

    def select(files: list[str], read_index: Callable[[str], dict[str, Any]]) -> list[str]:
        return select_model_files(files, read_index, what)

    def check(folder: str) -> str:
        present = _local_files(folder)
        if "config.json" not in present:
            raise ConfigError(
                f"{what}: the snapshot in {folder} has no config.json ({_no_weights(set(present))})"
                if any(f.endswith(".gguf") for f in present)
                else f"{what}: the snapshot in {folder} has no config.json; {_redownload(repo_id, revision)}"
            )
        weights = weight_files(present, _read_json(folder), what)
        if not weights:
            raise ConfigError(f"{what}: the snapshot in {folder} has {_no_weights(set(present))}")
        missing = sorted(set(weights) - set(present))
        if missing:
            raise ConfigError(
                f"{what}: the cached snapshot in {folder} is incomplete (missing {_listing(missing)}); "
                f"{_redownload(repo_id, revision)}"
            )
        return folder

    return _resolve(repo_id, revision, cache_dir, what, select, check)


def tokenizer_snapshot(
    repo_id: str, *, revision: str | None = None, cache_dir: str | None = None, option: str = "--tokenizer"
) -> str:
    """The local snapshot directory of `repo_id`'s tokenizer files (no weights are downloaded)."""
    what = f"{option} {repo_id}"

    def select(files: list[str], read_index: Callable[[str], dict[str, Any]]) -> list[str]:
        wanted = small_files(files)
        if not any(f in _TOKENIZER_FILES for f in wanted):
            raise ConfigError(
                f"{what}: the repository has no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
            )
        return wanted

    def check(folder: str) -> str:
        if not any(os.path.exists(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
            raise ConfigError(
                f"{what}: the cached snapshot in {folder} has no tokenizer files; {_redownload(repo_id, revision)}"
            )
        return folder

    return _resolve(repo_id, revision, cache_dir, what, select, check)


def gguf_path(
    repo_id: str,
    spec: str,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    option: str = "--model",
) -> str:
    """The local path of the GGUF file `spec` (FILE.gguf or a quantization type) of `repo_id`."""
    what = f"{option} {repo_id}"

    def select(files: list[str], read_index: Callable[[str], dict[str, Any]]) -> list[str]:
        return [select_gguf(files, spec, what)]

    def check(folder: str) -> str:
        try:
            name = select_gguf(_local_files(folder), spec, what)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (in the cached snapshot {folder}); {_redownload(repo_id, revision)}"
            ) from None
        return os.path.join(folder, name)

    return _resolve(repo_id, revision, cache_dir, what, select, check)


# -- cache first or Hub first ----------------------------------------------------------------------------


def cached_snapshot(cache_dir: str, repo_id: str, revision: str | None) -> str | None:
    """The snapshot folder of `revision` (a branch, tag or full commit hash) in the cache, or None: the
    commit a ref names (refs/<revision>), as huggingface_hub resolves it without a network call."""
    storage = repo_folder(cache_dir, repo_id)
    revision = revision or DEFAULT_REVISION
    commit = revision if _COMMIT.match(revision) else None
    if commit is None:
        try:
            with open(os.path.join(storage, "refs", revision)) as f:
                commit = f.read().strip()
        except OSError:
            return None
    folder = os.path.join(storage, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def _resolve(
    repo_id: str,
    revision: str | None,
    cache_dir: str | None,
    what: str,
    select: Callable[[list[str], Callable[[str], dict[str, Any]]], list[str]],
    check: Callable[[str], str],
) -> str:
    cache = cache_dir or hub_cache_dir()
    if is_offline():
        return check(
            _cached_or_fail(cache, repo_id, revision, what, "HF_HUB_OFFLINE is set, so nothing is downloaded")
        )
    try:
        files = bounded_call(lambda: _list_repo_files(repo_id, revision), hub_timeout())
        with download_lock(cache, repo_id):
            wanted = select(files, lambda name: _read_remote_json(repo_id, name, revision, cache))
            folder = _download(repo_id, revision, cache, wanted)
    except ConfigError:
        raise
    except Exception as exc:  # unreachable, timed out, unknown or gated repository, unknown revision, cut off
        reason = hub_error(exc)
        folder = cached_snapshot(cache, repo_id, revision)
        if folder is None:
            raise ConfigError(
                f"{what}: {reason}, and it is not in the Hugging Face cache either "
                f"(revision {revision or DEFAULT_REVISION}; looked in {repo_folder(cache, repo_id)}). "
                f"{_how_to_download(repo_id, revision)}"
            ) from exc
        logger.warning("%s: %s; using the cached snapshot %s", what, reason, folder)
    return check(folder)


def _cached_or_fail(cache: str, repo_id: str, revision: str | None, what: str, why: str) -> str:
    folder = cached_snapshot(cache, repo_id, revision)
    if folder is None:
        raise ConfigError(
            f"{what}: not a local directory, and not in the Hugging Face cache (revision "
            f"{revision or DEFAULT_REVISION}; looked in {repo_folder(cache, repo_id)}); {why}. "
            f"{_how_to_download(repo_id, revision)}, or unset HF_HUB_OFFLINE to let pagellm download it"
        )
    return folder


def _how_to_download(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (
        f"Download it with `hf download {repo_id}{rev}` (older huggingface_hub: `huggingface-cli download "
        f"{repo_id}{rev}`) into the same cache (HF_HUB_CACHE / HF_HOME, or pass --download-dir)"
    )


def _redownload(repo_id: str, revision: str | None) -> str:
    return _how_to_download(repo_id, revision).replace("Download it", "download it again", 1)


def hub_error(exc: BaseException) -> str:
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return "the repository is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "the Hugging Face Hub has no such revision"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repository on the Hugging Face Hub (a private one needs `hf auth login` or HF_TOKEN)"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in name for word in ("Connect", "Timeout", "Network", "Proxy", "Offline")
    ):
        return f"the Hugging Face Hub could not be reached ({name}: {first_line})"
    return f"fetching it from the Hugging Face Hub failed ({name}: {first_line})"


def bounded_call(call: Callable[[], Any], timeout: float) -> Any:
    """`call()` on a daemon thread, given `timeout` seconds: huggingface_hub's client has no timeout of its
    own for metadata requests and retries a refused connection for ~25 s, so start-up bounds the wait here."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="pagellm-hub", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout:g} s (HF_HUB_ETAG_TIMEOUT)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _list_repo_files(repo_id: str, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi

    return list(HfApi().list_repo_files(repo_id, revision=revision))


def _read_remote_json(repo_id: str, name: str, revision: str | None, cache: str) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(repo_id, name, revision=revision, cache_dir=cache, etag_timeout=hub_timeout())
    with open(path) as f:
        return json.load(f)


def _download(repo_id: str, revision: str | None, cache: str, wanted: list[str]) -> str:
    from huggingface_hub import snapshot_download

    logger.info("%s: fetching %d files into %s: %s", repo_id, len(wanted), cache, _listing(wanted))
    # exact names as allow_patterns: glob characters in a file name would widen them, so escape those
    patterns = [re.sub(r"([*?\[])", r"[\1]", name) for name in wanted]
    return snapshot_download(
        repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns, etag_timeout=hub_timeout()
    )


class download_lock:
    """A file lock per repository in the cache (`.locks/models--ORG--NAME/pagellm.lock`), held while one
    process downloads, so a second waits and then finds the files there. huggingface_hub locks each file;
    this keeps two processes from each listing, choosing and fetching a whole model at once."""

    def __init__(self, cache: str, repo_id: str):
        from filelock import FileLock

        folder = os.path.join(cache, ".locks", os.path.basename(repo_folder(cache, repo_id)))
        os.makedirs(folder, exist_ok=True)
        self.repo_id = repo_id
        self.lock = FileLock(os.path.join(folder, "pagellm.lock"))

    def __enter__(self) -> download_lock:
        from filelock import Timeout

        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            logger.info("%s: another process is downloading it; waiting", self.repo_id)
            self.lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()
