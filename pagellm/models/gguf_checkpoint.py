"""GGUF checkpoints (llama.cpp's single-file format) as a Hugging Face config, tokenizer and weights.

transformers reads the config and tokenizer and knows llama.cpp's tensor names and layouts (including the
reversal of its q/k row permutation); this module streams the tensors through that knowledge one at a time,
dequantized to float32, so the model loads them like any checkpoint. The config fields transformers' reader
drops are filled in from the file by models/gguf_config.py.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): llama.cpp stacks each layer's experts into one tensor
per projection, `blk.N.ffn_gate_exps` / `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (numpy order).
They come out one expert at a time under the per-expert names `FusedMoE` reads
(`<mlp>.experts.{e}.gate_proj.weight`), each dequantized on its own, so at most one expert's float copy is
held. Under `--quantization gguf` (raw_linear) each stacked tensor comes whole as the file's bytes
(`<mlp>.experts.gate_proj.qweight`, uint8 [E, rows, bytes per row], with its `qweight_type`), which the
layer keeps as blocks where the CPU kernel reads the type or dequantizes itself (`FusedMoE`).

Reading is the slow part of a start: gguf's `GGUFReader` slices its numpy memmap once per metadata string
(~100k for a 49k-token vocabulary), and each memmap slice costs microseconds in numpy's subclass hooks: 5.4 s
for SmolLM2's file, against 1.9 s on a plain-ndarray view of the same mapping (`_PlainGGUFReader`).
transformers builds its own reader for the config and again for the tokenizer, so both calls run with the
plain reader in place (`_plain_gguf_reader`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagellm.core.errors import ConfigError
from pagellm.core.progress import progress
from pagellm.models.gguf_config import fill_gguf_config
from pagellm.models.gguf_header import gguf_architecture
from pagellm.models.gguf_names import gguf_hf_names
from pagellm.models.loader import CheckpointSlice


def load_gguf(path: str | os.PathLike) -> tuple[Any, Any, Iterator[tuple[str, torch.Tensor]]]:
    """(HF config, tokenizer, lazy iterator of (HF tensor name, float32 tensor)) for a .gguf file.

    The config's `architectures` is filled from its model type (GGUF files do not name the class)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")
    with _plain_gguf_reader() as shared_reader:
        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except ValueError as exc:
            raise ConfigError(f"transformers cannot read the GGUF file {path}: {exc}") from exc
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        reader = shared_reader(path)
    config = fill_gguf_config(config, reader)
    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
    return config, tokenizer, _weights(reader, config, raw_linear=False)


def iter_gguf_weights(
    path: str | os.PathLike, hf_config, raw_linear: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the GGUF file that the HF model of `hf_config` has.

    raw_linear: decoder linear weights come as `<prefix>.qweight` (their raw GGUF bytes, uint8 [out, bytes])
    plus `<prefix>.qweight_type` (the GGML type), for the `gguf` quantization method that keeps them packed
    (a layer's stacked experts likewise, uint8 [E, rows, bytes] under `<mlp>.experts.<projection>.`);
    a token embedding or output projection in a block type comes as floats and also as
    `<prefix>.gguf_table` / `<prefix>.gguf_table_type`, its bytes and type."""
    return _weights(_open_for_weights(path), hf_config, raw_linear)


def _open(path: str | os.PathLike) -> Any:
    """A reader of the file on a plain-ndarray view of its memmap (see the module docstring)."""
    return _plain_reader_class()(str(path))


@functools.cache
def _plain_reader_class() -> type:
    """GGUFReader whose buffer is a plain ndarray: the same bytes and fields, without memmap's slice hooks,
    and arrays of strings (the vocabulary, the merges) split in one pass: each string's length and bytes as
    gguf's own parts, sliced straight off the buffer rather than through gguf's generic walk (two typed
    views per string: 2.9 s for model M's 151k-token file, 0.5 s this way)."""
    import struct

    import gguf
    import numpy

    class PlainGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> numpy.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: numpy.ndarray) -> None:
            # The view keeps the memmap (its base) and so the mapping alive.
            self._plain_data = mapped.view(numpy.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order == "S":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, numpy.uint32)
            itype = gguf.GGUFValueType(int(raw_itype[0]))
            alen = self._get(orig_offs + 4, numpy.uint64)
            data, offs, count = self.data, orig_offs + 12, int(alen[0])
            parts: list = [raw_itype, alen]
            if itype == gguf.GGUFValueType.STRING:
                view = memoryview(data)
                for _ in range(count):  # each item: a u64 length, then its bytes
                    size = struct.unpack_from("<Q", view, offs)[0]
                    parts += (data[offs : offs + 8].view(numpy.uint64), data[offs + 8 : offs + 8 + size])
                    offs += 8 + size
                indices = list(range(3, len(parts), 2))
            elif itype in self.gguf_scalar_to_np:  # the token types, the scores: one view, a part per item
                dtype = numpy.dtype(self.gguf_scalar_to_np[itype])
                items = data[offs : offs + count * dtype.itemsize].view(dtype)
                parts += (items[i : i + 1] for i in range(count))
                offs += count * dtype.itemsize
                indices = list(range(2, len(parts)))
            else:  # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            types = [gguf.GGUFValueType.ARRAY] + [itype] * (count > 0)
            return offs - orig_offs, parts, indices, types

    return PlainGGUFReader


def _open_for_weights(path: str | os.PathLike) -> Any:
    """A reader of the file's tensors and scalar fields: its arrays (the vocabulary, merges and scores, read
    from the converted copy's tokenizer) are stepped over, not read, which cut the parse of model M's
    151k-token file from 3.0 s to a fraction of a second. Their fields hold no items."""
    return _weights_reader_class()(str(path))


@functools.cache
def _weights_reader_class() -> type:
    import struct

    import gguf

    class WeightsGGUFReader(_plain_reader_class()):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order == "S":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, count = orig_offs + 12, int(alen[0])
            itype = gguf.GGUFValueType(int(raw_itype[0]))
            if itype == gguf.GGUFValueType.STRING:
                view = memoryview(self.data)
                for _ in range(count):  # each item: a u64 length, then its bytes
                    offs += 8 + struct.unpack_from("<Q", view, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:  # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [raw_itype, alen], [], [gguf.GGUFValueType.ARRAY]

    return WeightsGGUFReader


_READER_SWAP = threading.Lock()


@contextlib.contextmanager
def _plain_gguf_reader() -> Iterator[Callable[[str | os.PathLike], Any]]:
    """transformers' GGUF loaders, which import `gguf.GGUFReader` when called, get the plain reader meanwhile,
    and one per file: the config's and the tokenizer's loads (and the caller, through the function yielded)
    share a parse, which is most of a GGUF's conversion (~2 s each for SmolLM2's 49k-token vocabulary). They
    only read it. Two more of transformers' steps are shared or sped up the same way: its legacy
    `load_gguf_checkpoint`, which the config and the tokenizer each ran (1 s each for model M's file: every
    vocabulary string and merge turned into Python), runs once per file; its own metadata reader reads a
    plain view of the mapping rather than the memmap (the vocabulary's strings: 3x faster).

    The lock keeps two loads in threads from restoring each other's swap out of order."""
    import gguf

    readers: dict[str, Any] = {}
    reader_class = _plain_reader_class()  # made before the swap: it subclasses gguf's own

    def shared(path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = reader_class(str(path), *args, **kwargs)
        return readers[key]

    with _READER_SWAP, contextlib.ExitStack() as swaps:
        original = gguf.GGUFReader
        gguf.GGUFReader = shared
        swaps.callback(setattr, gguf, "GGUFReader", original)
        _swap_transformers_gguf_steps(swaps)
        yield shared


def _swap_transformers_gguf_steps(swaps: contextlib.ExitStack) -> None:
    """`load_gguf_checkpoint` without tensors memoized per file (each caller gets its own copy of the config
    part, which it may change; the tokenizer's lists are only read), and the metadata reader's map a plain
    ndarray (a view: the memmap, its base, stays alive with it). Either step is left alone where this
    transformers has no such function."""
    import copy
    import importlib

    def swap(module_name: str, name: str, make: Callable[[Any], Any]) -> None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        original = getattr(module, name, None)
        if original is not None:
            setattr(module, name, make(original))
            swaps.callback(setattr, module, name, original)

    def memoized(load: Callable[..., dict]) -> Callable[..., dict]:
        parsed: dict[str, dict] = {}

        def load_once(path: Any, return_tensors: bool = False, **kwargs: Any) -> dict:
            if return_tensors or kwargs:
                return load(path, return_tensors=return_tensors, **kwargs)
            key = str(Path(path).resolve())
            if key not in parsed:
                parsed[key] = load(path, return_tensors=False)
            return {part: copy.deepcopy(v) if part == "config" else v for part, v in parsed[key].items()}

        return load_once

    swap("transformers.modeling_gguf_pytorch_utils", "load_gguf_checkpoint", memoized)
    swap("transformers.modeling_gguf_pytorch_utils", "_gguf_parse_value", _direct_parse)
    swap(
        "transformers.integrations.gguf.reader",
        "_mapped",
        lambda mapped: lambda p: mapped(p).view(np.ndarray),
    )


_GGUF_INTEGERS = frozenset((0, 1, 2, 3, 4, 5, 10, 11))
_GGUF_FLOATS = frozenset((6, 12))
_GGUF_STRING, _GGUF_BOOL, _GGUF_ARRAY = 8, 7, 9


def _direct_parse(parse: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """transformers' `_gguf_parse_value` with the same results and less on the way: called once for each of
    the vocabulary's strings, types and merges (model M's file: 455k calls, 1.2 s of an empty-cache start),
    it goes through its type list and a recursion for every element and reads a string's bytes one by one
    into a list. Anything else goes to `parse` itself."""

    def parse_value(value: Any, data_type: Any) -> Any:
        kind = data_type
        if type(kind) is list:
            if len(kind) == 1:
                kind = kind[0]
            elif len(kind) == 2 and kind[0] == _GGUF_ARRAY:
                kind = kind[1]
            else:
                return parse(value, data_type)
        if kind in _GGUF_INTEGERS:
            return int(value[0])
        if kind == _GGUF_STRING:
            return bytes(value).decode()
        if kind in _GGUF_FLOATS:
            return float(value[0])
        if kind == _GGUF_BOOL:
            return bool(value[0])
        return parse(value, data_type)

    return parse_value


def _weights(reader: Any, hf_config, raw_linear: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_gguf_weights on a file already open (load_gguf's reader, which filled the config)."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    architecture = read_field(reader, "general.architecture")[0]
    if raw_linear and architecture not in _RAW_LINEAR_ARCHITECTURES:
        raise ConfigError(
            f"--quantization gguf keeps weights packed only for {', '.join(sorted(_RAW_LINEAR_ARCHITECTURES))} "
            f"GGUF files, not {architecture!r}; --quantization none dequantizes it at load"
        )
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    names = gguf_hf_names(architecture, hf_config)
    experts, routers, shared_gates = _moe_tensors(hf_config.num_hidden_layers)
    # a bar at a terminal: widening a large file's tensors to float32 takes minutes
    for tensor in progress(reader.tensors, desc="GGUF tensors", unit="tensor"):
        if tensor.name in experts:
            split = _stacked_experts if raw_linear else _split_experts
            yield from split(
                tensor, _experts_prefix(tensor, names, experts[tensor.name][0]), experts[tensor.name][1]
            )
            continue
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        if tensor.name in shared_gates:
            # [1, H] as llama.cpp's converter writes it, [H] in older files; transformers' processor
            # would add a dimension to either
            gate = dequantize(tensor.data, tensor.tensor_type).reshape(1, -1)
            yield hf_name, _float_tensor(gate)
            continue
        # routers are plain linears in the model (and float32 in llama.cpp's files)
        raw = (
            raw_linear
            and ".layers." in hf_name
            and hf_name.endswith(".weight")
            and len(tensor.shape) == 2
            and tensor.name not in routers
        )
        if raw_linear and hf_name in _TABLES and int(tensor.tensor_type) not in _FLOAT_TYPES:
            # the token embedding or output projection in blocks: its bytes first, for the method to pack
            # as they come (`GgufMethod.checkpoint_weights`), then its float weight, made only if the
            # loader copies it (where the method could not pack the table, or until the kernels are built)
            prefix = hf_name.removesuffix("weight")
            yield prefix + "gguf_table", _read_only_tensor(np.asarray(tensor.data).view(np.uint8))
            yield prefix + "gguf_table_type", torch.tensor(int(tensor.tensor_type))
            yield hf_name, _DeferredTable(tensor, processor, names)
            continue
        data = (
            np.ascontiguousarray(tensor.data).view(np.uint8)
            if raw
            else _dequantize(tensor.data, tensor.tensor_type)
        )
        # the llama processor only reorders q/k rows, as valid for rows of packed blocks as for floats; the
        # Gemma one subtracts the 1 llama.cpp adds to norm weights
        data = processor.process(
            weights=data, name=tensor.name, tensor_key_mapping=names, parsed_parameters={"tensors": {}}
        ).weights
        if raw:
            prefix = hf_name.removesuffix("weight")
            yield prefix + "qweight", _read_only_tensor(data)
            yield prefix + "qweight_type", torch.tensor(int(tensor.tensor_type))
            continue
        yield hf_name, _float_tensor(data)


def _dequantize(data: np.ndarray, type_id: int) -> np.ndarray:
    """gguf's `dequantize`, through the CPU kernels' `gguf_dequantize` (the same float32 bits, ~10x faster:
    model M's Q4_K token embedding took 1.2 s in numpy) where this process has them loaded already (never
    built for this: a GPU start would wait on a CPU build), else the vectorised torch one of the types it
    has (`quantization.gguf.GGML_TYPES`, the same bits too)."""
    from gguf import dequantize

    from pagellm.platforms import cpu_kernels
    from pagellm.quantization import gguf as gguf_method

    kernels = cpu_kernels.loaded()
    if int(type_id) in _FLOAT_TYPES or data.dtype != np.uint8 or data.ndim != 2:
        return dequantize(data, type_id)
    if kernels is None:
        if int(type_id) not in gguf_method.GGML_TYPES:
            return dequantize(data, type_id)
        return gguf_method.dequantize(_read_only_tensor(data), int(type_id), torch.float32).numpy()
    try:
        return kernels.gguf_dequantize(_read_only_tensor(data), int(type_id)).numpy()
    except RuntimeError:  # a type the kernels do not read (IQ formats but IQ4)
        return dequantize(data, type_id)


class _DeferredTable(CheckpointSlice):
    """A token table's float32 weight, dequantized when the loader copies it (`load`, `narrow`), never where
    the `gguf` method packed the table from its blocks instead: model E's two tables took 0.9 s of a 2.5 s
    start to dequantize and copy, for weights then dropped."""

    def __init__(self, tensor: Any, processor: Any, names: dict[str, str]):  # not a safetensors slice
        from gguf import GGML_QUANT_SIZES

        self._tensor, self._processor, self._names = tensor, processor, names
        block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        rows, row_bytes = tensor.data.shape
        self.shape = torch.Size((rows, row_bytes // block_bytes * block_size))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.load().narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        tensor = self._tensor
        data = _dequantize(tensor.data, tensor.tensor_type)
        data = self._processor.process(
            weights=data, name=tensor.name, tensor_key_mapping=self._names, parsed_parameters={"tensors": {}}
        ).weights
        return _float_tensor(data)


def _float_tensor(values: np.ndarray) -> torch.Tensor:
    """Dequantized values as a float32 tensor, copied only where they are not float32 already: the model
    copies them into its parameters, so a second copy here only cost time (model M's token table, 545 MB of
    float32, took 0.7 s to copy)."""
    return _read_only_tensor(np.asarray(values, dtype=np.float32))


def _read_only_tensor(data: np.ndarray) -> torch.Tensor:
    """The file's mapped bytes as a tensor that is only read, not copied (torch warns that it cannot be
    written). Blocks kept packed stay in the file's mapping: shared page cache, no copy at load (model M's
    Q4_K_M: half a second of its start went to copying 380 MB it then only read), and nothing writes
    them (the kernels read them; interleaving and widening write new tensors)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data))


# GGUF architectures whose tensor processor leaves linear weight rows intact (gpt2's transposes them; the
# Gemma one only shifts norms back; Phi-3's fused q/k/v and gate/up rows split in its model; the Qwen MoE
# one only sees the tensors other than the experts)
_RAW_LINEAR_ARCHITECTURES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3"}
)


def blocks_kept_for(path: str | os.PathLike) -> str | None:
    """Why `--quantization gguf` cannot keep this file's linear weights as its blocks (its architecture is
    not one whose tensors `iter_gguf_weights` hands over raw); None where it can."""
    architecture = gguf_architecture(path)
    if architecture in _RAW_LINEAR_ARCHITECTURES:
        return None
    return (
        f"it keeps blocks for {', '.join(sorted(_RAW_LINEAR_ARCHITECTURES))} files, not "
        f"{architecture if architecture is not None else 'this file'}"
    )


_TABLES = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
"""Tensors other than the decoder's linears that `--quantization gguf` keeps in the file's blocks."""
_FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16: loaded as floats

_EXPERT_PROJECTIONS = {"FFN_GATE_EXP": "gate_proj", "FFN_UP_EXP": "up_proj", "FFN_DOWN_EXP": "down_proj"}
"""gguf's stacked expert tensors -> the per-expert checkpoint module FusedMoE reads."""


def _moe_tensors(layers: int) -> tuple[dict[str, tuple[int, str]], set[str], set[str]]:
    """From gguf's name table, for `layers` decoder layers: the stacked expert tensors (GGUF name -> (layer,
    per-expert module)), the routers' names and the shared-expert gates' names."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    def name(kind: str, bid: int) -> str:
        return TENSOR_NAMES[MODEL_TENSOR[kind]].format(bid=bid) + ".weight"

    experts = {
        name(kind, bid): (bid, module)
        for kind, module in _EXPERT_PROJECTIONS.items()
        for bid in range(layers)
    }
    routers = {name("FFN_GATE_INP", bid) for bid in range(layers)}
    return experts, routers, {name("FFN_GATE_INP_SHEXP", bid) for bid in range(layers)}


def _experts_prefix(tensor: Any, names: dict[str, str], layer: int) -> str:
    """`<mlp>.experts`, `<mlp>` the HF module holding layer `layer`'s router."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    router = names.get(TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP].format(bid=layer) + ".weight")
    if router is None:
        raise ConfigError(f"GGUF tensor {tensor.name}: the model has no mixture of experts in layer {layer}")
    return router.removesuffix(".weight").rpartition(".")[0] + ".experts"


def _split_experts(tensor: Any, prefix: str, module: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor as (`<prefix>.{e}.<module>.weight`, float32 [rows, columns]) per expert,
    each expert read and dequantized alone."""
    for expert in range(tensor.data.shape[0]):
        data = _dequantize(tensor.data[expert], tensor.tensor_type)
        yield f"{prefix}.{expert}.{module}.weight", _float_tensor(data)


def _stacked_experts(tensor: Any, prefix: str, module: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor as it is, for a method that keeps blocks: `<prefix>.<module>.qweight`
    (uint8 [E, rows, bytes per row], the file's mapped bytes) and `.qweight_type`."""
    data = np.asarray(tensor.data).view(np.uint8)
    yield f"{prefix}.{module}.qweight_type", torch.tensor(int(tensor.tensor_type))
    yield f"{prefix}.{module}.qweight", _read_only_tensor(data.reshape(data.shape[0], data.shape[1], -1))


# raised when the converted copy changes for the same file (2: the config fields gguf_config.py fills; 3:
# mixtures of experts), so copies converted before are redone
_CONVERSION = 3


def gguf_checkpoint_dir(path: str | os.PathLike, cache_root: str | os.PathLike) -> Path:
    """A Hugging Face directory (config, tokenizer) converted from a GGUF file once; its float32 weights
    are written when a start first reads them (`gguf_checkpoint_weights`), so one that reads the file's
    blocks (`--quantization gguf`) never writes them (model E's took a minute beside the kernels' build).

    Parsing a GGUF file's metadata takes seconds (tens of thousands of vocabulary strings) and
    transformers parses it again for the config and the tokenizer; the converted copy loads in a fraction
    of that. Keyed by the file's path, size and modification time, and by _CONVERSION."""
    path = Path(path).resolve()
    out = _converted_path(path, cache_root)
    if (out / "config.json").exists():
        return out
    config, tokenizer, _ = load_gguf(path)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out)
    return out


def gguf_checkpoint_weights(path: str | os.PathLike, cache_root: str | os.PathLike) -> Path:
    """The converted directory of `gguf_checkpoint_dir` with the file's weights in it as float32
    safetensors (`model.safetensors`, written once, the first time a start reads them)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out = gguf_checkpoint_dir(path, cache_root)
    target = out / "model.safetensors"
    if target.exists():
        return out
    config = AutoConfig.from_pretrained(out)
    weights = _weights(_open_for_weights(Path(path).resolve()), config, raw_linear=False)
    partial = out / f"model.safetensors.tmp{os.getpid()}"
    save_file({name: tensor.contiguous() for name, tensor in weights}, str(partial))
    partial.replace(target)
    return out


def converted_copy(path: str | os.PathLike, cache_root: str | os.PathLike) -> Path | None:
    """The converted copy `gguf_checkpoint_dir` made of this file, or None where none is made yet."""
    out = _converted_path(Path(path).resolve(), cache_root)
    return out if (out / "config.json").exists() else None


def _converted_path(path: Path, cache_root: str | os.PathLike) -> Path:
    import hashlib

    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERSION}".encode()).hexdigest()[:16]
    return Path(cache_root) / "gguf" / f"{path.stem}-{key}"
