"""Build a transformers fallback model (engine/models/hf_fallback.py) and fill
it from a checkpoint's safetensors shards, tensor by tensor.

The class is built on the meta device (no memory, no random init), moved to
empty storage on the target device in the engine's dtype, and every
checkpoint tensor is copied into its parameter as loader.py does for native
families: a tensor the model has no place for, a parameter the checkpoint
lacks, or a shape that differs is refused naming the tensor, never served
as garbage. Checkpoint names go through transformers' own renames for the
class (its conversion mapping); a tensor that needs transformers to merge
or split tensors (a conversion, not a rename) is refused naming it.
Buffers the class computes (rotary frequencies) are computed again by
transformers' own initialisation for their modules, and checked finite.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from trioserve.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.loading.sources import find_shards
from trioserve.engine.models.hf_fallback import ATTENTION, TransformersForCausalLM, register_attention, transformers_config

logger = logging.getLogger(__name__)


def load_fallback(
    folder: Path,
    model_config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cpu_paths: CpuPaths | None = None,
) -> TransformersForCausalLM:
    """transformers' own class for ``folder``'s checkpoint, filled from its
    shards in ``dtype`` on ``device``, behind the engine's model interface,
    checked by one probe step. Logs a WARNING that the model runs on the
    slower fallback. Raises ``ModelLoadError`` naming the tensor or field at
    fault; nothing stays loaded then."""
    import json

    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: cannot read: {exc}") from None
    shards = find_shards(folder)
    config, cls = transformers_config(hf, source=str(config_path))
    register_attention()
    config._attn_implementation = ATTENTION
    failure = None
    try:
        hf_model = _build(cls, config, dtype=dtype, device=device, source=config_path)
        failure = _fill(hf_model, shards, config_path)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        failure = f"{folder}: cannot build transformers' {cls.__name__} in {dtype} on {device}: {exc}"
    if failure is not None:
        # Raised outside the except block: no traceback keeps the half-built model.
        hf_model = None
        raise ModelLoadError(failure)
    model = TransformersForCausalLM(hf_model, model_config, cpu_paths=cpu_paths)
    model.probe()
    logger.warning(
        "%s: %s has no native family here (natively supported: %s); it runs on the transformers fallback "
        "(transformers' own %s over the paged KV cache), which is slower and has no compressed weights, "
        "CUDA graphs or tensor parallelism",
        folder.name, model_config.architecture, ", ".join(SUPPORTED_ARCHITECTURES), cls.__name__,
    )  # fmt: skip
    return model


def _build(cls: type, config: Any, *, dtype: torch.dtype, device: torch.device, source: Path) -> Any:
    """``cls`` for ``config`` on empty storage in ``dtype`` on ``device``,
    weights tied and computed buffers filled; parameters hold garbage until
    ``_fill``."""
    with torch.device("meta"):
        model = cls(config)
    for param in model.parameters():
        if param.is_floating_point():
            # On meta, free; buffers keep their dtype (rotary frequencies stay float32, as transformers keeps them).
            param.data = param.data.to(dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each tied module a storage of its own
    buffers = dict(model.named_buffers())
    for tensor in buffers.values():
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))  # what initialisation does not fill shows up below
    owners = {name.rpartition(".")[0] for name in buffers}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name in owners:
                # transformers' own initialisation (what from_pretrained runs
                # for buffers the checkpoint does not hold): it computes
                # rotary frequencies and the like from the config.
                model._init_weights(module)
    model.eval()
    model.requires_grad_(False)
    persistent = set(model.state_dict())
    for name, tensor in model.named_buffers():
        if name not in persistent and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ModelLoadError(f"{source}: transformers does not compute buffer {name!r} of {cls.__name__} outside from_pretrained")
    return model


def _renamer(model: Any):
    """Checkpoint name -> (the model's name, whether a conversion that
    merges or splits tensors claims it), by transformers' mapping for the class."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    keys = {name: True for name in model.state_dict()}
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(name: str) -> tuple[str, bool]:
        renamed, converted = rename_source_key(name, renamings, converters, prefix, keys)
        return renamed, converted is not None

    return rename


def _fill(model: Any, shards: list[Path], config_path: Path) -> str | None:
    """Copy every checkpoint tensor into ``model``; return an error message
    naming the tensor at fault, or None when every parameter was filled."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())  # tied parameters once, under their first name
    state = model.state_dict(keep_vars=True)  # tied aliases and persistent buffers too
    rename = _renamer(model)
    loaded: set[str] = set()
    mismatch = f"{config_path} and the weights disagree"
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target, converted = rename(name)
                    if converted:
                        return (
                            f"{shard}: tensor {name!r} needs transformers' weight conversion into {target!r} "
                            f"(merging or splitting tensors), which the transformers fallback does not do"
                        )
                    if target not in state:
                        if name.endswith("rotary_emb.inv_freq"):
                            continue  # computed from the config; old checkpoints saved it
                        return f"{shard}: unexpected tensor {name!r}: {type(model).__name__} has no such weight ({mismatch})"
                    tensor = f.get_tensor(name)
                    dest = state[target]
                    if tuple(tensor.shape) != tuple(dest.shape):
                        return (
                            f"{shard}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"{type(model).__name__} expects {tuple(dest.shape)} ({mismatch})"
                        )
                    if target not in params and isinstance(dest, torch.nn.Parameter):
                        continue  # a tied alias (lm_head of tied embeddings): its parameter loads under the first name
                    with torch.no_grad():
                        dest.copy_(tensor)
                    loaded.add(target)
                    del tensor
        except SafetensorError as exc:
            return f"{shard}: not a valid safetensors file (truncated or corrupt?): {exc}"
        except OSError as exc:
            return f"{shard}: cannot read: {exc.strerror or exc}"
    missing = sorted(set(params) - loaded)
    persistent_buffers = {name for name in state if name not in params and not isinstance(state[name], torch.nn.Parameter)}
    missing += sorted(name for name in persistent_buffers - loaded if state[name].is_floating_point())
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8]) + (", ..." if len(missing) > 8 else "")
        return (
            f"{config_path.parent}: {len(missing)} tensor(s) that {type(model).__name__} needs are missing from "
            f"{', '.join(s.name for s in shards)}: {shown} ({mismatch})"
        )
    return None
