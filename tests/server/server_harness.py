"""A real `pagellm serve` process on a free localhost port, and reading its Prometheus metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagellm serve MODEL ARGS...` in a subprocess; `url` once /health answers 200."""

    def __init__(self, model_dir: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-c",
            "from pagellm.cli.main import main; main()",
            "--log-level",
            "WARNING",
        ]
        command += ["serve", str(model_dir), "--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                pytest.fail(
                    f"pagellm serve exited with {self.process.returncode}:\n{self.log_path.read_text()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(
            f"pagellm serve did not become healthy in {START_TIMEOUT_S}s:\n{self.log_path.read_text()}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text output (labels must match where given)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        sample_labels = dict(part.split("=", 1) for part in line[len(name) + 1 : line.index("}")].split(","))
        if all(sample_labels.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"no sample {name} {labels} in the metrics")
