"""How the model runner gets its compiled forward (`RunnerCompile.forward`).

Where the platform compiles ahead of time (`Platform.compile_ahead`) and the model's traced code reads nothing
per step beside its inputs, the forward is loaded from the cache folder when a start before saved it
(worker/compiled_forward.py), else compiled and saved there; with --compile-in-background the runner serves on
the eager model at once while a thread loads the saved forward, or a compile process makes it and then a
thread loads it, and `swapped` checks it and hands it over between two steps. Without a saved forward, a
compile process makes the regional one first (each decoder layer compiled once: worker/regional.py), and a
second one the whole graph, which replaces it, once the engine idles (or after WHOLE_PUT_OFF_AT_MOST_S). Any
other model, or a failure of the ahead-of-time compile, takes `Platform.compile_model`, warmed up on a dummy
step (`_warm_up`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagellm.core.attention import AttentionBatch
from pagellm.core.progress import elapsed
from pagellm.models.context import set_forward_context
from pagellm.worker import compiled_forward
from pagellm.worker.regional import decoder_layers, layers_compiled_once
from pagellm.worker.step import EngineSetup

logger = logging.getLogger("pagellm")

AGREEMENT_TOKENS = 32
"""Tokens of the dummy step a compiled forward is checked on before it serves."""

WHOLE_PUT_OFF_AT_MOST_S = 60.0
"""How long the regional forward serves a busy engine before the whole graph compiles all the same. The compile
takes a core from the steps for its length (model S: ~40 s, in which a request took 0.86 s against 0.52 s on
both cores), where the whole graph's steps are 3-5% faster than the regional one's: started at once, the
regional-then-whole start served fewer requests in its first 160 s than one compiling the whole graph only.
An engine that idles (`on_idle`) compiles it then."""

LOAD_PUT_OFF_AT_MOST_S = 5.0
"""How long a warm start puts off loading its saved forward while requests keep the engine busy. Loading
holds the GIL for seconds (torch's inductor imports, the wrapper module): started with the engine, it made
model S's first request on the AMX Xeon 1.2 s slower (first token 5.33-5.38 s -> 6.33-6.43 s from the
command); the engine starts it once it idles (`on_idle`), or at the first step after this long."""


class RunnerCompile:
    def __init__(
        self,
        model: torch.nn.Module,
        setup: EngineSetup,
        kv_caches: list[torch.Tensor],
        layers: list,
        device: torch.device,
        guard_free: bool,
        blocks_of_one_request: int,
        cores: CoreYield | None = None,
    ):
        """`guard_free`: the model may be compiled without guards (nothing per step is read by its traced
        code beside the inputs); `blocks_of_one_request`: the KV cache a compile process allocates; `cores`:
        the steps' threads, one of them maybe yielded already (to the kernels' build, during the load)."""
        self.model, self.setup, self.kv_caches, self.layers, self.device = (
            model,
            setup,
            kv_caches,
            layers,
            device,
        )
        self.block_size = setup.config.block_size
        self.guard_free = guard_free
        self.blocks_of_one_request = blocks_of_one_request
        self.process: compiled_forward.CompileProcess | None = None  # the background compile, until it ends
        self.loading: compiled_forward.BackgroundLoad | None = None  # the saved forward, until swapped in
        self.whole_later: Path | None = None  # the whole graph, compiled once the engine idles
        self.regional = False  # the steps run the regional forward (worker/regional.py)
        self._put_off_until = 0.0  # a put-off load or compile starts at the first step after this
        self._timed = False  # a compile process was asked to time the attention backends
        self.cores = cores or CoreYield()

    @property
    def pending(self) -> bool:
        return self.process is not None or self.loading is not None or self.whole_later is not None

    @property
    def waits_for_idle(self) -> bool:
        """A saved forward's load, or the whole graph's compile, is put off until the engine idles
        (`on_idle`)."""
        if self.loading is not None:
            return self.loading.started is None
        return self.process is None and self.whole_later is not None

    def on_idle(self) -> None:
        """The engine has no request to run: start a load, or the whole graph's compile, put off until now."""
        if not self.waits_for_idle:
            return
        if self.loading is not None:
            logger.info("the engine is idle: loading the compiled forward from %s", self.loading.path)
            self.loading.start()
        else:
            logger.info("the engine is idle: compiling the whole graph")
            self._compile_whole()

    def forward(self) -> Callable[..., torch.Tensor]:
        """The compiled forward, or the eager model (a background compile pending, or compiling failed)."""
        ahead = self._ahead_of_time() if self.guard_free else None
        if ahead is not None:
            return ahead
        compiled = self.setup.platform.compile_model(self.model)
        return self._warm_up(compiled) if compiled is not None else self.model

    def key(self) -> str:
        """The compiled forward's key in the cache folder (`compiled_forward.artifact_key`)."""
        setup = self.setup
        facts = {
            "model_class": setup.model_class_path,
            "dtype": str(setup.dtype),
            "backend": setup.backend.name,
            "quantization": setup.quant_method.name if setup.quant_method else None,
            "kv_cache_dtype": str(setup.spec.kv_cache_dtype),
            "batch_invariant": setup.config.batch_invariant,
            "block_size": self.block_size,
            "hf_config": setup.hf_config.to_json_string(use_diff=False),
        }
        return compiled_forward.artifact_key(self.model, facts)

    def _ahead_of_time(self) -> Callable[..., torch.Tensor] | None:
        """With --compile-in-background, the eager model while a thread loads the forward a start before saved,
        or a compile process makes it. Else the saved forward, or one compiled here and saved. None where this
        platform cannot, or the compile fails (said why)."""
        key = self.key()
        path, regional = (
            compiled_forward.artifact_path(key),
            compiled_forward.artifact_path(key, regional=True),
        )
        if self.setup.config.compile_in_background:
            self._in_background(path, regional)
            return self.model
        if path.exists():
            started = time.monotonic()
            loaded = self._checked(path)
            if loaded is not None:
                logger.info("compiled forward loaded in %.1fs from %s", time.monotonic() - started, path)
                return loaded
        started = time.monotonic()
        try:
            with elapsed("compiling the model (--enforce-eager skips this)"):
                compiled = self.compile_ahead()
        except Exception as e:  # a graph break, a guard or an inductor failure: the usual compile instead
            logger.info(
                "compiling ahead of time failed (%s: %s); compiling on the first step", type(e).__name__, e
            )
            return None
        if compiled is None:
            return None
        forward = compiled_forward.bind(compiled, self.model)
        if not self._agrees(forward):
            return None
        try:
            compiled_forward.save(compiled, path)
        except Exception as e:  # an artifact torch cannot serialise: this start is compiled all the same
            logger.warning("could not save the compiled forward (%s: %s)", type(e).__name__, e)
        logger.info(
            "model compiled in %.1fs, saved to %s (--enforce-eager turns this off)",
            time.monotonic() - started,
            path,
        )
        return forward

    def _in_background(self, path: Path, regional: Path) -> None:
        """Serve on the eager forward while a thread loads the saved forward (once the engine idles), or a
        compile process makes the regional one, then the whole graph (`path`) once the engine idles again. A
        model without decoder layers compiles the whole graph at once."""
        if not path.exists() and decoder_layers(self.model):
            self.whole_later = path
        found = path if path.exists() else regional if regional.exists() else None
        if found is None:
            self._compile_in_background(
                regional if self.whole_later else path, regional=bool(self.whole_later)
            )
            return
        self.loading = compiled_forward.BackgroundLoad(found, self.model, start=False)
        self._put_off_until = time.monotonic() + LOAD_PUT_OFF_AT_MOST_S
        logger.info(
            "found the compiled forward %s; serving on the eager forward, loading it once the engine idles",
            found,
        )

    def _compile_whole(self) -> None:
        path, self.whole_later = self.whole_later, None
        self._compile_in_background(path)

    def _compile_in_background(self, path: Path, regional: bool = False) -> None:
        """Start the compile process that saves the forward to `path` (`regional`: each layer compiled once);
        the runner serves on what it has meanwhile, on one core fewer."""
        config = self.setup.config.replace(
            attention_backend=self.setup.backend.name,
            block_size=self.block_size,
            enforce_eager=True,
            compile_in_background=False,
            num_kv_blocks=self.blocks_of_one_request,
        )
        auto = self.setup.config.attention_backend in (None, "auto")
        timings = self.setup.config.replace(compile_in_background=False, enforce_eager=True) if auto else None
        timings, self._timed = (None if self._timed else timings), True
        key = path.name.split(".", 1)[0]
        request = compiled_forward.CompileRequest(config, str(path), key, timings, regional)
        self.process = compiled_forward.CompileProcess(request)
        self.yield_a_core()

    def yield_a_core(self) -> None:
        self.cores.yield_one()

    def take_the_core_back(self) -> None:
        self.cores.take_back()

    @torch.inference_mode()
    def compile_ahead(self, regional: bool = False) -> Any | None:
        """`Platform.compile_ahead` on the dummy step `_warm_up` runs (the token count unbacked); `regional`:
        each decoder layer compiled once (worker/regional.py)."""
        from torch._dynamo.decorators import mark_unbacked

        input_ids, positions, context = self._dummy_step()
        mark_unbacked(input_ids, 0)
        mark_unbacked(positions, 0)
        marked = layers_compiled_once(self.model) if regional else contextlib.nullcontext()
        with context, marked:
            return self.setup.platform.compile_ahead(self.model, (input_ids, positions), regional=regional)

    def swapped(self, current: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Between two steps: the compiled forward once it is loaded and checked, else `current`. A compile
        process that saved its file hands over to a load on a thread; the whole graph's compile, put off
        until the engine idles, starts here once the regional forward has run WHOLE_PUT_OFF_AT_MOST_S."""
        if self.process is not None:
            self._follow_process()
        if self.loading is not None:
            current = self._take_load(current)
        elif self.waits_for_idle and time.monotonic() >= self._put_off_until:
            logger.info("compiling the whole graph (put off while busy)")
            self._compile_whole()
        return current

    def _follow_process(self) -> None:
        done = self.process.poll()
        if done is None:
            return
        process, self.process = self.process, None
        self.take_the_core_back()
        logger.info("compile process done in %.1fs", time.monotonic() - process.started)
        if done:
            self.loading = self._load_now(Path(process.request.path))
        elif process.request.regional and self.whole_later is not None:  # the whole graph may compile
            self._compile_whole()

    def _load_now(self, path: Path) -> compiled_forward.BackgroundLoad:
        loading = compiled_forward.BackgroundLoad(path, self.model)
        loading.compiled_now = True
        return loading

    def _take_load(self, current: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if self.loading.started is None and time.monotonic() >= self._put_off_until:
            logger.info("loading the compiled forward from %s (put off while busy)", self.loading.path)
            self.loading.start()
        done = self.loading.poll()
        if done is None:
            return current
        loading, self.loading = self.loading, None
        if not done:
            error = loading.error
            logger.warning(
                "the saved compiled forward %s cannot be used (%s: %s)",
                loading.path,
                type(error).__name__,
                error,
            )
            loading.path.unlink(missing_ok=True)
            if not loading.compiled_now:  # a file from before: made again
                regional = loading.path.name.endswith(".regional.bin")
                self._compile_in_background(loading.path, regional=regional)
            return current
        if not self._agrees(loading.forward):
            loading.path.unlink(missing_ok=True)
            return current
        self.regional = loading.path.name.endswith(".regional.bin")
        self._put_off_until = time.monotonic() + WHOLE_PUT_OFF_AT_MOST_S
        logger.info(
            "compiled forward swapped in (loaded in %.1fs)%s",
            time.monotonic() - loading.started,
            "; its layers compiled once, the whole graph compiles once the engine idles"
            if self.whole_later
            else "",
        )
        return loading.forward

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
            self.take_the_core_back()
        self.loading = self.whole_later = None

    def _checked(self, path: Path) -> Callable[..., torch.Tensor] | None:
        """A saved forward loaded and checked against the eager one; None (the file removed) if it fails."""
        try:
            forward = compiled_forward.load(path, self.model)
            if self._agrees(forward):
                return forward
        except Exception as e:  # a torch upgrade's format, a truncated file
            logger.warning("the saved compiled forward %s cannot be used (%s: %s)", path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None

    @torch.inference_mode()
    def _agrees(self, forward: Callable[..., torch.Tensor]) -> bool:
        """Whether `forward` computes what the eager model does on a dummy step of 32 tokens spread over the
        vocabulary (`compiled_forward.agrees`). Not the first ids: on special tokens' rarely trained rows
        bfloat16's rounding alone moved model S's output by a quarter (ids 1-32), against 0.02 here."""
        input_ids, positions, context = self._dummy_step(AGREEMENT_TOKENS)
        vocab = getattr(self.setup.hf_config, "vocab_size", None) or 1
        input_ids = (positions * 7919 + 1000) % vocab
        with context:
            eager = self.model(input_ids, positions)
        _, _, context = self._dummy_step(AGREEMENT_TOKENS)
        with context:
            compiled = forward(input_ids, positions)
        if compiled_forward.agrees(eager, compiled):
            return True
        eager, compiled = eager.float(), compiled.float()
        logger.warning(
            "the compiled forward disagrees with the eager one on a dummy step (relative error %.3g); "
            "running eagerly",
            float((eager - compiled).norm() / eager.norm()),
        )
        return False

    @torch.inference_mode()
    def _warm_up(self, compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Compile now rather than in the first request's step, on a two-token prompt that stores nothing.
        The token count is marked unbacked, so Dynamo neither specialises one token nor guards on the size:
        one graph serves every step. That is what batch-invariant mode needs (a lone decode runs the same
        generated code as a batch; a graph specialised to one token may sum a row in another order), and it
        is the default because it compiles in two thirds of the time of a one-token graph beside a dynamic
        one (model S, bfloat16, empty inductor cache, the AVX2 AMD machine: ready in 213-218 s against 333-340 s)
        with steps as fast (48 tokens alone 1.31-1.64 s against 1.44-1.71 s; 32 requests 7.81-8.75 s
        against 8.04-9.11 s). Returns the eager model, with a warning, on failure."""
        from torch._dynamo.decorators import mark_unbacked  # its import sets inductor's folder

        started = time.monotonic()
        input_ids, positions, context = self._dummy_step()
        mark_unbacked(input_ids, 0)
        mark_unbacked(positions, 0)
        try:
            with context:
                compiled(input_ids, positions)
        except Exception as e:  # an inductor or compiler failure: slower, not broken
            logger.warning("compiling the model failed, running it eagerly: %s: %s", type(e).__name__, e)
            return self.model
        logger.info("model compiled in %.1fs (--enforce-eager turns this off)", time.monotonic() - started)
        return compiled

    def _dummy_step(self, num_tokens: int = 2):
        """Input ids, positions and a forward context of a step that reads no cache and stores nothing."""
        attn = dummy_prefill(num_tokens, self.block_size, self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        context = set_forward_context(self.setup.backend.build_metadata(attn), self.kv_caches, self.layers)
        return input_ids, positions, context


def dummy_prefill(num_tokens: int, block_size: int, device: torch.device) -> AttentionBatch:
    """A one-request step of `num_tokens` new tokens that reads no cache and stores nothing (slot -1)."""
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionBatch(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.zeros(1, -(-num_tokens // block_size), dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )


class CoreYield:
    """The steps' threads, one fewer while a compile process or the kernels' background build runs (on two
    cores: one each). Those are niced so that they never slow a step, and with every core busy stepping one
    got ~10% of a core: on the AVX2 EPYC, model S's compile had not finished after 580 s of back-to-back
    requests, where on a free core it takes one to two minutes. A load beside the build is no better off
    with both: its parallel loops wait on the thread the build's compilers preempt (model M's Q4_K_M file
    loaded in 40 s beside the build, 4 s alone)."""

    def __init__(self, now: bool = False):
        """`now`: yield one at once (and, used as a context, take it back at its end)."""
        self._threads_before: int | None = None
        if now:
            self.yield_one()

    def __enter__(self) -> CoreYield:
        return self

    def __exit__(self, *exc: object) -> None:
        self.take_back()

    def yield_one(self) -> None:
        """Idempotent: one core is yielded however many builds ask."""
        threads = torch.get_num_threads()
        if threads > 1 and self._threads_before is None:
            self._threads_before = threads
            torch.set_num_threads(threads - 1)
            logger.info("stepping on %d thread(s) of %d while a background build runs", threads - 1, threads)

    def take_back(self) -> None:
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
