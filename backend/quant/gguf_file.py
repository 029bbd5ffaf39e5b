"""A minimal GGUF reader: the tensor directory and a few scalar metadata values, with the
tensor data memory-mapped (nothing is read until a kernel touches it). A loader that has
copied a tensor out hands its pages back (`GGUFFile.drop_pages`): the map's pages count in the
process's resident memory while it lasts, and a whole file's would otherwise sit beside the
weights built from it (the default model: 98 MB of a 466 MB load peak).

`gguf.GGUFReader` builds a numpy view for every metadata element (a 49k-token vocabulary is
~150k small objects, several seconds on a small CPU); loading weights needs the tensor table
and two scalars, so this reader skips every other value by its length.

    header   magic "GGUF", version u32, tensor_count u64, kv_count u64
    kv       key (u64 length + bytes), value type u32, value   (arrays: type u32, count u64)
    tensors  name, n_dims u32, dims u64 x n (fastest first), ggml type u32, offset u64
    data     aligned to `general.alignment` (32 by default)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["GGUFFile", "TensorEntry", "open_gguf"]

# value type -> struct format of a scalar (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_WANTED = ("general.architecture", "general.alignment")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first): [out_features, in_features]
    type_name: str  # ggml type: "Q4_1", "F32", ...
    data: np.ndarray  # raw bytes, uint8, [rows, row_bytes] (a view of the file's map)
    start: int  # where data starts in the file


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # only the scalars in _WANTED
    tensors: list[TensorEntry]
    pages: mmap.mmap  # the file, read-only (the tensors' data are views of it)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def drop_pages(self, entry: TensorEntry) -> None:
        """Let the OS take back the memory of `entry`'s pages, once its bytes are copied out.
        They stay in the file (and the page cache): reading them again, or a neighbour's bytes
        on a shared page, faults them back in, so this only ever costs time."""
        size = mmap.PAGESIZE
        lo = entry.start // size * size
        hi = min(-(-(entry.start + entry.data.nbytes) // size) * size, len(self.pages))
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):  # (not on every platform)
            self.pages.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, vtype: int) -> Any:
    """Read a scalar or string (returned), or skip an array (returns None)."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == 8:
        return _string(f)
    if vtype != 9:
        raise ValueError(f"unknown GGUF value type {vtype}")
    etype, count = _read(f, "<I"), _read(f, "<Q")
    if etype in _SCALARS:
        f.seek(count * struct.calcsize(_SCALARS[etype]), 1)
    else:
        for _ in range(count):
            _skip_value(f, etype)
    return None


def open_gguf(path: Path) -> GGUFFile:
    import gguf  # for the ggml type table only

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = _read(f, "<I"), _read(f, "<Q"), _read(f, "<Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need >= 2)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, vtype = _string(f), _read(f, "<I")
            value = _skip_value(f, vtype)
            if key in _WANTED:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = _string(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            infos.append((name, dims, _read(f, "<I"), _read(f, "<Q")))
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(pages, dtype=np.uint8)  # (read-only; keeps the map alive)
    tensors = []
    for name, dims, type_id, offset in infos:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        data = mapped[start:start + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(TensorEntry(name, tuple(int(d) for d in reversed(dims)), qtype.name,
                                   data, start))
    return GGUFFile(metadata, tensors, pages)
