"""`zmq`: the decode engine pulls a prompt's KV blocks from the prefill engine's cache over ZeroMQ (TCP).

Why ZeroMQ rather than torch.distributed point-to-point: engines start, stop and pair up per request, while
a process group has a fixed membership set up once by a rendezvous, and a send or receive with a dead peer
blocks until a long timeout. pyzmq is already a dependency (AsyncLLM's engine process), a message to a dead
peer is one that never gets an answer, and every wait here has a deadline. The cost: bytes go through host
memory (a GPU cache is copied to the host first); an RDMA or NIXL plugin would avoid that.

Producer (kv_producer, kv_both): a request sent with kv_transfer_params {"do_remote_decode": true} keeps its
blocks when it finishes, and its output's kv_transfer_params say where they are (remote_host, remote_port,
remote_request_id, remote_block_ids, and the digest of the prefix they hold). A thread answers reads from
the KV cache. The blocks are freed once read, on a release message (the decode side needs none of them), or
after `send_timeout_s` (kv_connector_extra_config, default 120 s) when nobody came for them.

Consumer (kv_consumer, kv_both): a request carrying those params reads the blocks after its local prefix-cache
hit, if the digest matches its own prompt (same tokens, adapter, model and layout); an answer that is
missing, short or of another layout, or none within `recv_timeout_s` (default 10 s), fails the load and the
request recomputes.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import (
    ConnectorRequest,
    KVConnector,
    KVConnectorContext,
    KVConnectorRole,
    block_digests,
)
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.2"

logger = logging.getLogger("pagellm")

_RETRY_S = 0.01  # the producer does not know the request yet (it registers it a step after it finished)
_GONE_REMEMBERED = 10_000  # released request ids kept, to answer "gone" rather than "unknown"


@dataclass
class Load:
    request_id: str  # the local request
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]  # where they go here


@dataclass
class ZmqMeta:
    loads: list[Load] = field(default_factory=list)
    sends: dict[str, list[int]] = field(default_factory=dict)  # request id -> blocks held for a reader
    releases: list[tuple[str, int, str]] = field(default_factory=list)  # (host, port, remote request id)


@dataclass
class _Pending:
    load: Load
    transfer_id: int
    deadline: float
    retry_at: float | None = None


class ZmqConnector(KVConnector):
    name = "zmq"

    @classmethod
    def check_config(cls, config: Any) -> None:
        for key in ("send_timeout_s", "recv_timeout_s"):
            value = config.kv_connector_extra_config.get(key, 1.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"kv_transfer_config.kv_connector_extra_config.{key}: seconds > 0, not {value!r}"
                )

    def __init__(self, config: Any, role: KVConnectorRole, context: KVConnectorContext):
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        self.send_timeout_s = float(extra.get("send_timeout_s", 120.0))
        self.recv_timeout_s = float(extra.get("recv_timeout_s", 10.0))
        # scheduler
        self._loads: list[Load] = []
        self._sends: dict[str, list[int]] = {}
        self._releases: list[tuple[str, int, str]] = []
        self._consumed: set[str] = set()  # requests whose remote KV was read or released: never twice
        # worker
        self.bytes_sent = self.bytes_received = 0
        self._lock = threading.Lock()
        self._held: dict[str, tuple[list[int], float]] = {}  # request id -> (blocks, deadline)
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        # releases that came before this engine's next step registered the request's blocks as held
        self._early_releases: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sent: set[str] = set()
        self._pending: dict[int, _Pending] = {}
        self._received: set[str] = set()
        self._invalid: set[int] = set()
        self._transfer_ids = itertools.count()
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        self._zmq: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if role is KVConnectorRole.WORKER:
            self._zmq = zmq.Context()
            if config.is_producer:
                self._start_server()

    # -- scheduler: consumer ----------------------------------------------------------------------------

    def _remote(self, request: ConnectorRequest) -> dict[str, Any] | None:
        """The request's remote prefill, checked; None when it has none (or it was consumed)."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        if request.request_id in self._consumed:
            return None
        try:
            remote = {
                "host": str(params["remote_host"]),
                "port": int(params["remote_port"]),
                "request_id": str(params["remote_request_id"]),
                "block_ids": [int(b) for b in params["remote_block_ids"]],
                "digest": str(params["remote_prefix_digest"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("request %s: kv_transfer_params lack %s; recomputing", request.request_id, exc)
            self._consumed.add(request.request_id)
            return None
        return remote

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        remote = self._remote(request)
        if remote is None or not remote["block_ids"]:
            return 0
        num_blocks = len(remote["block_ids"])
        if num_blocks > (request.num_prompt_tokens - 1) // self.block_size:
            return 0
        mine = block_digests(
            request.prompt_token_ids, self.block_size, num_blocks, request.cache_salt, self.context.namespace
        )
        if mine[-1] != remote["digest"]:  # another prompt, adapter, model or layout: recompute
            return 0
        return max(0, num_blocks * self.block_size - num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        self._consumed.add(request.request_id)
        if not num_external_tokens:  # admitted without them: let the producer free its blocks now
            self._releases.append((remote["host"], remote["port"], remote["request_id"]))
            return
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._loads.append(
            Load(
                request.request_id,
                remote["host"],
                remote["port"],
                remote["request_id"],
                remote["block_ids"][first:last],
                block_ids[first:last],
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> ZmqMeta:
        meta = ZmqMeta(self._loads, self._sends, self._releases)
        self._loads, self._sends, self._releases = [], {}, []
        return meta

    # -- scheduler: producer ------------------------------------------------------------------------------

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        remote = self._remote(request)
        if remote is not None:  # finished before it was admitted (aborted): the producer may free them
            self._releases.append((remote["host"], remote["port"], remote["request_id"]))
        self._consumed.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if (
            not self.config.is_producer
            or not params.get("do_remote_decode")
            or request.finish_reason == "abort"
        ):
            return False, None
        num_blocks = min(len(block_ids), (request.num_prompt_tokens - 1) // self.block_size)
        if num_blocks == 0:  # shorter than a block: the decode side computes it all
            return False, None
        self._sends[request.request_id] = block_ids[:num_blocks]
        digest = block_digests(
            request.prompt_token_ids, self.block_size, num_blocks, request.cache_salt, self.context.namespace
        )[-1]
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.context.engine_id,
            "remote_host": self.context.worker_info["host"],
            "remote_port": self.context.worker_info["port"],
            "remote_request_id": request.request_id,
            "remote_block_ids": block_ids[:num_blocks],
            "remote_prefix_digest": digest,
        }

    # -- worker: producer -------------------------------------------------------------------------------

    def _start_server(self) -> None:
        self._server = self._zmq.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{self.config.kv_ip}"
        try:
            if self.config.kv_port:
                self._server.bind(f"{address}:{self.config.kv_port}")
                self._port = self.config.kv_port
            else:
                self._port = self._server.bind_to_random_port(address)
        except zmq.ZMQError as exc:
            self._server.close()
            raise ConfigError(
                f"kv_transfer_config: cannot listen on {self.config.kv_ip}:{self.config.kv_port} ({exc}); "
                "pick another kv_ip or kv_port (0: any free port)"
            ) from exc
        self._thread = threading.Thread(target=self._serve, name="pagellm-kv-zmq", daemon=True)
        self._thread.start()

    def worker_info(self) -> dict[str, Any]:
        if self._thread is None:
            return {}
        host = self.config.kv_ip if self.config.kv_ip not in ("0.0.0.0", "::", "*") else socket.getfqdn()
        return {"host": host, "port": self._port}

    def _serve(self) -> None:
        """The producer's thread: answer reads and releases until closed."""
        while not self._stop.is_set():
            try:
                if not self._server.poll(100):
                    continue
                identity, message = self._server.recv_multipart()
                reply = self._answer(json.loads(message))
                if reply is not None:
                    self._server.send_multipart([identity, *reply])
            except zmq.ZMQError:
                if not self._stop.is_set():
                    logger.exception("the KV transfer server failed")
                return
            except Exception:
                logger.exception("a KV transfer request failed")

    def _answer(self, message: dict[str, Any]) -> list | None:
        """A read's reply frames (a JSON header, then one frame of bytes per layer), or None for a release.
        The copy is made under the lock, so the blocks are not reported sent (and freed) before it ends."""
        request_id, transfer_id = message.get("request_id"), message.get("transfer_id")
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                status = "gone" if request_id in self._gone else "unknown"
                if message.get("op") == "release":
                    if status == "unknown":  # the decode side was quicker than our next step: keep it
                        self._early_releases[request_id] = None
                        while len(self._early_releases) > _GONE_REMEMBERED:
                            self._early_releases.popitem(last=False)
                    return None
                return [_header(transfer_id, status)]
            frames: list | None = None
            if message.get("op") == "read":
                block_ids = message.get("block_ids") or []
                if not set(block_ids) <= set(held[0]):
                    return [_header(transfer_id, "error", reason="blocks not held for this request")]
                data = [self.blocks.read(layer, block_ids).cpu() for layer in range(self.blocks.num_layers)]
                shape = list(self.blocks.shape(len(block_ids)))
                frames = [_header(transfer_id, "ok", shape=shape, dtype=str(self.blocks.dtype))]
                frames += [t.contiguous().view(torch.uint8).numpy() for t in data]
                self.bytes_sent += sum(t.nbytes for t in data)
            self._release(request_id)
        return frames

    def _release(self, request_id: str) -> None:
        """Report the request's blocks sent (with the lock held)."""
        del self._held[request_id]
        self._sent.add(request_id)
        self._gone[request_id] = None
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)

    # -- worker: both -----------------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ZmqMeta) -> None:
        super().bind_connector_metadata(metadata)
        if metadata.sends:
            deadline = time.monotonic() + self.send_timeout_s
            with self._lock:
                for request_id, block_ids in metadata.sends.items():
                    self._held[request_id] = (block_ids, deadline)
                    if self._early_releases.pop(request_id, "held") is None:
                        self._release(request_id)
        for host, port, remote_request_id in metadata.releases:
            self._dealer(host, port).send(
                json.dumps({"op": "release", "request_id": remote_request_id}).encode()
            )

    def start_load_kv(self) -> None:
        """Ask each producer for the step's blocks; the answers are read in `get_finished`."""
        deadline = time.monotonic() + self.recv_timeout_s
        for load in self.metadata.loads:
            pending = _Pending(load, next(self._transfer_ids), deadline)
            self._pending[pending.transfer_id] = pending
            self._ask(pending)

    def _ask(self, pending: _Pending) -> None:
        load = pending.load
        message = {
            "op": "read",
            "request_id": load.remote_request_id,
            "block_ids": load.remote_block_ids,
            "transfer_id": pending.transfer_id,
        }
        pending.retry_at = None
        self._dealer(load.host, load.port).send(json.dumps(message).encode())

    def _dealer(self, host: str, port: int) -> zmq.Socket:
        sock = self._dealers.get((host, port))
        if sock is None:
            sock = self._dealers[(host, port)] = self._zmq.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
        return sock

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for request_id, (_, deadline) in list(self._held.items()):
                if deadline < now:
                    logger.warning(
                        "request %s: no decode engine read its KV within %.0f s; freeing its blocks",
                        request_id,
                        self.send_timeout_s,
                    )
                    self._release(request_id)
            sent, self._sent = self._sent, set()
        for sock in list(self._dealers.values()):
            while sock.poll(0):
                self._receive(sock.recv_multipart())
        for pending in list(self._pending.values()):
            load = pending.load
            if pending.deadline < now:
                self._fail(
                    pending, f"no answer from {load.host}:{load.port} within {self.recv_timeout_s:.0f} s"
                )
                address = (load.host, load.port)
                if all((p.load.host, p.load.port) != address for p in self._pending.values()):
                    self._dealers.pop(address).close()  # drop what is queued for a producer that is gone
            elif pending.retry_at is not None and pending.retry_at <= now:
                self._ask(pending)
        received, self._received = self._received, set()
        return sent, received

    def _receive(self, frames: list[bytes]) -> None:
        header = json.loads(frames[0])
        pending = self._pending.get(header.get("transfer_id"))
        if pending is None:  # an answer after its deadline
            return
        status = header.get("status")
        if status == "unknown":  # the producer has not registered the request yet
            pending.retry_at = time.monotonic() + _RETRY_S
            return
        if status != "ok":
            self._fail(pending, f"the producer answered {status} {header.get('reason', '')}".strip())
            return
        block_ids = pending.load.block_ids
        expected = list(self.blocks.shape(len(block_ids)))
        try:
            if header.get("shape") != expected or header.get("dtype") != str(self.blocks.dtype):
                raise ValueError(
                    f"{header.get('shape')} {header.get('dtype')}, not {expected} {self.blocks.dtype}"
                )
            if len(frames) != 1 + self.blocks.num_layers:
                raise ValueError(f"{len(frames) - 1} layers, not {self.blocks.num_layers}")
            for layer, frame in enumerate(frames[1:]):
                data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
                self.blocks.write(layer, block_ids, data.view(self.blocks.dtype).view(expected))
                self.bytes_received += len(frame)
        except (ValueError, RuntimeError) as exc:  # truncated, or another layout
            self._fail(pending, f"its answer does not fit: {exc}")
            return
        del self._pending[pending.transfer_id]
        self._received.add(pending.load.request_id)

    def _fail(self, pending: _Pending, why: str) -> None:
        load = pending.load
        logger.warning(
            "request %s: KV read from %s:%d failed (%s); recomputing",
            load.request_id,
            load.host,
            load.port,
            why,
        )
        del self._pending[pending.transfer_id]
        self._invalid.update(load.block_ids)
        self._received.add(load.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._server.close()
        for sock in self._dealers.values():
            sock.close()
        self._dealers.clear()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None


def _header(transfer_id: Any, status: str, **fields: Any) -> bytes:
    return json.dumps({"transfer_id": transfer_id, "status": status, **fields}).encode()


@hookimpl
def pagellm_kv_connectors():
    return [ZmqConnector]
