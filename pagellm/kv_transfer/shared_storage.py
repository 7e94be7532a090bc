"""`shared_storage`: the KV of each full prompt block saved as one safetensors file, named by the block's
prefix digest, in a directory (`kv_connector_extra_config.shared_storage_path`), and loaded from there.

Two engines sharing the directory (a tmpfs, a network file system) are a prefill and a decode engine; one
engine with kv_both keeps a KV cache that survives restarts. A key chains the block's tokens, the LoRA
adapter and the engine's namespace (model, dtypes, KV layout), so a file never loads into another model's
cache. Files are written under a temporary name and renamed, so a reader sees a whole file or none; a
missing or corrupt one ends the load at that block and the rest is recomputed. Nothing is evicted: delete
the directory to clear it.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from safetensors.torch import load_file, save_file

from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import ConnectorRequest, KVConnector, KVConnectorContext, block_digests
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.2"

logger = logging.getLogger("pagellm")


@dataclass
class StorageMeta:
    """One step's work for the worker: files to load into blocks, blocks to save into files."""

    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # request id -> (block, file)
    saves: list[tuple[int, str]] = field(default_factory=list)  # (block, file)


class SharedStorageConnector(KVConnector):
    name = "shared_storage"

    @classmethod
    def check_config(cls, config: Any) -> None:
        if not config.kv_connector_extra_config.get("shared_storage_path"):
            raise ConfigError(
                'kv_transfer_config: shared_storage needs kv_connector_extra_config {"shared_storage_path": DIR}'
            )

    def __init__(self, config: Any, role: Any, context: KVConnectorContext):
        super().__init__(config, role, context)
        self.directory = os.path.join(
            config.kv_connector_extra_config["shared_storage_path"], context.namespace
        )
        os.makedirs(self.directory, exist_ok=True)
        self._digests: dict[str, list[str]] = {}  # scheduler: request id -> its prompt's block digests
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._received: set[str] = set()  # worker
        self._invalid: set[int] = set()
        self.bytes_loaded = self.bytes_saved = 0

    def _path(self, digest: str) -> str:
        return os.path.join(self.directory, digest + ".safetensors")

    def _prompt_digests(self, request: ConnectorRequest) -> list[str]:
        digests = self._digests.get(request.request_id)
        if digests is None:
            num_blocks = request.num_prompt_tokens // self.block_size
            digests = block_digests(
                request.prompt_token_ids,
                self.block_size,
                num_blocks,
                request.cache_salt,
                self.context.namespace,
            )
            self._digests[request.request_id] = digests
        return digests

    # -- scheduler ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        if not self.config.is_consumer:
            return 0
        digests = self._prompt_digests(request)
        first = end = num_computed_tokens // self.block_size
        while end < len(digests) and os.path.exists(self._path(digests[end])):
            end += 1
        return (end - first) * self.block_size

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        digests = self._prompt_digests(request)
        self._loads[request.request_id] = [
            (block_ids[i], self._path(digests[i]))
            for i in range(first, first + num_external_tokens // self.block_size)
        ]

    def build_connector_meta(self, scheduler_output: Any) -> StorageMeta:
        """The pending loads, and every prompt block this step completes that has no file yet."""
        meta = StorageMeta(self._loads)
        self._loads = {}
        if not self.config.is_producer:
            return meta
        planned = set()
        for request in scheduler_output.scheduled:
            rid = request.request_id
            start = request.num_computed_tokens
            end = min(start + scheduler_output.num_scheduled_tokens[rid], request.num_prompt_tokens)
            digests, table = self._prompt_digests(request), scheduler_output.block_ids[rid]
            for i in range(start // self.block_size, end // self.block_size):
                path = self._path(digests[i])
                if path not in planned and not os.path.exists(path):
                    planned.add(path)
                    meta.saves.append((table[i], path))
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, None]:
        self._digests.pop(request.request_id, None)
        return False, None

    # -- worker ---------------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        """Read the step's files into their blocks; a block that fails ends its request's load there."""
        for request_id, items in self.metadata.loads.items():
            for k, (block_id, path) in enumerate(items):
                try:
                    tensors = load_file(path)
                    for layer in range(self.blocks.num_layers):
                        self.blocks.write(layer, [block_id], tensors[f"layer.{layer}"])
                        self.bytes_loaded += tensors[f"layer.{layer}"].nbytes
                except Exception as exc:  # missing, truncated, corrupt, another layout
                    logger.warning(
                        "KV file %s did not load (%s: %s); recomputing", path, type(exc).__name__, exc
                    )
                    self._invalid.update(block for block, _ in items[k:])
                    break
            self._received.add(request_id)

    def wait_for_save(self) -> None:
        for block_id, path in self.metadata.saves:
            tensors = {
                f"layer.{layer}": self.blocks.read(layer, [block_id]).cpu()
                for layer in range(self.blocks.num_layers)
            }
            temporary = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
            try:
                save_file(tensors, temporary)
                os.replace(temporary, path)  # readers see the whole file or none
                self.bytes_saved += sum(t.nbytes for t in tensors.values())
            except OSError as exc:  # a full disk costs later recomputes, not this step
                logger.warning("could not save KV file %s: %s", path, exc)
                if os.path.exists(temporary):
                    os.remove(temporary)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        received, self._received = self._received, set()
        return set(), received

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


@hookimpl
def pagellm_kv_connectors():
    return [SharedStorageConnector]
