"""The `KVConnector` interface: moving KV-cache blocks between an engine and the outside (another engine's
cache, a directory), for disaggregated prefill and decode and for a KV cache that outlives the process.

A connector class is instantiated twice per engine, once per role, and the two instances talk only through
plain data, so the worker half could live in another process:

- the scheduler's (`KVConnectorRole.SCHEDULER`) decides how many tokens of a new request can be loaded from
  outside, what to load and save each step (`build_connector_meta`, handed to the worker with the step),
  and whether a finished request's blocks must stay held until they are sent (`request_finished`);
- the worker's (`KVConnectorRole.WORKER`, next to the KV cache tensors) moves the bytes: it starts the
  step's loads before the forward, saves after it, and reports finished transfers (`get_finished`, handed
  back with the step's result).

Loads never overlap a forward that reads them: a request with external tokens gets blocks for them and
waits (WAITING_FOR_REMOTE_KVS) until the worker reports it received, then goes back to the waiting queue
and finds its loaded blocks as prefix-cache hits. A connector that loads at once reports the request in the
same step; one that loads over the network reports it when the bytes arrived (or failed). That is why there
is no per-layer `wait_for_layer_load` here, and why the blocks of a failed load are simply not cached:
the request recomputes them.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from pagellm.core.errors import ConfigError
from pagellm.core.json_setting import json_setting

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config '{"kv_connector": NAME, "kv_role": "kv_producer|kv_consumer|kv_both", ...}'`.

    kv_producer: computes prompts and offers their KV (prefill engine); kv_consumer: loads KV computed
    elsewhere (decode engine); kv_both: either. `kv_ip`/`kv_port`: where a network connector listens
    (port 0: any free port). `kv_connector_extra_config`: the connector's own settings."""

    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: dict[str, Any] | str | None) -> KVTransferConfig | None:
        """The config from JSON text or a dict; None when unset; ConfigError naming the bad key."""
        value = json_setting(value, "kv_transfer_config", cls, '{"kv_connector": ...}')
        if value is None:
            return None
        if not isinstance(value.get("kv_connector"), str) or not value["kv_connector"]:
            raise ConfigError("kv_transfer_config.kv_connector: name a connector (see `pagellm plugins`)")
        role = value.get("kv_role", cls.kv_role)
        if role not in KV_ROLES:
            raise ConfigError(f"kv_transfer_config.kv_role: {role!r} is not one of {', '.join(KV_ROLES)}")
        port = value.get("kv_port", 0)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ConfigError(
                f"kv_transfer_config.kv_port: must be a port number (0: any free one), not {port!r}"
            )
        extra = value.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ConfigError("kv_transfer_config.kv_connector_extra_config: expected a JSON object")
        return cls(**value)


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector knows of its engine."""

    block_size: int
    namespace: str  # identifies the model and KV layout: KV saved under another namespace never loads here
    engine_id: str  # this engine's id (kv_transfer_config.engine_id, or a random one)
    worker_info: dict[str, Any] = field(default_factory=dict)  # scheduler role: the worker's `worker_info()`


@dataclass
class KVConnectorOutput:
    """What the worker reports after a step (`StepResult.kv_connector_output`)."""

    finished_sending: set[str] = field(default_factory=set)  # requests whose held blocks may be freed now
    finished_recving: set[str] = field(default_factory=set)  # requests whose load ended (well or not)
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks a load failed to fill

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.invalid_block_ids)


class ConnectorRequest(Protocol):
    """What a connector reads of a request (the engine's `Request` provides it)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None  # what the client sent (OpenAI API field `kv_transfer_params`)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> tuple | None: ...  # the LoRA adapter's identity: part of every key

    @property
    def finish_reason(self) -> str | None: ...  # "stop", "length", "abort" once finished


class KVCacheBlocks:
    """The engine's KV cache tensors (one per attention layer, in the backend's `kv_cache_shape`) and the
    dimension that indexes blocks: a connector copies whole blocks along it, whatever the layout."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int):
        self.caches = caches
        self.block_dim = block_dim

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape `read` returns for `num_blocks` blocks of one layer."""
        shape = list(self.caches[0].shape)
        shape[self.block_dim] = num_blocks
        return tuple(shape)

    def read(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks of one layer, in the cache's layout (on the cache's device)."""
        cache = self.caches[layer]
        return cache.index_select(self.block_dim, torch.tensor(block_ids, device=cache.device))

    def write(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        """Store `read`'s output for these blocks; ValueError when its shape or dtype is not this cache's."""
        if tuple(data.shape) != self.shape(len(block_ids)) or data.dtype != self.dtype:
            raise ValueError(
                f"KV data of shape {tuple(data.shape)} {data.dtype} does not fit "
                f"{self.shape(len(block_ids))} {self.dtype}"
            )
        cache = self.caches[layer]
        cache.index_copy_(self.block_dim, torch.tensor(block_ids, device=cache.device), data.to(cache.device))


def kv_block_dim(kv_cache_shape: Any, block_size: int, num_kv_heads: int, row_size: int) -> int:
    """The dimension of an attention backend's `kv_cache_shape` that counts blocks: the one that changes
    with the number of blocks. ConfigError when the layout has no such dimension."""
    one = kv_cache_shape(1, block_size, num_kv_heads, row_size)
    two = kv_cache_shape(2, block_size, num_kv_heads, row_size)
    dims = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(dims) != 1 or (one[dims[0]], two[dims[0]]) != (1, 2):
        raise ConfigError(
            f"the attention backend's KV cache shape {tuple(two)} (2 blocks) has no block dimension; "
            "KV connectors copy whole blocks, so they cannot run with this backend"
        )
    return dims[0]


def kv_namespace(*facts: Any) -> str:
    """A short digest of what makes KV reusable (model, dtypes, block size, layout): part of every key."""
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def block_digests(
    token_ids: list[int], block_size: int, num_blocks: int, salt: Any, namespace: str
) -> list[str]:
    """Chained sha256 digests of the first `num_blocks` full blocks: equal digests mean equal prefixes,
    model and adapter (`salt`), in every process (Python's `hash` of a string is not)."""
    digests = []
    parent = hashlib.sha256(f"{namespace}|{salt!r}".encode()).digest()
    for i in range(num_blocks):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(parent + chunk.tobytes()).digest()
        digests.append(parent.hex())
    return digests


class KVConnector:
    """One way of moving KV blocks in and out of an engine. Subclass, set `name`, implement the methods of
    the roles you support; the defaults do nothing. See the module docstring for the protocol."""

    name: ClassVar[str]
    """What `kv_transfer_config.kv_connector` names."""

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Raise ConfigError, naming the setting, for a config this connector cannot run with; called at
        start-up before any weight loads."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext):
        self.config = config
        self.role = role
        self.context = context
        self.block_size = context.block_size

    # -- scheduler role -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int | None:
        """Tokens after the `num_computed_tokens` found in the local prefix cache (block-aligned) that can
        be loaded from outside; whole blocks, never the last known token (the scheduler trims to that).
        None: not known yet, ask again next step (the request keeps its place). Called each time the
        request is about to be admitted, maybe several times before it is: commit to nothing here."""
        return 0

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request got blocks for its `num_external_tokens`: they are `block_ids[n : n + k]` where
        n = request.num_computed_tokens // block_size (its local hit) and k = num_external_tokens //
        block_size. Remember to load them in the next `build_connector_meta`. Also called with 0 when the
        request is admitted to run without external tokens (a connector may then release what was offered)."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the worker must load and save this step (plain, picklable data); clears what it returned.
        `scheduler_output` is the step's `SchedulerOutput` (scheduled requests, tokens, block ids)."""
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (or was aborted: `finish_reason == "abort"`). Returns (delay_free,
        kv_transfer_params): delay_free keeps its blocks held until the worker reports it in
        `finished_sending` (the worker must report it eventually, e.g. after a timeout); the params go back
        to the client with its output."""
        return False, None

    # -- worker role ----------------------------------------------------------------------------------

    def register_kv_caches(self, blocks: KVCacheBlocks) -> None:
        """Called once, before any step, with the engine's KV cache tensors."""
        self.blocks = blocks

    def worker_info(self) -> dict[str, Any]:
        """What the scheduler's instance needs to know of this worker (e.g. the address it listens on);
        it arrives as `context.worker_info`."""
        return {}

    def bind_connector_metadata(self, metadata: Any) -> None:
        """The step's `build_connector_meta` result, before the forward."""
        self.metadata = metadata

    def clear_connector_metadata(self) -> None:
        self.metadata = None

    def start_load_kv(self) -> None:
        """Start (or do) the step's loads, before the forward."""

    def wait_for_save(self) -> None:
        """Save (or start saving) what the step's metadata says, after the forward. Once it returns, the
        blocks may be freed and overwritten: copy what is still to go, or hold them with delay_free."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids since the last call, after each step.
        `finished_req_ids`: requests the scheduler finished since the previous step."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a load failed to fill since the last call (missing, truncated, corrupt, timed out); called
        right after `get_finished`, it must include the failed blocks of every request reported received."""
        return set()

    def close(self) -> None:
        """Release sockets, threads and files (engine shutdown)."""
