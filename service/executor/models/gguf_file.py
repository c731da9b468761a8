"""A GGUF file's metadata scalars and tensor directory, read without materializing its metadata arrays.

gguf.GGUFReader builds a numpy view for every element of every metadata array: a 49k-token vocabulary and its
merges cost seconds at each open. Loading weights needs only the scalars (the architecture, the alignment) and
where each tensor lies, so the header is read with struct, the arrays are stepped over (the vocabulary is read
only for the tokenizer, as plain lists), and the tensor bytes are mapped from the file in place. The type table
stays gguf's (GGML_QUANT_SIZES).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class GgufTensor:
    """One tensor as stored: its GGML type, its dims innermost first (as the file lists them), its raw bytes."""

    type_name: str
    dims: tuple[int, ...]
    data: np.ndarray  # uint8, mapped from the file
    mapping: mmap.mmap | None = None  # the file's, where `data` lies
    offset: int = 0  # of `data` in it

    def rows(self, dtype=np.uint8) -> np.ndarray:
        """The bytes as rows: [outer dims..., innermost] of `dtype` (float types), [rows, row bytes] (blocks)."""
        if dtype != np.uint8:
            return self.data.view(dtype).reshape(self.dims[::-1])
        return self.data.reshape(prod(self.dims[1:]), -1)

    def release(self) -> None:
        """Drop this tensor's pages from the process's resident set once its bytes are copied (the page cache keeps
        them; a neighbour's page read again faults back in): a load that reads the whole file otherwise holds all
        of it resident until its mapping closes, the file's size on top of the load's peak."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, self.offset + self.data.nbytes - start)


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.at = memoryview(buf), 0  # a memoryview slices to bytes at a fraction of numpy's cost

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        self.at += n
        if self.at > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return str(self.buf[self.at - n:self.at], "utf-8", "replace")

    def value(self, kind: int, keep: bool = False):
        """A scalar or a string; an array is stepped over (None), or read as a list where `keep`."""
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.read("I"), self.read("Q")
        if keep and item in _SCALARS:
            values = np.frombuffer(self.buf, "<" + _SCALARS[item], count, self.at).tolist()
            self.at += count * struct.calcsize("<" + _SCALARS[item])
            return values
        if keep and item == _STRING:
            return [self.string() for _ in range(count)]
        if item in _SCALARS:
            self.at += count * struct.calcsize("<" + _SCALARS[item])
        elif item == _STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
        else:
            for _ in range(count):
                self.value(item)
        return None


def read_gguf(path: Path, arrays: tuple[str, ...] = ()) -> tuple[dict, dict[str, GgufTensor]]:
    """(metadata scalars and strings by key, tensors by name) of a little-endian GGUF file, version 2 or 3; the
    metadata arrays named in `arrays` are read too, as lists."""
    import gguf

    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size < 4:  # mmap refuses an empty file
            raise ValueError(f"{path.name} is not a GGUF file")
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    buf = np.frombuffer(mapping, dtype=np.uint8)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path.name} is not a GGUF file")
    cursor = _Cursor(buf)
    cursor.at = 4
    version = cursor.read("I")
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version} (or big-endian); Sluice reads versions 2 and 3, "
                         "little-endian")
    try:
        metadata, directory = _header(cursor, arrays)
    except (struct.error, ValueError) as error:  # a read past the end: a cut-off file or a count out of range
        raise ValueError(f"{path.name}: a truncated or malformed GGUF header ({error})") from None
    align = int(metadata.get("general.alignment", 32))
    start = -(-cursor.at // align) * align
    tensors = {}
    for name, dims, type_id, offset in directory:
        kind = gguf.GGMLQuantizationType(type_id)
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        size = prod(dims) // per_block * block_bytes
        if start + offset + size > len(buf):
            raise ValueError(f"{path.name}: tensor {name} runs past the end of the file (a truncated download?)")
        tensors[name] = GgufTensor(kind.name, dims, buf[start + offset:start + offset + size], mapping, start + offset)
    return metadata, tensors


def _header(cursor: _Cursor, arrays: tuple[str, ...]) -> tuple[dict, list]:
    """The metadata (arrays named in `arrays` read) and the tensor directory: (name, dims, type, offset) each."""
    num_tensors, num_values = cursor.read("Q"), cursor.read("Q")
    metadata = {}
    for _ in range(num_values):
        key = cursor.string()
        value = cursor.value(cursor.read("I"), keep=key in arrays)
        if value is not None:
            metadata[key] = value
    directory = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        directory.append((name, dims, cursor.read("I"), cursor.read("Q")))
    return metadata, directory
