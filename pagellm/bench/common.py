"""What every `pagellm bench` run shares: its arguments (the model, the engine settings, the floor's machine
numbers, the JSON report's path), its engine config, the machine it measures against, its summary table and
its JSON report.

Runs default to bfloat16, as shared/bench/README.md asks; `engine["dtype"]` overrides it. Results go to
standard output, progress to standard error.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata as md
import json
import os
import platform as pyplatform
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagellm.bench.floor import Machine, measure_machine
from pagellm.bench.workloads import Workload, resolve_model, w1
from pagellm.core.config import NO_QUANTIZATION, EngineConfig

if TYPE_CHECKING:
    from pagellm.engine.llm import LLM


@dataclass
class ThroughputResult:
    """One engine's run of a workload; `extra` holds what only some runs have (batch size, TTFT, hit rate)."""

    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
        }


COLUMNS = (
    ("engine", "engine", "{}"),
    ("requests", "num_requests", "{}"),
    ("input tokens", "input_tokens", "{}"),
    ("output tokens", "output_tokens", "{}"),
    ("elapsed s", "elapsed_s", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("weights MiB", "weights_mib", "{:.1f}"),
    ("of floor", "fraction_of_floor", "{:.0%}"),
)


@dataclass(kw_only=True)
class BenchArgs:
    """The arguments every bench command takes."""

    model: str = "S"  # S (the embedded SmolLM2-135M), M (random Qwen2 shaped like Qwen2.5-0.5B) or a path
    engine: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig fields; None or absent: default
    output_json: str | None = None  # write the report here
    peak_tflops: float | None = None  # the floor's matmul peak; None: measured on the spot
    read_gb_s: float | None = None  # the floor's read bandwidth; None: measured on the spot

    def engine_config(self) -> EngineConfig:
        """The run's engine: `engine`'s settings on `model` (S and M resolved), in bfloat16 unless told;
        model S's file widened to that dtype unless --quantization says otherwise, as the workloads define
        it (`shared/bench/README.md`), where the engine would keep a GGUF file's blocks."""
        given = {k: v for k, v in self.engine.items() if v is not None}
        if self.model in (None, "S"):
            given.setdefault("quantization", NO_QUANTIZATION)
        return EngineConfig(
            **{**given, "model": resolve_model(self.model), "dtype": given.get("dtype") or "bfloat16"}
        )

    def machine(self, dtype: torch.dtype, device: str | torch.device) -> Machine:
        """This machine's matmul peak and read bandwidth (measured once per process unless both are given)."""
        if self.peak_tflops is None or self.read_gb_s is None:
            echo("measuring the matmul peak and the read bandwidth for the floor ...", err=True)
        machine = measure_machine(dtype, device, self.peak_tflops, self.read_gb_s)
        echo(cpu_line(cpu_features()))
        echo(
            f"machine: {machine.dtype} matmul peak {machine.peak_flops / 1e12:.2f} TFLOP/s, read "
            f"{machine.read_bytes_s / 1e9:.1f} GB/s, {machine.threads} threads"
            f" ({'measured now' if machine.measured else 'given'})",
            err=True,
        )
        return machine

    def llm_machine(self, llm: LLM) -> Machine:
        """`machine` for the dtype and device `llm` runs in."""
        return self.machine(llm.engine.setup.dtype, llm.engine.runner.device)


@dataclass(kw_only=True)
class W1Args(BenchArgs):
    """A bench command on W1: its size."""

    num_prompts: int = 64
    input_len_min: int = 64
    input_len_max: int = 512
    output_len_min: int = 16
    output_len_max: int = 256

    def w1(self, vocab_size: int) -> Workload:
        """The W1 requests of this size for a model with `vocab_size` ids."""
        return w1(
            vocab_size,
            self.num_prompts,
            (self.input_len_min, self.input_len_max),
            (self.output_len_min, self.output_len_max),
        )


def peer_exit(name: str, returncode: int, without_repacking: str) -> str:
    """'NAME exited with CODE'; for a crash, the signal and the llama.cpp flag that runs it without its AMX and
    repacked CPU kernels (`without_repacking`): on an AMX Xeon its AMX matmul faulted (SIGSEGV in
    ggml_backend_amx_mul_mat) on every Q4_0/Q4_1/Q8_0 and K-quant file, and ran with the flag."""
    if returncode >= 0:
        return f"{name} exited with {returncode}"
    try:
        killed_by = signal.Signals(-returncode).name
    except ValueError:
        killed_by = f"signal {-returncode}"
    return (
        f"{name} was killed by {killed_by} (exit {returncode}); llama.cpp's AMX and repacked CPU kernels "
        f'crash on some machines: --llama-args "{without_repacking}" runs it without them'
    )


def echo(message: str, err: bool = False) -> None:
    """One line to standard output (results) or standard error (progress), flushed."""
    print(message, file=sys.stderr if err else sys.stdout, flush=True)


def progress(result: ThroughputResult) -> None:
    """One line on stderr as each run ends, so a long benchmark shows its numbers before the table."""
    echo(
        f"{result.engine}: {result.output_tok_s:.1f} output tok/s, {result.total_tok_s:.1f} total tok/s "
        f"({result.elapsed_s:.1f} s)",
        err=True,
    )


def with_floor(row: dict[str, Any]) -> dict[str, Any]:
    """A result's row with its fraction of the floor as a column."""
    floor = row.get("extra", {}).get("floor")
    return {**row, "fraction_of_floor": floor["fraction_of_floor"]} if floor else row


def floor_row(floor: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A table row for the floor itself: its time and rates for the same tokens."""
    return {
        "engine": f"floor ({floor['bound']}-bound)",
        "num_requests": template["num_requests"],
        "input_tokens": template["input_tokens"],
        "output_tokens": template["output_tokens"],
        "elapsed_s": floor["floor_s"],
        "output_tok_s": template["output_tokens"] / floor["floor_s"],
        "total_tok_s": (template["input_tokens"] + template["output_tokens"]) / floor["floor_s"],
        "fraction_of_floor": 1.0,
    }


def _cell(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """`rows` as a text table: (title, key, format) per column; a key missing from a row is looked up in
    its "extra", and shows as "-" if absent there too."""
    cells = [[title for title, _, _ in columns]]
    cells += [
        [_cell(fmt, row.get(key, row.get("extra", {}).get(key))) for _, key, fmt in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def versions() -> dict[str, str]:
    """Python's and the main packages' versions."""
    found = {"python": pyplatform.python_version()}
    for name in ("pagellm", "torch", "transformers", "tokenizers", "numpy"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "not installed"
    return found


CPU_FEATURES = (
    ("amx", "AMX", ("amx_bf16", "amx_tile")),
    ("avx512_bf16", "AVX-512 BF16", ("avx512_bf16",)),
    ("avx512_vnni", "AVX-512 VNNI", ("avx512_vnni",)),
    ("avx512f", "AVX-512F", ("avx512f",)),
    ("avx2", "AVX2", ("avx2",)),
)
"""(key, name, the /proc/cpuinfo flags that all must be there): the x86 features that decide which kernels
are fast, pagellm's and llama.cpp's alike."""


def cpu_features(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of `CPU_FEATURES` it has, from /proc/cpuinfo's text (read when not
    given; its first processor's lines). `flags_listed` is False where there is no x86 flags line (another
    architecture, or no /proc): the features are then unknown, not absent."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or pyplatform.processor() or pyplatform.machine() or "unknown CPU"
    found: dict[str, Any] = {"model": model, "flags_listed": bool(flags)}
    found.update({key: set(needs) <= flags for key, _, needs in CPU_FEATURES})
    return found


def cpu_line(features: dict[str, Any]) -> str:
    """`cpu_features` in one line: "CPU: AMD EPYC 7B13 (AVX2; no AVX-512, no AMX)"."""
    if not features["flags_listed"]:
        return f"CPU: {features['model']} (no x86 feature flags in /proc/cpuinfo)"
    has = [name for key, name, _ in CPU_FEATURES if features[key]]
    missing = [name for key, name, _ in reversed(CPU_FEATURES) if not features[key]]  # no AVX2 first
    if not features["avx512f"]:  # then none of AVX-512: one word for the three
        missing = [m for m in missing if not m.startswith("AVX-512")]
        missing.insert(1 if missing[:1] == ["AVX2"] else 0, "AVX-512")
    parts = [", ".join(has)] if has else []
    parts += [", ".join(f"no {m}" for m in missing)] if missing else []
    return f"CPU: {features['model']} ({'; '.join(parts)})"


def write_json(path: str | None, command: str, config: EngineConfig, **sections: Any) -> None:
    """The run's report, if `path` is given: the command, the date, the versions, the machine, the engine
    config and `sections`."""
    if path is None:
        return
    report = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "machine": {
            "platform": pyplatform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cpu": cpu_features(),
        },
        "config": dataclasses.asdict(config),
        **sections,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    echo(f"wrote {path}")
