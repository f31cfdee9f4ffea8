"""Hugging Face checkpoint names onto a model's (fused) parameters: which
slice of which parameter each name fills (``weight_targets``), and the copy
(``copy_weights``). q/k/v fill one fused projection and gate/up another;
gpt-oss's MXFP4 experts decode into their float parameters (``Mxfp4Pairs``)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

import attrs
import torch
from torch import nn

from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels import mxfp4

# Checkpoint buffers derived from the config, never weights we load.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*rotary_emb\.(cos|sin)_cached$")

# A parameter, the rows of it a checkpoint tensor fills (None: all), and
# what is added to the tensor on the way (Gemma's norms hold 1 + weight).
Target = tuple[torch.Tensor, int | None, int | None, float]

# gpt-oss's MXFP4 experts: a fused float tensor's name with _blocks or _scales.
_MXFP4_HALF = re.compile(r"(.*\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)")


@attrs.define
class Mxfp4Pairs:
    """gpt-oss's MXFP4 expert tensors on the float path. Each fused tensor
    comes as two, ``{name}_blocks`` and ``{name}_scales``: whichever arrives
    first is held until the other does (loading threads share this, and
    the two halves may sit in different shards), then the pair decodes
    into ``{name}``'s float target, one expert at a time so that a layer's
    experts are never all float at once beside the parameters."""

    _held: dict[str, torch.Tensor] = attrs.field(factory=dict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @staticmethod
    def fused_name(name: str) -> str | None:
        """The float tensor's name that ``name`` is half of; None where
        ``name`` is not half of an MXFP4 pair."""
        match = _MXFP4_HALF.fullmatch(name)
        return None if match is None else match.group(1)

    def take(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hold ``name``'s half; once its other half is in, return the
        blocks and the scales (and hold neither)."""
        match = _MXFP4_HALF.fullmatch(name)
        assert match is not None
        fused, half = match.groups()
        other = f"{fused}_{'scales' if half == 'blocks' else 'blocks'}"
        with self._lock:
            partner = self._held.pop(other, None)
            if partner is None:
                self._held[name] = tensor
                return None
        return (tensor, partner) if half == "blocks" else (partner, tensor)


def _copy_mxfp4(fused: str, blocks: torch.Tensor, scales: torch.Tensor, target: Target) -> None:
    """Decode an MXFP4 pair (``[experts, out, in / 32, 16]`` blocks and
    ``[experts, out, in / 32]`` scales) into ``fused``'s target, which holds
    it as the checkpoint's float tensor would be: ``[experts, in, out]``.
    Exact: every MXFP4 value is a float32."""
    param, start, stop, _ = target
    dest = param if start is None else param[start:stop]
    if blocks.dim() != 4 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ModelLoadError(
            f"weight {fused + '_blocks'!r}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
            f"are not [experts, out, groups, {mxfp4.GROUP // 2}] and [experts, out, groups]"
        )
    experts, out, groups = blocks.shape[:3]
    if (experts, groups * mxfp4.GROUP, out) != tuple(dest.shape):
        raise ModelLoadError(
            f"weight {fused + '_blocks'!r}: decodes to shape {(experts, groups * mxfp4.GROUP, out)}, "
            f"expected {tuple(dest.shape)}"
        )
    for e in range(experts):
        dest[e].copy_(mxfp4.decode_hf(blocks[e], scales[e], f"{fused}_blocks").dequantize().T)


def weight_targets(model: nn.Module) -> dict[str, Target]:
    """Each checkpoint name -> (parameter, row slice) it fills, for a
    Llama-family model (``models.llama.LlamaForCausalLM``; typed loosely so
    this module need not import the family that imports it)."""
    c = model.config
    q_rows = c.num_attention_heads * c.head_dim
    kv_rows = c.num_key_value_heads * c.head_dim
    offset = c.norm_weight_offset
    targets: dict[str, Target] = {
        "model.embed_tokens.weight": (model.embed_tokens, None, None, 0.0),
        "model.norm.weight": (model.norm, None, None, offset),
        "lm_head.weight": (model.lm_head, None, None, 0.0),
    }
    if model.lm_head is None:
        del targets["lm_head.weight"]
    norms = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "self_attn.q_norm", "self_attn.k_norm",
    )  # fmt: skip
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for name in norms:
            param = getattr(layer, name.removeprefix("self_attn."))
            if param is not None:
                targets[f"{p}{name}.weight"] = (param, None, None, offset)
        if layer.sinks is not None:  # gpt-oss's attention sinks, one logit per head
            targets[f"{p}self_attn.sinks"] = (layer.sinks, None, None, 0.0)
        if layer.mlp is not None:  # a mixture of experts: the sparse block's names (models/moe_weights.py)
            targets.update(layer.mlp_targets(p)[0])
        if layer.qkv_proj is None:  # quantized: the projections load through engine/loading/compressed.py
            continue
        qkv = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for n, (a, b) in qkv.items():
            targets[f"{p}self_attn.{n}_proj.weight"] = (layer.qkv_proj, a, b, 0.0)
            if layer.qkv_bias is not None:
                targets[f"{p}self_attn.{n}_proj.bias"] = (layer.qkv_bias, a, b, 0.0)
        targets[f"{p}self_attn.o_proj.weight"] = (layer.o_proj, None, None, 0.0)
        if layer.o_bias is not None:
            targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, None, None, 0.0)
        inter = c.intermediate_size
        if layer.gate_up_proj is None:
            continue
        targets[f"{p}mlp.gate_proj.weight"] = (layer.gate_up_proj, 0, inter, 0.0)
        targets[f"{p}mlp.up_proj.weight"] = (layer.gate_up_proj, inter, 2 * inter, 0.0)
        targets[f"{p}mlp.down_proj.weight"] = (layer.down_proj, None, None, 0.0)
    return targets


def fused_names(name: str, config: ModelConfig) -> list[tuple[str, slice]]:
    """A fused checkpoint tensor's parts under the separate names
    ``weight_targets`` knows, each with its rows (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``); empty for any other name."""
    m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight", name)
    if m is None:
        return []
    p, which = m.groups()
    if which == "mlp.gate_up_proj":
        inter = config.intermediate_size
        return [(f"{p}mlp.gate_proj.weight", slice(0, inter)), (f"{p}mlp.up_proj.weight", slice(inter, 2 * inter))]
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    return [
        (f"{p}self_attn.q_proj.weight", slice(0, q_rows)),
        (f"{p}self_attn.k_proj.weight", slice(q_rows, q_rows + kv_rows)),
        (f"{p}self_attn.v_proj.weight", slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
    ]


def copy_weights(
    targets: dict[str, Target],
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    mxfp4_pairs: Mxfp4Pairs | None = None,
) -> set[str]:
    """Copy Hugging Face-named tensors into ``targets``, converting dtype and
    device; return the names loaded (see ``LlamaForCausalLM.load_weights``).
    With ``mxfp4_pairs``, MXFP4 halves of a float target are decoded into it
    once both are in; the fused name counts as loaded then."""
    loaded: set[str] = set()
    # inference_mode allows the in-place copy whether or not the
    # parameters were created under inference mode.
    with torch.inference_mode():
        for name, tensor in weights:
            if _IGNORED.fullmatch(name):
                continue
            fused = None if mxfp4_pairs is None else mxfp4_pairs.fused_name(name)
            if fused is not None:
                assert mxfp4_pairs is not None
                if fused not in targets:
                    raise ModelLoadError(f"unknown weight {name!r} for {config.architecture}")
                pair = mxfp4_pairs.take(name, tensor)
                if pair is not None:
                    _copy_mxfp4(fused, *pair, targets[fused])
                    loaded |= {f"{fused}_blocks", f"{fused}_scales", fused}
                continue
            parts = fused_names(name, config)
            if parts:
                rows = sum(s.stop - s.start for _, s in parts)
                if tensor.dim() != 2 or tensor.shape[0] != rows:
                    raise ModelLoadError(f"weight {name!r}: expected {rows} rows, got shape {tuple(tensor.shape)}")
                loaded |= copy_weights(targets, [(n, tensor[s]) for n, s in parts], config)
                loaded.add(name)
                continue
            target = targets.get(name)
            if target is None:
                raise ModelLoadError(f"unknown weight {name!r} for {config.architecture}")
            param, start, stop, offset = target
            dest = param if start is None else param[start:stop]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(f"weight {name!r}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                dest.copy_(tensor.float() + offset if offset else tensor)
            loaded.add(name)
    return loaded
