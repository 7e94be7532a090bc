"""A stand-in for llama.cpp's `llama-server`, for testing the bench's plumbing without the binary.

It takes llama-server's flags (-m, --host, --port, -np, -c, -t, -tb, -fa on|off; others are ignored),
answers GET /health and POST /completion (token-id prompts, n_predict), and appends one JSON line per
completion request, with the flags it was started with, to the file named by $FAKE_LLAMA_LOG.
`--help` prints the flash-attention line of a recent llama-server.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HELP = "-fa,   --flash-attn [on|off|auto]     set Flash Attention use ('on', 'off', or 'auto', default: 'auto')\n"


def parse(argv: list[str]) -> dict[str, str]:
    flags, i = {}, 0
    while i < len(argv):
        name = argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            flags[name] = argv[i + 1]
            i += 2
        else:
            flags[name] = ""
            i += 1
    return flags


def main() -> None:
    if "--help" in sys.argv:
        print(HELP)
        return
    flags = parse(sys.argv[1:])
    if not os.path.isfile(flags.get("-m", "")):
        print(f"error: failed to load model '{flags.get('-m')}'", file=sys.stderr)
        sys.exit(1)
    log = os.environ.get("FAKE_LLAMA_LOG")

    class Handler(BaseHTTPRequestHandler):
        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            if self.path != "/completion":
                self._json(404, {"error": {"message": "not found"}})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"flags": flags, "body": body}) + "\n")
            n = int(body["n_predict"])
            time.sleep(0.001 * n)
            self._json(
                200,
                {
                    "content": "x" * n,
                    "tokens_predicted": n,
                    "tokens_evaluated": len(body["prompt"]),
                    "stop": True,
                    "timings": {"predicted_n": n},
                },
            )

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((flags.get("--host", "127.0.0.1"), int(flags["--port"])), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
