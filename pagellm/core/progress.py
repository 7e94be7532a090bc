"""Progress bars for the long waits of a start at a terminal (GGUF tensors read or widened, the CPU kernels'
build), shown only where someone watches.

A bar is drawn on stderr when stderr is a terminal; in logs, pipes and CI it stays silent, so captured
output holds log lines, not carriage-return redraws. PAGELLM_PROGRESS=1 forces the bars on (a terminal
behind a pipe, or a test), PAGELLM_PROGRESS=0 turns them off. Lives in core so that every layer, the
implementations under platforms/ and quantization/ included, can use it without importing above itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

ENV_SWITCH = "PAGELLM_PROGRESS"
T = TypeVar("T")


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether to draw bars on `stream` (stderr by default): PAGELLM_PROGRESS=1/0 decides when set, else
    whether the stream is a terminal."""
    forced = os.environ.get(ENV_SWITCH, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress(
    iterable: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it", leave: bool = False
) -> Iterator[T]:
    """`iterable`, drawing a tqdm bar on stderr while it is consumed where progress_enabled(); the bar goes
    when the iteration ends (leave=False), since a log line usually says what was done."""
    from tqdm import tqdm

    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if not progress_enabled():
        yield from iterable
        return
    with _logs_above_the_bar():
        yield from tqdm(
            iterable, desc=desc, total=total, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True
        )


@contextlib.contextmanager
def elapsed(desc: str, interval: float = 0.5) -> Iterator[Any]:
    """A line `desc: 00:12` redrawn every `interval` seconds while the block runs, for a wait with no count
    to show (a compiler building kernels); nothing where progress_enabled() is False. Yields the tqdm bar
    (or None)."""
    if not progress_enabled():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, total=None, bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="pagellm-progress", daemon=True)
    ticker.start()
    try:
        with _logs_above_the_bar():
            yield bar
    finally:
        done.set()
        ticker.join()
        bar.close()


def _logs_above_the_bar() -> contextlib.AbstractContextManager[None]:
    """The root logger's console handlers write through tqdm while a bar is drawn, so a log line lands on a
    line of its own above the bar instead of after the bar's text on the same line."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()
