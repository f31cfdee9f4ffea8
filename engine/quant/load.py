"""Build a model whose projections (and LM head) run on compressed weights.

Tensors come one at a time, from a GGUF file (``gguf_weights``, its own
quantized values) or from float safetensors shards (quantized here, round to
nearest). A layer's projections are built as soon as its seven matrices have
arrived and the raw tensors are dropped, so no float32 copy of the matrices
is ever held beyond one layer's. Norms stay float32; the token embeddings
stay in the file's compressed format where they come compressed (rows
dequantized on lookup, ``embedding``), else float32.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from ..capability import CpuPaths
from ..config import ModelConfig
from ..errors import CpuCapabilityError, ModelLoadError
from ..model import LlamaForCausalLM, ProjectionChoice
from . import gguf_weights, int4_pack, int8_native, native, rtn_cache
from .choose import Kernel, KernelChoice, Linear, choose_kernel
from .embedding import CompressedEmbedding
from .projections import QuantizedProjections
from .rtn import Int4Weight, Int8GroupWeight, Int8Weight, check_group_size

logger = logging.getLogger(__name__)

Tensor = torch.Tensor | Int4Weight | Int8Weight | Int8GroupWeight
_PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")
_PARTS = ("q", "k", "v", "o", "gate", "up", "down")


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """One layer's fused projections, ``(out, in)``: qkv, o, gate_up, down."""
    hd, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
    return [(qkv, hidden), (hidden, config.num_attention_heads * hd), (2 * inter, hidden), (hidden, inter)]


def _cat(parts: list[Tensor]) -> Tensor:
    """Stack weights by rows: exact when all share one format (the kernels
    convert it if it is not theirs), else float32."""
    if all(isinstance(p, Int4Weight) and p.group_size == parts[0].group_size for p in parts):
        return Int4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
        )
    if all(isinstance(p, Int8Weight) for p in parts):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]).float()


def _bias(parts: dict[str, Tensor], names: tuple[str, ...], rows: list[int]) -> torch.Tensor | None:
    if not any(f"{n}.bias" in parts for n in names):
        return None
    return torch.cat(
        [parts.get(f"{n}.bias", torch.zeros(r)).float() for n, r in zip(names, rows)]  # type: ignore[union-attr]
    )


def _build_layer(parts: dict[str, Tensor], choice: KernelChoice, index: int) -> QuantizedProjections:
    def make(names: tuple[str, ...]) -> object:
        weights = [parts[f"{n}.weight"] for n in names]
        rows = [w.shape[0] if isinstance(w, torch.Tensor) else w.q.shape[0] for w in weights]
        for n, w in zip(names, weights):
            shape = tuple(w.shape if isinstance(w, torch.Tensor) else w.q.shape)
            if 4 in (choice.kernel.bits, choice.small.bits if choice.small else 0):
                check_group_size(shape, choice.group_size, f"model.layers.{index}.{n}_proj.weight")
        return choice.make(_cat(weights), _bias(parts, names, rows))

    return QuantizedProjections(make(("q", "k", "v")), make(("o",)), make(("gate", "up")), make(("down",)))


def quantization_choice(
    cpu_paths: CpuPaths | None, device: torch.device, dtype: torch.dtype, scheme: str, config: ModelConfig, group_size: int
) -> KernelChoice:
    """The kernel for ``scheme`` on this machine; ``CpuCapabilityError`` where none runs."""
    if device.type != "cpu" or cpu_paths is None:
        raise CpuCapabilityError(f"quantization {scheme} runs on CPU only, not on {device}; use --quantization none")
    if dtype != torch.float32:
        raise CpuCapabilityError(
            f"quantization {scheme} runs with float32 activations, not {dtype}; use --dtype float32 or --quantization none"
        )
    if scheme == "int4":
        int4_pack.Int4PackLinear.check_group_size(group_size)
        for i, shape in enumerate(layer_shapes(config)):
            check_group_size(shape, group_size, ("qkv", "o", "gate_up", "down")[i] + " projection")
    return choose_kernel(cpu_paths, scheme, layer_shapes(config), group_size)


def build_quantized(
    tensors: Iterable[tuple[str, Tensor]],
    config: ModelConfig,
    choice: KernelChoice,
    *,
    source: Path,
    cpu_paths: CpuPaths,
) -> LlamaForCausalLM:
    """The model over ``tensors`` (Hugging Face names) with projections on ``choice``'s kernel."""
    projection = ProjectionChoice(
        device="cpu", dtype="float32", packed=False, reason=choice.reason, quantization=choice.label
    )
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu", cpu_paths=cpu_paths, quantization=projection)
    pending: dict[int, dict[str, Tensor]] = {}
    layers: dict[int, QuantizedProjections] = {}
    head: Tensor | None = None
    embedding: CompressedEmbedding | None = None
    loaded: set[str] = set()
    for name, tensor in tensors:
        match = _PROJ.fullmatch(name)
        if match is not None:
            index = int(match.group(1))
            if index >= config.num_hidden_layers:
                raise ModelLoadError(f"{source}: weight {name!r}: the config has {config.num_hidden_layers} layers")
            parts = pending.setdefault(index, {})
            parts[f"{match.group(3)}.{match.group(4)}"] = tensor
            if all(f"{p}.weight" in parts for p in _PARTS):
                layers[index] = _build_layer(pending.pop(index), choice, index)
            continue
        if name == "lm_head.weight" and not config.tie_word_embeddings:
            head = tensor  # kept compressed (below): the model has no float parameter for it
            continue
        if name == "model.embed_tokens.weight" and isinstance(tensor, (Int4Weight, Int8GroupWeight)):
            # Kept as the file has it: a float32 copy would be the largest
            # tensor of a small model (113 MB for SmolLM2's 49,152 x 576).
            embedding = CompressedEmbedding(tensor)
            if config.tie_word_embeddings:
                head = tensor
            loaded.add(name)
            continue
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()  # embeddings and norms are used as float32
        if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            head = tensor  # the LM head is compressed too (below); the embeddings stay float32
        loaded |= model.load_weights([(name, tensor)])
    missing = sorted(set(range(config.num_hidden_layers)) - set(layers))
    if missing or head is None:
        what = f"layers {missing[:8]} lack projections" if missing else "no lm_head.weight"
        raise ModelLoadError(f"{source}: incomplete checkpoint: {what}")
    if embedding is not None and tuple(embedding.weight.q.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"{source}: weight 'model.embed_tokens.weight': expected shape "
            f"{(config.vocab_size, config.hidden_size)}, got {tuple(embedding.weight.q.shape)}"
        )
    if model.required_weight_names() - loaded:
        raise ModelLoadError(f"{source}: missing weights {sorted(model.required_weight_names() - loaded)[:8]}")
    assert head is not None
    head_linear = _shared_head(cpu_paths, head) or _head_kernel(cpu_paths, choice.kernel).make(
        head, None, choice.group_size
    )
    model.set_quantized([layers[i] for i in range(config.num_hidden_layers)], head_linear, embedding)
    return model


def _shared_head(cpu_paths: CpuPaths, head: Tensor) -> Linear | None:
    """A head stored as int8 in groups of 32 (GGUF's Q8_0) on the native
    kernel, over the stored values themselves: nothing requantized, and a
    tied head shares the embeddings' table. None where that does not run here."""
    if not isinstance(head, Int8GroupWeight) or head.group_size != int8_native.GROUP:
        return None
    known = {p.name for p in cpu_paths.paths}
    for isa in native.LINEAR_ISA_ORDER:
        name = f"quant_int8_native_{isa}"
        if name in known and cpu_paths.available(name):
            return int8_native.Int8GroupNativeLinear.over(head, isa)
    return None


def _head_kernel(cpu_paths: CpuPaths, kernel: Kernel) -> Kernel:
    # The LM head is a fifth of the weights a decode step streams; int8 per
    # channel keeps it close to its float values (a 4-bit head moves logits more).
    if kernel.bits == 8:
        return kernel
    from .choose import candidates

    return candidates(cpu_paths, "int8")[0]


def load_gguf_quantized(
    gguf_path: Path, config: ModelConfig, choice: KernelChoice, cpu_paths: CpuPaths
) -> LlamaForCausalLM:
    """The model of ``gguf_path`` with its weights kept compressed."""
    tensors = gguf_weights.read_tensors(
        gguf_path, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads
    )
    model = build_quantized(tensors, config, choice, source=gguf_path, cpu_paths=cpu_paths)
    logger.debug("%s: compressed projections, %s", gguf_path.name, choice.reason)
    return model


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def wanted(quantization: str, *, is_gguf: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to load compressed: ``"auto"`` does for a GGUF on a CPU in
    float32 (elsewhere it falls back to float), ``"int8"``/``"int4"`` always
    (``quantization_choice`` then refuses what this machine cannot run)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "auto":
        return is_gguf and device.type == "cpu" and dtype == torch.float32
    return quantization != "none"


def load_safetensors_quantized(
    folder: Path, config: ModelConfig, choice: KernelChoice, cpu_paths: CpuPaths, cache_dir: Path | None
) -> LlamaForCausalLM:
    """The float checkpoint in ``folder``, quantized round-to-nearest in
    ``choice.scheme`` (once: the result is cached, ``rtn_cache``)."""
    from ..loader import find_shards

    scheme = f"int{choice.kernel.bits}"
    shards = find_shards(folder)
    cached = rtn_cache.cache_dir_for(folder, shards, scheme, choice.group_size, cache_dir)
    if not cached.is_dir():
        logger.info("%s: quantizing to %s once into %s", folder.name, scheme, cached)
        rtn_cache.write(cached, _safetensors_tensors(shards), scheme, choice.group_size)
    return build_quantized(rtn_cache.read(cached), config, choice, source=folder, cpu_paths=cpu_paths)


def _safetensors_tensors(shards: list[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).float()
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{shard}: cannot read: {exc}") from None
