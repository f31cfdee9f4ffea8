"""The model's sampling defaults: what fills the sampling fields a request
leaves out, as vLLM's ``--generation-config auto`` does.

A checkpoint folder's ``generation_config.json`` and a GGUF file's
``general.sampling.*`` keys (llama.cpp's) give ``temperature``, ``top_p``,
``top_k``, ``min_p`` and ``repetition_penalty`` (a GGUF's ``temp`` and
``penalty_repeat``). ``EngineConfig.generation_config`` says where they come
from: ``"auto"`` reads the model's, ``"none"`` ignores them, anything else is
the path of a ``generation_config.json`` (or of a folder holding one).

A source that names some of the fields sets those; the others keep the API's
neutral values (temperature 1, no truncation, no penalty), as in vLLM. A
source that names none of them, and ``"none"``, give the built-in defaults,
llama-server's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05. Small
models (the default one) write readable text with them, where temperature 1
without truncation wanders off within a sentence.

The rest of a ``generation_config.json`` (``max_new_tokens``, ``do_sample``,
beam settings) and of a GGUF's keys (``penalty_last_n``, mirostat, XTC) is
not applied; ``do_sample`` is ignored as vLLM ignores it. A request's own
value always wins (``SamplingParams.with_defaults``).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import attrs

from trioserve.engine.config import GENERATION_CONFIG_FILE, generation_config_path
from trioserve.engine.errors import GenerationConfigError, InvalidRequestError
from trioserve.engine.loading.sources import resolve_source
from trioserve.engine.sampling.sampling_params import DEFAULTABLE_FIELDS, NEUTRAL_SAMPLING, SamplingParams

# llama-server's defaults (common/common.h), for a model that names none.
BUILT_IN_SAMPLING: dict[str, float | int] = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
}
# A GGUF's keys (gguf-py's Keys.General.SAMPLING_*) and the fields they set.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
SOURCES = ("model", "flag", "built-in")


@attrs.frozen(kw_only=True)
class SamplingDefaults:
    """The values that fill a request's unset sampling fields, and where
    they come from: ``source`` is ``"model"`` (the model's own file),
    ``"flag"`` (``generation_config`` named a path) or ``"built-in"``;
    ``path`` is the file read (None for built-in)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    source: str = attrs.field(validator=attrs.validators.in_(SOURCES))
    path: str | None = None

    @classmethod
    def built_in(cls) -> SamplingDefaults:
        return cls(**BUILT_IN_SAMPLING, source="built-in")  # type: ignore[arg-type]

    @classmethod
    def from_values(cls, values: dict[str, Any], *, source: str, path: Path) -> SamplingDefaults:
        """The defaults a file's ``values`` give: those fields as given, the
        others neutral; no values at all: the built-in defaults."""
        if not values:
            return cls.built_in()
        return cls(**{**NEUTRAL_SAMPLING, **values}, source=source, path=str(path))

    @property
    def values(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in DEFAULTABLE_FIELDS}

    def apply(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (None: all defaults) with its unset fields filled."""
        return (params if params is not None else SamplingParams()).with_defaults(self.values)

    def as_json(self) -> dict[str, Any]:
        """What ``/v1/models`` shows under ``sampling_defaults``."""
        return {**self.values, "source": self.source, "path": self.path}

    def __str__(self) -> str:
        values = ", ".join(f"{name} {value:g}" for name, value in self.values.items())
        return f"{values} ({self.source}{': ' + self.path if self.path else ''})"


def load_sampling_defaults(option: str, model: str | None, *, folder: Path | None = None) -> SamplingDefaults:
    """The defaults for ``model`` (as ``load_model`` takes it: None is the
    default model) under the ``generation_config`` option ``option``.
    ``folder``, when given, stands in for a ``model`` of None: the folder
    of a model loaded some other way (tests, a preloaded model), whose
    ``generation_config.json`` is read if it has one."""
    if option == "none":
        return SamplingDefaults.built_in()
    if option != "auto":
        path = generation_config_path(option)
        return SamplingDefaults.from_values(read_generation_config(path), source="flag", path=path)
    if model is None and folder is not None:
        source = Path(folder)
    else:
        source, _ = resolve_source(model)
    if source.is_file():
        return SamplingDefaults.from_values(read_gguf_sampling(source), source="model", path=source)
    path = source / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults.built_in()
    try:
        values = read_generation_config(path)
    except GenerationConfigError as exc:
        raise GenerationConfigError(f"{exc} (--generation-config none ignores the model's)") from None
    return SamplingDefaults.from_values(values, source="model", path=path)


def read_generation_config(path: Path) -> dict[str, Any]:
    """The sampling fields a ``generation_config.json`` sets (a null one is
    left out). Raises ``GenerationConfigError`` naming the path, and the
    field when one is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"generation_config: {path}: cannot read it: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GenerationConfigError(f"generation_config: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"generation_config: {path} must hold a JSON object, got {type(data).__name__}")
    values = {name: data[name] for name in DEFAULTABLE_FIELDS if data.get(name) is not None}
    return _checked(values, path)


def read_gguf_sampling(path: Path) -> dict[str, Any]:
    """The sampling fields a GGUF file's ``general.sampling.*`` keys set."""
    try:
        metadata = read_gguf_metadata(path, wanted=GGUF_SAMPLING_KEYS)
    except (OSError, ValueError, struct.error) as exc:
        raise GenerationConfigError(f"{path}: cannot read its metadata: {exc}") from None
    values = {GGUF_SAMPLING_KEYS[key]: value for key, value in metadata.items()}
    for name, value in values.items():
        if isinstance(value, float):
            values[name] = float(f"{value:.7g}")  # a float32's 0.949999988 back to 0.95
    return _checked(values, path)


def _checked(values: dict[str, Any], path: Path) -> dict[str, Any]:
    """``values``, after ``SamplingParams``' own checks of type and range."""
    if isinstance(values.get("top_k"), bool):
        raise GenerationConfigError(f"generation_config: {path}: top_k must be an integer, got {values['top_k']!r}")
    try:
        SamplingParams(**values)
    except InvalidRequestError as exc:
        raise GenerationConfigError(f"generation_config: {path}: {exc}") from None
    return {name: float(v) if name != "top_k" else v for name, v in values.items()}


# -- a GGUF file's metadata, without its tensors ------------------------------
# gguf-py's GGUFReader parses every token of the vocabulary into a field
# (2 s for the default model); the header's few sampling keys need a walk
# over the key-value section only.

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: Path, *, wanted: Any) -> dict[str, Any]:
    """The scalar values of the keys in ``wanted`` that ``path`` (a GGUF
    file, version 2 or 3) holds."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        order = "<"
        (version,) = struct.unpack_from("<I", data, 4)
        if version > 0xFFFF:  # a big-endian file
            order = ">"
            (version,) = struct.unpack_from(">I", data, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        _, num_kv = struct.unpack_from(order + "QQ", data, 8)
        offset = 24
        found: dict[str, Any] = {}

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from(order + "Q", data, at)
            return data[at + 8 : at + 8 + length].decode("utf-8", "replace"), at + 8 + length

        def skip(kind: int, at: int) -> int:
            if kind in _SCALARS:
                return at + struct.calcsize(_SCALARS[kind])
            if kind == _STRING:
                return string(at)[1]
            if kind == _ARRAY:
                item, count = struct.unpack_from(order + "IQ", data, at)
                at += 12
                if item in _SCALARS:
                    return at + count * struct.calcsize(_SCALARS[item])
                for _ in range(count):
                    at = skip(item, at)
                return at
            raise ValueError(f"unknown GGUF value type {kind}")

        for _ in range(num_kv):
            key, offset = string(offset)
            (kind,) = struct.unpack_from(order + "I", data, offset)
            offset += 4
            if key in wanted and kind in _SCALARS:
                (value,) = struct.unpack_from(order + _SCALARS[kind], data, offset)
                found[key] = value
            offset = skip(kind, offset)
        return found
