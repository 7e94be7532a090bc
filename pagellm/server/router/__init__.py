"""Several models behind one `pagellm serve` (`--model A --model B`, `--models-dir DIR`): a router front end
that starts each model as its own child `pagellm serve` on a private localhost port when a request first
names it, proxies requests to it, and stops it when it has been idle for `--keep-alive` seconds or when
`--max-loaded-models` needs its place. One child per model means an unload (or a crash) frees everything
the model held: its weights, KV cache, compiled kernels and engine process.

The router imports neither torch nor the engine: it is a small process that stays up while models come
and go (children.py starts and stops them, registry.py decides when, app.py is the HTTP side)."""
