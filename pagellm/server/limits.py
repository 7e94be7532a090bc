"""The server's default bounds on one request, shared by `build_app` and the flags of `pagellm serve` (a
module of their own, so the command line reads them without importing FastAPI)."""

DEFAULT_MAX_N = 128  # samples (`n`) per request; OpenAI's bound
DEFAULT_MAX_BODY_MB = 16  # MiB
DEFAULT_BATCH_CONCURRENCY = 256  # requests `pagellm run-batch` gives the engine at once
DEFAULT_RESPONSES_STORE_ENTRIES = 1000  # --responses-store-max-entries: responses kept at most
DEFAULT_RESPONSES_STORE_AGE_S = 3600  # --responses-store-max-age: seconds a response is kept
