"""The server's default bounds on one request, shared by `build_app` and the flags of `pagellm serve` (a
module of their own, so the command line reads them without importing FastAPI)."""

DEFAULT_MAX_N = 128  # samples (`n`) per request; OpenAI's bound
DEFAULT_MAX_BODY_MB = 16  # MiB
DEFAULT_BATCH_CONCURRENCY = 256  # requests `pagellm run-batch` gives the engine at once
