"""What an engine did, step by step, seen from the bench: each step's wall time and what it scheduled.

`StepRecorder(engine)` wraps the engine's `step` and its scheduler's `schedule` on the instances (nothing
in the engine changes) for the duration of a `with` block. Per step it keeps (start, num_tokens, samples)
per scheduled request, read the moment the scheduler decides, so the floor counts the work the engine
really scheduled: prompt chunks, prefix-cache hits, decodes, recomputation after a preemption.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.bench.floor import ModelShape, Work, step_work


@dataclass
class StepRecord:
    chunks: list[tuple[int, int, bool]]  # per scheduled request: (first position, tokens, samples)
    seconds: float

    @property
    def is_decode(self) -> bool:
        """Every scheduled request runs exactly one token."""
        return all(n == 1 for _, n, _ in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.chunks)


@dataclass
class StepRecorder:
    engine: Any
    steps: list[StepRecord] = field(default_factory=list)

    def __enter__(self) -> StepRecorder:
        engine, scheduler = self.engine, self.engine.scheduler
        schedule, step = scheduler.schedule, engine.step
        pending: list[list[tuple[int, int, bool]]] = []

        def recording_schedule():
            out = schedule()
            chunks = []
            for request in out.scheduled:
                n = out.num_scheduled_tokens[request.request_id]
                start = request.num_computed_tokens
                chunks.append((start, n, start + n == request.num_tokens))
            pending.append(chunks)
            return out

        def timed_step():
            pending.clear()
            began = time.perf_counter()
            outputs = step()
            seconds = time.perf_counter() - began
            if pending and pending[-1]:
                self.steps.append(StepRecord(pending[-1], seconds))
            return outputs

        scheduler.schedule = recording_schedule
        engine.step = timed_step
        return self

    def __exit__(self, *exc: Any) -> None:
        # the wrappers are instance attributes; deleting them uncovers the class's methods again
        del self.engine.step
        del self.engine.scheduler.schedule


def records_work(shape: ModelShape, records: list[StepRecord]) -> Work:
    """The work of these steps: each step's chunks, and the weights once per step."""
    total = Work()
    for record in records:
        total = total + step_work(shape, record.chunks)
    return total
