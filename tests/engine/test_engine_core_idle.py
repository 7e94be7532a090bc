"""The engine loop (`EngineCore.run`) starts the work an engine puts off while it serves (a warm start's
load of its saved compiled forward) once it has been idle for IDLE_S, and not when a request comes first."""

from __future__ import annotations

from pagellm.engine.core import IDLE_S, AddRequest, EngineCore, Shutdown


class PuttingOff:
    """An engine with no requests that puts work off until it idles."""

    def __init__(self):
        self.put_off = True
        self.idled = 0
        self.added: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return False

    def waits_for_idle(self) -> bool:
        return self.put_off

    def on_idle(self) -> None:
        self.idled += 1
        self.put_off = False

    def add_request(self, prompt, params, request_id, *rest, **kwargs) -> None:
        self.added.append(request_id)

    def default_sampling_params(self):
        return None

    def stats(self) -> None:
        return None


def run(engine: PuttingOff, answers: list[list]) -> list:
    """Run the loop on `answers` (what each receive returns, in order); the waits it asked for."""
    waits = []

    def receive(wait):
        waits.append(wait)
        return answers.pop(0)

    EngineCore(engine, lambda turn: None).run(receive)
    return waits


def test_put_off_work_starts_once_the_engine_has_idled():
    engine = PuttingOff()
    waits = run(engine, [[], [Shutdown("done")]])
    assert waits == [IDLE_S, True] and engine.idled == 1


def test_a_request_within_the_idle_wait_is_served_first():
    engine = PuttingOff()
    request = AddRequest("r1", {"prompt_token_ids": [1, 2]}, None, priority=0, arrival_time=0.0)
    waits = run(engine, [[request], [Shutdown("done")]])
    assert engine.added == ["r1"] and engine.idled == 0 and waits == [IDLE_S, IDLE_S]


def test_an_engine_with_nothing_put_off_blocks_for_its_commands():
    engine = PuttingOff()
    engine.put_off = False
    assert run(engine, [[Shutdown("done")]]) == [True] and engine.idled == 0


def test_the_engine_process_waits_a_number_of_seconds_for_commands_then_returns_none():
    import time

    from pagellm.engine.core_process import _receiver

    class Quiet:
        def poll(self, timeout_ms):
            time.sleep(timeout_ms / 1000)
            return False

    receive = _receiver(Quiet(), lambda: False)
    started = time.monotonic()
    assert receive(0.3) == []
    assert 0.25 <= time.monotonic() - started < 1.0
    assert receive(False) == []
    gone = _receiver(Quiet(), lambda: True)
    assert [type(c).__name__ for c in gone(0.1)] == ["Shutdown"]
