"""A GGUF file's scalar header fields read straight from its first bytes: the key-value pairs in order, arrays
(the vocabulary, merges, scores) stepped over. A few reads where the gguf package's reader would parse every
field and tensor; imports nothing heavy, so the server can ask too."""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

_STRING = 8  # GGUF value types: a string, an array; the scalar ones by their struct format
_ARRAY = 9
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _take(f: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated")
    return struct.unpack(fmt, data)


def gguf_header_field(path: str | os.PathLike, key: str) -> str | int | float | bool | None:
    """The value of the string or scalar field `key`; None where the file is not a little-endian GGUF, lacks
    the field, or holds an array there."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            (version,) = _take(f, "<I")
            if version > 0xFFFF:  # a big-endian file
                return None
            _, fields = _take(f, "<QQ")
            for _ in range(fields):
                name = f.read(_take(f, "<Q")[0]).decode("utf-8", "replace")
                (kind,) = _take(f, "<I")
                if kind == _STRING:
                    value = f.read(_take(f, "<Q")[0])
                    if name == key:
                        return value.decode("utf-8", "replace")
                elif kind in _SCALARS:
                    (value,) = _take(f, _SCALARS[kind])
                    if name == key:
                        return value
                elif kind == _ARRAY:
                    item, count = _take(f, "<IQ")
                    if name == key:
                        return None
                    if item == _STRING:
                        for _ in range(count):
                            f.seek(_take(f, "<Q")[0], os.SEEK_CUR)
                    elif item in _SCALARS:
                        f.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
                    else:
                        return None
                else:
                    return None
    except (OSError, ValueError):
        return None
    return None


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """The file's `general.architecture` (llama.cpp writes it first); None where there is none."""
    value = gguf_header_field(path, "general.architecture")
    return value if isinstance(value, str) else None


def gguf_file_type(path: str | os.PathLike) -> str | None:
    """What the file's `general.file_type` names, as llama.cpp and Ollama print it (`Q4_K_M`, `Q8_0`, `BF16`);
    None where the field is missing or unknown."""
    value = gguf_header_field(path, "general.file_type")
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    import gguf

    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return None
