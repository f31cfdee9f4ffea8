"""A LoRA adapter read from a PEFT folder and checked against the base model.

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` whose
tensors are named ``base_model.model.model.layers.{i}.{block}.{module}.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``). Our layers fuse
q/k/v into one projection and gate/up into another, so each module maps to
a slice of a fused projection's output rows (``MODULES``); an adapter that
targets anything else (the embeddings, the LM head, a module this model
lacks) or does not fit the base's shapes is refused whole, with the module
and the reason, before it is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import attrs
import torch

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.model_config import ModelConfig

# PEFT module name -> (our projection, its block in the checkpoint).
MODULES = {
    "q_proj": ("qkv", "self_attn"),
    "k_proj": ("qkv", "self_attn"),
    "v_proj": ("qkv", "self_attn"),
    "o_proj": ("o", "self_attn"),
    "gate_proj": ("gate_up", "mlp"),
    "up_proj": ("gate_up", "mlp"),
    "down_proj": ("down", "mlp"),
}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(InvalidRequestError):
    """An adapter that cannot be served: its folder, its config, or how it
    fits the base model; ``field`` is the request field at fault
    (``lora_path`` for what the folder holds, ``lora_name`` for the name)."""


@attrs.frozen(eq=False)
class LoraDelta:
    """One module's low-rank update of one layer: ``scaling * (x @ a.T) @ b.T``
    added to output rows ``start .. start + b.shape[0]`` of ``projection``
    (``"qkv"``, ``"o"``, ``"gate_up"`` or ``"down"``)."""

    projection: str
    start: int
    a: torch.Tensor  # [r, in], float32
    b: torch.Tensor  # [out, r], float32
    scaling: float


@attrs.frozen(eq=False)
class LoraAdapter:
    """A loaded adapter: its name, where it came from, a digest of its
    weights and scaling (what keys its prefix-cache blocks), its rank, and
    per layer the deltas it adds (``layers[i]``, empty where it adds none)."""

    name: str
    path: str
    digest: str
    rank: int
    layers: tuple[tuple[LoraDelta, ...], ...]
    base_model_name: str | None = None

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections it changes somewhere."""
        return tuple(sorted({d.projection for layer in self.layers for d in layer}))


def _output_slices(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """Module -> (first output row in its fused projection, rows, inputs)."""
    hd, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {
        "q_proj": (0, q, hidden),
        "k_proj": (q, kv, hidden),
        "v_proj": (q + kv, kv, hidden),
        "o_proj": (0, hidden, q),
        "gate_proj": (0, inter, hidden),
        "up_proj": (inter, inter, hidden),
        "down_proj": (0, hidden, inter),
    }


def _read_config(folder: Path, name: str) -> dict:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoraError(f"adapter {name!r}: {folder} is not a folder", field="lora_path")
    if not path.is_file():
        raise LoraError(f"adapter {name!r}: {folder} has no adapter_config.json (not a PEFT adapter)", field="lora_path")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not valid JSON: {exc}", field="lora_path") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json is not an object", field="lora_path")
    return config


def _check_config(config: dict, name: str, max_rank: int) -> tuple[int, float, set[str], set[int] | None, bool]:
    """The fields we serve, or ``LoraError`` for one we cannot: (rank,
    scaling, target modules, layers to transform or None, fan_in_fan_out)."""

    def refuse(why: str) -> LoraError:
        return LoraError(f"adapter {name!r}: {why}", field="lora_path")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over --max-lora-rank ({max_rank})")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse(f"bias {config.get('bias')!r}: only adapters without biases (bias 'none') are served")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']!r}: full copies of modules are not served")
    for field in ("use_dora", "rank_pattern", "alpha_pattern", "layer_replication", "target_parameters"):
        if config.get(field):
            raise refuse(f"{field} {config[field]!r} is not served (plain LoRA only)")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise refuse(f"target_modules as a pattern ({targets!r}) is not served: list the modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise refuse(f"target_modules must be a non-empty list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(MODULES))
    if unknown:
        raise refuse(
            f"target module {unknown[0]!r} does not fit the base model: LoRA is served on "
            f"{', '.join(MODULES)} only"
        )
    layers = config.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise refuse(f"layers_to_transform must be a list of layer indices, got {layers!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, float(scaling), set(targets), None if layers is None else set(layers), bool(config.get("fan_in_fan_out"))


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        why = "adapter_model.bin (a pickle) is not loaded: save it as safetensors" if (folder / "adapter_model.bin").exists() else "it has no adapter_model.safetensors"
        raise LoraError(f"adapter {name!r}: {why}", field="lora_path")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors cannot be read: {exc}", field="lora_path") from None


def load_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    *,
    max_rank: int,
    base_model_name: str | None = None,
    device: torch.device | str = "cpu",
) -> LoraAdapter:
    """Read the PEFT adapter in folder ``path`` as ``name`` for a base model
    of ``config`` on ``device`` (where its weights are put); ``LoraError``
    naming the adapter, the module and the reason when it cannot be served
    (see the module's docstring)."""
    folder = Path(path)
    raw = _read_config(folder, name)
    rank, scaling, targets, only_layers, fan_in_fan_out = _check_config(raw, name, max_rank)
    slices = _output_slices(config)
    tensors = _read_tensors(folder, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer's module", field="lora_path")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or MODULES[module][1] != block:
            raise LoraError(f"adapter {name!r}: module {block}.{module} does not fit the base model", field="lora_path")
        if module not in targets:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is for {module}, not among target_modules", field="lora_path")
        if not 0 <= layer < config.num_hidden_layers:
            raise LoraError(
                f"adapter {name!r}: layer {layer} of {module}: the base model has {config.num_hidden_layers} layers",
                field="lora_path",
            )
        if layer in config.moe_layers and block == "mlp":
            raise LoraError(f"adapter {name!r}: {module} of layer {layer}: that layer's MLP is a mixture of experts", field="lora_path")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights", field="lora_path")
    layers: list[list[LoraDelta]] = [[] for _ in range(config.num_hidden_layers)]
    digest = hashlib.sha256(f"{scaling!r}".encode())
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "A" if "A" not in pair else "B"
            raise LoraError(f"adapter {name!r}: {module} of layer {layer} lacks lora_{missing}", field="lora_path")
        if only_layers is not None and layer not in only_layers:
            continue
        a, b = pair["A"].float(), pair["B"].float()
        if fan_in_fan_out:  # Conv1D-style models save them transposed
            a, b = a.T, b.T
        start, out, fan_in = slices[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (out, rank):
            raise LoraError(
                f"adapter {name!r}: {module} of layer {layer} has A {list(a.shape)} and B {list(b.shape)}; "
                f"the base model needs A [{rank}, {fan_in}] and B [{out}, {rank}]",
                field="lora_path",
            )
        a, b = a.contiguous(), b.contiguous()
        digest.update(f"{layer}.{module}".encode())
        digest.update(a.numpy().tobytes())
        digest.update(b.numpy().tobytes())
        layers[layer].append(LoraDelta(MODULES[module][0], start, a.to(device), b.to(device), scaling))
    return LoraAdapter(
        name=name,
        path=str(folder),
        digest=digest.hexdigest(),
        rank=rank,
        layers=tuple(map(tuple, layers)),
        base_model_name=base_model_name,
    )
