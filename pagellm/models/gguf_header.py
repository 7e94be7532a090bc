"""A GGUF file's scalar header fields read straight from its first bytes: the key-value pairs in order, arrays
(the vocabulary, merges, scores) stepped over. A few reads where the gguf package's reader would parse every
field and tensor; imports nothing heavy, so the server can ask too."""

from __future__ import annotations

import mmap
import os
import struct

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


class _Cursor:
    """Reads little-endian values from a mapped file, one position moving on."""

    def __init__(self, data: mmap.mmap):
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.data, self.at)  # struct.error past the end
        self.at += struct.calcsize(fmt)
        return values

    def bytes(self) -> bytes:
        (size,) = self.take("<Q")
        value = self.data[self.at : self.at + size]
        self.at += size
        return value

    def skip_strings(self, count: int) -> None:
        data, at, unpack = self.data, self.at, _U64.unpack_from
        for _ in range(count):  # the vocabulary's and merges' 150k strings: ~20 ms a 151,936-token array
            at += 8 + unpack(data, at)[0]
        self.at = at


_U64 = struct.Struct("<Q")


def gguf_header_field(path: str | os.PathLike, key: str) -> str | int | float | bool | None:
    """The value of the string or scalar field `key`; None where the file is not a little-endian GGUF, lacks
    the field, or holds an array there."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return None
            cursor = _Cursor(data)
            cursor.at = 4
            (version,) = cursor.take("<I")
            if version > 0xFFFF:  # a big-endian file
                return None
            _, fields = cursor.take("<QQ")
            for _ in range(fields):
                name = cursor.bytes().decode("utf-8", "replace")
                (kind,) = cursor.take("<I")
                if kind == _STRING:
                    value = cursor.bytes()
                    if name == key:
                        return value.decode("utf-8", "replace")
                elif kind in _SCALARS:
                    (value,) = cursor.take(_SCALARS[kind])
                    if name == key:
                        return value
                elif kind == _ARRAY:
                    item, count = cursor.take("<IQ")
                    if name == key:
                        return None
                    if item == _STRING:
                        cursor.skip_strings(count)
                    elif item in _SCALARS:
                        cursor.at += count * struct.calcsize(_SCALARS[item])
                    else:
                        return None
                else:
                    return None
    except (OSError, ValueError, struct.error):
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
