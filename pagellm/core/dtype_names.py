"""The dtype names users pass (`--dtype`, `--kv-cache-dtype`), without torch: the engine's settings
(`core.config`) and the command line read them before anything imports torch, so `pagellm serve` can start its
engine process while the front end is still importing (`core.dtypes` maps them to torch dtypes)."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPE_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")
