"""A server subprocess the bench starts (`pagellm serve`, llama-server): its output in a log file, waiting
for its /health, the end of its log for error messages, and stopping it."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence


def quiet_httpx() -> None:
    """httpx logs every request at INFO; a benchmark sends thousands."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


class LoggedProcess:
    """`command` in a subprocess, stdout and stderr written to `log_path`; `stop()` ends it and closes the
    log."""

    tail_lines = 20  # what `log_tail()` gives by default

    def __init__(self, command: Sequence[str], log_path: str):
        self.command = list(command)
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Poll `url`/health until it answers 200. If the process exits first or `timeout_s` passes (or
        anything interrupts the wait), stop it; then raise RuntimeError(`start_failure(timeout_s)`)."""
        import httpx

        quiet_httpx()
        deadline = time.monotonic() + timeout_s
        try:
            while self.process.poll() is None:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            raise RuntimeError(self.start_failure(timeout_s))
        except BaseException:
            self.stop()
            raise

    def start_failure(self, timeout_s: float) -> str:
        """Why the process never became healthy: it exited, or `timeout_s` passed."""
        if self.process.poll() is not None:
            return f"{self.command[0]} exited with {self.process.returncode}\n{self.log_tail()}"
        return f"{self.command[0]} did not become healthy in {timeout_s:.0f} s\n{self.log_tail()}"

    def log_tail(self, lines: int | None = None) -> str:
        """The last `lines` (default: `tail_lines`) lines of the log."""
        self._log.flush()
        lines = self.tail_lines if lines is None else lines
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        """Terminate the process, kill it if it has not exited within 30 s, and close the log."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
