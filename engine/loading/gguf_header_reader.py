"""A GGUF's header in the shape of gguf-py's ``GGUFReader``, for transformers'
config of the file.

transformers builds a GGUF's config (``AutoConfig.from_pretrained(...,
gguf_file=...)``, and again inside ``AutoTokenizer.from_pretrained``) with
``load_gguf_checkpoint``, whose ``GGUFReader`` makes a numpy view of every
part of every field: 400,000 views for a Llama 3's vocabulary, twice,
about 20 of the 30 CPU seconds of a first start (docs/benchmarks.md,
"Start-up"). Only the config is used from those calls, and it is made of
the model's keys and the special tokens' ids, never of the vocabulary's
arrays. ``HeaderReader`` gives ``load_gguf_checkpoint`` the same fields,
part for part as ``GGUFReader`` lays them out, from ``GGUFFile``'s walk of
the header, with the arrays under ``tokenizer.`` empty (but for the
tokens' count, which is the config's ``vocab_size`` where the file has
none: as many empty strings; the unused ``"tokenizer"`` part of the
result holds what they make), and the tensors' names. ``config_from_header`` puts it in place of
``GGUFReader`` for such a call; ``tests/test_gguf_header_reader.py``
checks the configs equal the reader's on every GGUF at hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading.gguf_file import GGUFFile

_STRING, _ARRAY = 8, 9
# The vocabulary's keys: their arrays are left empty, the tokens' items only.
_VOCABULARY, _TOKENS = "tokenizer.", "tokenizer.ggml.tokens"
_EMPTY = {_STRING: "", _ARRAY: []}


@attrs.frozen
class HeaderField:
    """``gguf.ReaderField``'s parts as ``load_gguf_checkpoint`` reads them:
    ``parts`` the key's length, its bytes, its type, then the value's parts;
    ``data`` the indices of the value's items in ``parts``; ``types`` the
    value's type, then an array's item type."""

    name: str
    parts: list[Any]
    data: list[int]
    types: list[int]


@attrs.frozen
class HeaderTensor:
    """A tensor as ``load_gguf_checkpoint`` looks at it without its data: its name."""

    name: str


class Unsupported(Exception):
    """The file has a value ``HeaderReader`` does not lay out (an array of
    arrays outside the vocabulary): read it with ``GGUFReader``."""


class HeaderReader:
    """``fields`` and ``tensors`` of the GGUF at ``path``, as ``GGUFReader``'s
    (see the module's docstring). Raises ``Unsupported`` for a value it does
    not lay out, ``ModelLoadError`` for a file ``GGUFFile`` cannot read."""

    def __init__(self, path: str | Path) -> None:
        file = GGUFFile(Path(path), want_strings=lambda key: not key.startswith(_VOCABULARY))
        counts = (("GGUF.version", 4, file.version), ("GGUF.tensor_count", 10, len(file.tensors)),
                  ("GGUF.kv_count", 10, len(file.fields)))  # fmt: skip
        self.fields: dict[str, HeaderField] = {name: HeaderField(name, [[n]], [0], [kind]) for name, kind, n in counts}
        for key, value in file.fields.items():
            self.fields[key] = _field(key, file.kinds[key], value)
        self.tensors = [HeaderTensor(info.name) for info in file.tensors]


def _field(key: str, kinds: tuple[int, ...], value: Any) -> HeaderField:
    encoded = key.encode("utf-8")
    parts: list[Any] = [[len(encoded)], encoded, [kinds[0]]]
    if kinds[0] != _ARRAY:
        parts += _value_parts(kinds[0], value)
        return HeaderField(key, parts, [len(parts) - 1], [kinds[0]])
    _, item, length = kinds
    if key.startswith(_VOCABULARY):
        # Empty, but for the tokens' count (a config without vocab_size
        # takes it), as as many of the emptiest items.
        length = length if key == _TOKENS else 0
        value = [_EMPTY.get(item, 0)] * length
    elif item == _ARRAY:
        raise Unsupported(f"key {key!r}: an array of arrays")
    parts += [[item], [length]]
    data = []
    for one in value:
        parts += _value_parts(item, one)
        data.append(len(parts) - 1)
    return HeaderField(key, parts, data, [_ARRAY, item] if length else [_ARRAY])


def _value_parts(kind: int, value: Any) -> list[Any]:
    """A scalar's parts: a string's length and bytes, else the value itself
    (read as ``part[0]``)."""
    if kind == _STRING:
        encoded = value.encode("utf-8")
        return [[len(encoded)], encoded]
    return [[value]]


@contextlib.contextmanager
def config_from_header(path: Path) -> Iterator[None]:
    """Within, transformers' ``load_gguf_checkpoint`` reads ``path`` with
    ``HeaderReader`` (every other file still with ``GGUFReader``): for a call
    that uses only its ``"config"``, never with ``return_tensors``. Where
    ``HeaderReader`` does not lay the file out, or cannot read it, nothing
    is replaced."""
    import gguf

    try:
        header = HeaderReader(path)
    except (Unsupported, ModelLoadError):  # GGUFReader's own error, as before
        yield
        return
    original = gguf.GGUFReader
    resolved = Path(path).resolve()

    def reader(file: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(file).resolve() == resolved and not args and not kwargs:
            return header
        return original(file, *args, **kwargs)

    # load_gguf_checkpoint imports GGUFReader from gguf at each call.
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
