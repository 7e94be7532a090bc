"""The model runner's KV connector part (`--kv-transfer-config`): the connector's worker half over the
runner's KV caches. Loads start before a step's forward, into blocks no request of the step reads; after
it the step's saves finish and the connector reports the transfers that ended."""

from __future__ import annotations

import os
import uuid

import torch

from pagellm.core.kv_connector import (
    KVCacheBlocks,
    KVConnector,
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    kv_block_dim,
    kv_namespace,
)
from pagellm.distributed import Group
from pagellm.worker.kv_cache import kv_cache_shape, rank_spec
from pagellm.worker.step import EngineSetup, SchedulerOutput


class RunnerKVConnector:
    def __init__(self, setup: EngineSetup, tp: Group, kv_caches: list[torch.Tensor], block_size: int):
        """The connector's namespace names the model and the KV layout, so KV saved by another model or
        layout is never loaded here."""
        transfer = setup.config.kv_transfer
        spec = rank_spec(setup, tp)
        block_dim = kv_block_dim(
            setup.backend.kv_cache_shape, block_size, spec.num_kv_heads, spec.cache_row_size
        )
        namespace = kv_namespace(
            os.path.realpath(setup.source.directory),
            setup.source.gguf_file,
            str(setup.dtype),
            str(spec.cache_dtype),
            block_size,
            kv_cache_shape(setup, tp, 1, block_size),
            len(kv_caches),
            setup.quant_method.name if setup.quant_method else None,
        )
        self.context = KVConnectorContext(block_size, namespace, transfer.engine_id or uuid.uuid4().hex[:12])
        self.connector: KVConnector = setup.registry.kv_connectors[transfer.kv_connector](
            transfer, KVConnectorRole.WORKER, self.context
        )
        self.connector.register_kv_caches(KVCacheBlocks(kv_caches, block_dim))

    def start_loads(self, out: SchedulerOutput) -> None:
        """Before the forward: start the step's loads (into blocks no request of this step reads)."""
        if out.kv_connector_metadata is not None:
            self.connector.bind_connector_metadata(out.kv_connector_metadata)
            self.connector.start_load_kv()

    def finish_step(self, out: SchedulerOutput) -> KVConnectorOutput | None:
        """After the forward: the connector saves what the step computed, then reports finished transfers."""
        connector = self.connector
        if out.kv_connector_metadata is None:
            return None
        connector.wait_for_save()
        sending, recving = connector.get_finished(out.finished_ids)
        output = KVConnectorOutput(sending, recving, connector.get_block_ids_with_load_errors())
        connector.clear_connector_metadata()
        return output
