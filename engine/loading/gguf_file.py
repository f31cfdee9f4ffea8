"""A GGUF file's header and its tensors as views of the mapped file.

gguf-py's ``GGUFReader`` makes a numpy view of every part of every field,
each token and merge of a vocabulary included: about 400,000 views for a
Llama 3's tokenizer, seconds before the first tensor is read. A load needs
the model's keys and the tensors' places only, so ``GGUFFile`` walks the
header once with ``struct`` (a string array is stepped over, its strings
parsed only for the keys asked for) and maps the tensor data read-only:
nothing is read from the data until a tensor is decoded, and each tensor's
bytes are read once, by its decoder.

A tensor comes as gguf-py's ``ReaderTensor.data`` does (so decoders take
either): F32, F16 and F64 and the integer types as their numpy dtype in
numpy's order of the dimensions (``[rows, cols]``), every other type as
uint8 rows of its blocks' bytes (``[rows, cols / block * bytes]``).
Version 2 and 3 little-endian files are read; anything else is refused
(``ModelLoadError`` naming the file).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from trioserve.engine.errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# Types whose data are numpy values rather than blocks (gguf-py's choice).
_PLAIN = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip
_DEFAULT_ALIGNMENT = 32


@attrs.frozen
class TensorInfo:
    """One tensor of the file: its name, GGUF type name (``Q4_K``...),
    ggml dimensions (innermost first) and the data's byte offset in the file."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFFile:
    """The header of the GGUF at ``path`` (``fields``: each key's value, a
    string array as ``None`` unless ``want_strings(key)``; ``kinds``: each
    key's GGUF value type, an array's as ``(9, item type, length)``; ``version``), its tensors'
    ``TensorInfo`` in the file's order, and ``data(info)`` for a tensor's
    values as a read-only view of the mapped file (a view holds the map:
    it stays valid after this object is dropped)."""

    def __init__(self, path: Path, *, want_strings: Callable[[str], bool] = lambda key: False) -> None:
        import gguf

        self.path = Path(path)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelLoadError(f"{self.path}: not a readable GGUF model: {exc}") from None
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)
        self._sizes = {t.name: gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType}
        self._type_names = {int(t): t.name for t in gguf.GGMLQuantizationType}
        try:
            self.kinds: dict[str, tuple[int, ...]] = {}
            self.fields, self.tensors = self._parse(want_strings)
        except (struct.error, UnicodeDecodeError, IndexError, KeyError, ValueError) as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None

    def _parse(self, want_strings: Callable[[str], bool]) -> tuple[dict[str, Any], list[TensorInfo]]:
        data = self._map
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        (version,) = struct.unpack_from("<I", data, 4)
        if version not in (2, 3):
            raise ValueError(f"version {version} (or a big-endian file): only little-endian versions 2 and 3 are read")
        self.version = version
        num_tensors, num_kv = struct.unpack_from("<QQ", data, 8)
        at = 24

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            end = at + 8 + length
            if end > len(data):
                raise ValueError("a string runs past the end of the file")
            return data[at + 8 : end].decode("utf-8"), end

        def value(kind: int, at: int, key: str) -> tuple[Any, int]:
            if kind in _SCALARS:
                fmt = "<" + _SCALARS[kind]
                return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
            if kind == _STRING:
                return string(at)
            if kind != _ARRAY:
                raise ValueError(f"key {key!r}: unknown value type {kind}")
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _NUMPY:
                width = np.dtype(_NUMPY[item]).itemsize
                values = np.frombuffer(data, dtype=_NUMPY[item], count=count, offset=at)
                return values.tolist(), at + count * width
            if item == _STRING:
                if want_strings(key):
                    items = []
                    for _ in range(count):
                        text, at = string(at)
                        items.append(text)
                    return items, at
                for _ in range(count):  # stepped over: only the lengths are read
                    at += 8 + struct.unpack_from("<Q", data, at)[0]
                return None, at
            items = []
            for _ in range(count):
                one, at = value(item, at, key)
                items.append(one)
            return items, at

        fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", data, at)
            self.kinds[key] = (kind, *struct.unpack_from("<IQ", data, at + 4)) if kind == _ARRAY else (kind,)
            fields[key], at = value(kind, at + 4, key)
        infos = []
        for _ in range(num_tensors):
            name, at = string(at)
            (n_dims,) = struct.unpack_from("<I", data, at)
            dims = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
            kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            type_name = self._type_names.get(kind, f"type {kind}")
            block, size = self._sizes.get(type_name, (1, 0))
            elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            infos.append(TensorInfo(name, type_name, tuple(dims), offset, elements // block * size))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        self._start = at + (-at) % alignment
        for info in infos:
            if info.nbytes == 0 and info.type_name in self._sizes:
                continue
            if self._start + info.offset + info.nbytes > len(data):
                raise ValueError(f"tensor {info.name!r} runs past the end of the file (truncated?)")
        return fields, infos

    @property
    def architecture(self) -> str:
        """``general.architecture``, or "" where the file names none."""
        return str(self.fields.get("general.architecture", ""))

    def data(self, info: TensorInfo) -> np.ndarray:
        """``info``'s values as a read-only view of the mapped file (see the module's docstring)."""
        if info.type_name not in self._sizes:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has an unknown GGUF {info.type_name}")
        shape = tuple(reversed(info.dims))
        begin = self._start + info.offset
        if info.type_name in _PLAIN:
            dtype = np.dtype(_PLAIN[info.type_name])
            return self._buffer[begin : begin + info.nbytes].view(dtype).reshape(shape)
        block, size = self._sizes[info.type_name]
        return self._buffer[begin : begin + info.nbytes].reshape(*shape[:-1], shape[-1] // block * size)
