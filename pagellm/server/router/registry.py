"""Which models are loaded, and when one is loaded or unloaded.

A request names a model; `acquire` gives it the model's child, loading the model first when it is not
loaded (a request to a model that is loading waits for the same load, it never fails for it). A model
holds one of `max_loaded` slots from the moment its load takes one until its child has exited, so memory
is never counted free before it is; when every slot is taken, the least recently used idle model (no
request in flight) is unloaded first, and with none idle the load waits until one is. A model idle for
`keep_alive_s` is unloaded. Everything runs on the router's event loop, so no state needs a lock: between
two awaits nothing else runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from pagellm.server.router.children import Child, ChildStartError, Launcher, ModelSpec

logger = logging.getLogger("pagellm")

LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"
"""The `state` of each model in /v1/models (`pagellm ps` reads it)."""


class UnknownModelError(KeyError):
    """A request named a model the router does not serve."""


@dataclass
class ModelSlot:
    """One model and what the router knows of it."""

    spec: ModelSpec
    state: str = UNLOADED
    child: Child | None = None
    active: int = 0  # requests in flight
    last_used: float = 0.0
    holds_slot: bool = False  # counted against max_loaded: from the load's start to the child's exit
    loading: asyncio.Task | None = None
    stopping: asyncio.Task | None = None
    error: str | None = None  # why its last load failed
    loads: int = 0
    requests: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


class ModelRegistry:
    """The router's models, their children, and the rules above."""

    def __init__(
        self,
        models: list[ModelSpec],
        launcher: Launcher,
        max_loaded: int | None = None,
        keep_alive_s: float | None = None,
    ):
        self.slots = {m.name: ModelSlot(m) for m in models}
        self.launcher = launcher
        self.max_loaded = max_loaded
        self.keep_alive_s = keep_alive_s
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task | None = None

    def slot(self, name: str) -> ModelSlot:
        try:
            return self.slots[name]
        except KeyError:
            raise UnknownModelError(name) from None

    # -- requests ------------------------------------------------------------------------------------------

    async def acquire(self, name: str) -> Child:
        """The model's child, loaded first if need be; the caller must `release(name)` when its request is
        done, and until then the model is not unloaded for room or keep-alive."""
        slot = self.slot(name)
        slot.active += 1
        try:
            child = await self.load(name)
        except BaseException:
            self.release(name)
            raise
        slot.requests += 1
        return child

    def release(self, name: str) -> None:
        slot = self.slots[name]
        slot.active -= 1
        slot.last_used = time.monotonic()
        self._notify()

    # -- loading and unloading -----------------------------------------------------------------------------

    async def load(self, name: str) -> Child:
        """The model's child once it is ready: loaded now, or by the load already under way."""
        slot = self.slot(name)
        while True:
            if slot.state == LOADED and slot.child is not None:
                slot.last_used = time.monotonic()
                return slot.child
            if slot.loading is None:
                slot.state, slot.error = LOADING, None
                slot.loading = asyncio.create_task(self._load(slot))
            task = slot.loading
            try:
                await asyncio.shield(task)  # a cancelled request does not cancel the load it waited on
            except asyncio.CancelledError:
                cancelling = getattr(asyncio.current_task(), "cancelling", lambda: 0)  # 3.11+
                if task.cancelled() and not cancelling():  # the load was cancelled (unloaded), not we
                    raise ChildStartError(f"model {name!r} was unloaded while it loaded") from None
                raise

    async def _load(self, slot: ModelSlot) -> None:
        try:
            if slot.stopping is not None:  # unloaded a moment ago: its old child must be gone first
                await slot.stopping
            await self._take_slot(slot)
            slot.child = await self.launcher.start(slot.spec)
        except BaseException as exc:
            slot.state, slot.holds_slot = UNLOADED, False
            slot.error = str(exc) or type(exc).__name__
            if not isinstance(exc, ChildStartError | asyncio.CancelledError):
                logger.exception("loading model %r failed", slot.spec.name)
            raise
        else:
            slot.state, slot.loads, slot.last_used = LOADED, slot.loads + 1, time.monotonic()
        finally:
            slot.loading = None
            self._notify()

    async def _take_slot(self, slot: ModelSlot) -> None:
        """Count the model against max_loaded, unloading the least recently used idle model while every slot
        is taken, and waiting while none is idle."""
        while not slot.holds_slot:
            taken = sum(s.holds_slot for s in self.slots.values())
            if self.max_loaded is None or taken < self.max_loaded:
                slot.holds_slot = True
                break
            idle = [s for s in self.slots.values() if s.state == LOADED and s.active == 0 and s is not slot]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                logger.info(
                    "unloading model %r (least recently used) for %r", victim.spec.name, slot.spec.name
                )
                await self._unload(victim)
                continue
            changed = self._changed
            await changed.wait()

    async def unload(self, name: str) -> bool:
        """Unload the model (its in-flight requests are finished first by the child's graceful shutdown, up
        to STOP_GRACE_S); a load under way is cancelled. False when it was not loaded."""
        slot = self.slot(name)
        if slot.loading is not None:
            slot.loading.cancel()
            with contextlib.suppress(BaseException):
                await slot.loading
            return True
        if slot.state != LOADED:
            return False
        await self._unload(slot)
        return True

    async def _unload(self, slot: ModelSlot) -> None:
        """Mark the model unloaded at once (new requests load it afresh), then stop its child; its slot is
        given back only once the child has exited."""
        child, slot.child, slot.state = slot.child, None, UNLOADED
        if child is None:
            return
        slot.stopping = asyncio.ensure_future(self._stop(slot, child))
        await asyncio.shield(slot.stopping)

    async def _stop(self, slot: ModelSlot, child: Child) -> None:
        try:
            await child.stop()
        finally:
            if slot.loading is None:  # a reload waiting on this stop takes the slot itself
                slot.holds_slot = False
            slot.stopping = None
            logger.info("model %r unloaded", slot.spec.name)
            self._notify()

    def _notify(self) -> None:
        """Wake every waiter: each looks at the state again (a fresh event for the next wait)."""
        self._changed.set()
        self._changed = asyncio.Event()

    # -- keep-alive and crashes ----------------------------------------------------------------------------

    def start_reaper(self) -> None:
        """Start the background task that unloads idle models and notices crashed children."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        interval = min(1.0, self.keep_alive_s / 4) if self.keep_alive_s else 1.0
        while True:
            await asyncio.sleep(interval)
            await self.reap()

    async def reap(self) -> None:
        """One look: forget children that died, unload models idle past keep-alive."""
        now = time.monotonic()
        for slot in list(self.slots.values()):
            if slot.state != LOADED or slot.child is None:
                continue
            if not slot.child.alive():
                logger.warning(
                    "the server of model %r exited; it loads again on its next request", slot.spec.name
                )
                slot.error = "its server exited"
                await self._unload(slot)
            elif (
                self.keep_alive_s is not None
                and slot.active == 0
                and now - slot.last_used >= self.keep_alive_s
            ):
                logger.info(
                    "model %r idle for %.0fs (--keep-alive): unloading it", slot.spec.name, self.keep_alive_s
                )
                await self._unload(slot)

    async def close(self) -> None:
        """Stop the reaper, cancel loads under way and stop every child."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*(self.unload(name) for name in self.slots), return_exceptions=True)
        pending = [s.stopping for s in self.slots.values() if s.stopping is not None]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    # -- what /v1/models and /metrics show -----------------------------------------------------------------

    def describe(self) -> list[dict]:
        """One OpenAI model object per model, with its `state` (and `error`, when its last load failed)."""
        models = []
        for slot in self.slots.values():
            entry = {
                "id": slot.spec.name,
                "object": "model",
                "created": slot.created,
                "owned_by": "pagellm",
                "state": slot.state,
            }
            if slot.error and slot.state == UNLOADED:
                entry["error"] = slot.error
            models.append(entry)
        return models
