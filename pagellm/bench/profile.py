"""Where a step's time goes: attention, linears, lm_head, sampling, other layers, and Python around them.

Timing hooks are attached from the bench side only (nothing in the model changes): forward hooks on the
model, on every `Attention` layer (the backend's forward: cache writes and attention itself) and on every
`Linear` (lm_head excluded); the model's `compute_logits` and the runner's `sampler` are wrapped on their
instances. What the hooks do not cover splits into "other layers" (inside the model forward: norms,
rotary, activations, embeddings) and "Python and other" (outside it: scheduling, input preparation,
output processing, detokenization). A few decode steps also run under `torch.profiler`, for the
op-level table; those steps are left out of the breakdown.

Hooks see modules only in eager mode: under a compiled forward they may not fire (the table then says
so); profile with --enforce-eager for a faithful split.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from pagellm.engine.llm import LLM
from pagellm.sampling.params import SamplingParams

PARTS = (
    ("attention", "attention"),
    ("linears", "linears (decoder)"),
    ("lm_head", "lm_head (logits)"),
    ("sampling", "sampling"),
    ("other_layers", "other layers (norms, rotary, act., embed.)"),
    ("python", "Python and other (scheduler, inputs, outputs)"),
)


class _Hooks:
    """Accumulated seconds per part, from hooks and wrappers installed on one engine's instances."""

    def __init__(self, llm: LLM):
        from pagellm.models.layers.attention import Attention
        from pagellm.models.layers.linear import Linear

        runner = llm.engine.runner
        self.runner, self.model = runner, runner.model
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._cuda = getattr(runner, "device", torch.device("cpu")).type == "cuda"
        self._handles: list[Any] = []
        lm_head = getattr(self.model, "lm_head", None)
        self._hook(self.model, "forward")
        for module in self.model.modules():
            if isinstance(module, Attention):
                self._hook(module, "attention")
            elif isinstance(module, Linear) and module is not lm_head:
                self._hook(module, "linears")
        self._wrapped: list[tuple[Any, str, Any]] = []
        self._wrap(self.model, "compute_logits", "lm_head")
        if hasattr(runner, "sampler"):
            self._wrap(runner, "sampler", "sampling")

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _hook(self, module: torch.nn.Module, part: str) -> None:
        started: list[float] = []

        def pre(_module, _args):
            started.append(self._now())

        def post(_module, _args, _out):
            self.totals[part] += self._now() - started.pop()
            self.calls[part] += 1

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            began = self._now()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[part] += self._now() - began
                self.calls[part] += 1

        if isinstance(owner, torch.nn.Module) and isinstance(inner, torch.nn.Module):
            # a submodule cannot be replaced by a function; time it with hooks instead
            self._hook(inner, part)
            return
        own = name in vars(owner)  # an instance attribute (restore it) or the class's method (uncover it)
        object.__setattr__(owner, name, timed)
        self._wrapped.append((owner, name, inner if own else None))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, name, original in self._wrapped:
            if original is None:
                object.__delattr__(owner, name)
            else:
                object.__setattr__(owner, name, original)

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def _split(step_s: float, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    forward = delta.get("forward", 0.0)
    parts = {
        "attention": delta.get("attention", 0.0),
        "linears": delta.get("linears", 0.0),
        "lm_head": delta.get("lm_head", 0.0),
        "sampling": delta.get("sampling", 0.0),
    }
    parts["other_layers"] = max(0.0, forward - parts["attention"] - parts["linears"])
    parts["python"] = max(0.0, step_s - forward - parts["lm_head"] - parts["sampling"])
    parts["step"] = step_s
    return parts


def profile_latency(
    llm: LLM,
    prompts: list[list[int]],
    output_len: int,
    op_table_steps: int | None = None,
    op_table_rows: int = 15,
) -> dict[str, Any]:
    """Run the batch once more with the hooks on: the mean split of a prefill and of a decode step (ms),
    the torch.profiler op table of `op_table_steps` decode steps (default: 3, at most half of them), and
    the hook call counts."""
    if op_table_steps is None:
        op_table_steps = min(3, (output_len - 1) // 2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    hooks = _Hooks(llm)
    sums: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    counts = {"prefill": 0, "decode": 0}
    profiler, profiled, decode_index = None, 0, 0
    try:
        ids = {engine.add_request({"prompt_token_ids": p}, params) for p in prompts}
        started: set[str] = set()
        while engine.has_unfinished_requests():
            phase = "decode" if started == ids else "prefill"
            in_op_table = phase == "decode" and 1 <= decode_index <= op_table_steps
            if in_op_table and profiler is None:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            before = hooks.snapshot()
            began = time.perf_counter()
            outputs = engine.step()
            step_s = time.perf_counter() - began
            if phase == "decode":
                decode_index += 1
            if in_op_table:
                profiled += 1
                if decode_index > op_table_steps:
                    profiler.__exit__(None, None, None)
            else:
                for part, seconds in _split(step_s, before, hooks.snapshot()).items():
                    sums[phase][part] += seconds
                counts[phase] += 1
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    finally:
        hooks.remove()
        if profiler is not None and decode_index <= op_table_steps:
            profiler.__exit__(None, None, None)
    result: dict[str, Any] = {"hook_calls": dict(hooks.calls)}
    for phase in ("prefill", "decode"):
        n = counts[phase]
        if n:
            result[phase] = {"steps": n, **{f"{k}_ms": v / n * 1000 for k, v in sums[phase].items()}}
    if profiler is not None and profiled:
        averages = profiler.key_averages()
        result["op_table_steps"] = profiled
        result["op_table"] = averages.table(sort_by="self_cpu_time_total", row_limit=op_table_rows)
        ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:op_table_rows]
        result["top_ops"] = [
            {"name": e.key, "calls": e.count, "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / profiled}
            for e in ranked
        ]
    return result


def format_profile(profile: dict[str, Any]) -> str:
    """The breakdown as a table: ms per step and share, for decode and prefill steps."""
    phases = [p for p in ("decode", "prefill") if p in profile]
    if not phases:
        return "profile: no steps recorded"
    header = ["part"] + [f"{p} ms/step" for p in phases] + [f"{p} share" for p in phases]
    rows = [header]
    for key, title in PARTS:
        row = [title]
        row += [f"{profile[p][key + '_ms']:.2f}" for p in phases]
        row += [f"{profile[p][key + '_ms'] / profile[p]['step_ms']:.0%}" for p in phases]
        rows.append(row)
    rows.append(
        ["step (hooks on)"] + [f"{profile[p]['step_ms']:.2f}" for p in phases] + ["100%" for _ in phases]
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    counts = ", ".join(f"{p}: {profile[p]['steps']} steps" for p in phases)
    out = [f"step breakdown ({counts}; timing hooks on)", *lines]
    calls = profile.get("hook_calls", {})
    if not calls.get("attention") or not calls.get("linears"):
        out.append(
            "note: the attention/linear hooks did not fire (a compiled forward, or the native decode step, "
            "which runs a decode step in one call); rerun with --enforce-eager --no-native-decode"
        )
    return "\n".join(out)
