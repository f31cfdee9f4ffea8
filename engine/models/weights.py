"""Hugging Face checkpoint names onto a model's (fused) parameters: which
slice of which parameter each name fills (``weight_targets``), and the copy
(``copy_weights``). q/k/v fill one fused projection and gate/up another."""

from __future__ import annotations

import re
from collections.abc import Iterable
import torch
from torch import nn

from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import ModelLoadError

# Checkpoint buffers derived from the config, never weights we load.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*rotary_emb\.(cos|sin)_cached$")

# A parameter, and the rows of it a checkpoint tensor fills (None: all).
Target = tuple[torch.Tensor, int | None, int | None]


def weight_targets(model: nn.Module) -> dict[str, Target]:
    """Each checkpoint name -> (parameter, row slice) it fills, for a
    Llama-family model (``models.llama.LlamaForCausalLM``; typed loosely so
    this module need not import the family that imports it)."""
    c = model.config
    q_rows = c.num_attention_heads * c.head_dim
    kv_rows = c.num_key_value_heads * c.head_dim
    targets: dict[str, Target] = {
        "model.embed_tokens.weight": (model.embed_tokens, None, None),
        "model.norm.weight": (model.norm, None, None),
        "lm_head.weight": (model.lm_head, None, None),
    }
    if model.lm_head is None:
        del targets["lm_head.weight"]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if layer.qkv_proj is None:  # quantized: the projections load through engine/loading/compressed.py
            targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, None, None)
            targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None, None)
            continue
        qkv = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for n, (a, b) in qkv.items():
            targets[f"{p}self_attn.{n}_proj.weight"] = (layer.qkv_proj, a, b)
            if layer.qkv_bias is not None:
                targets[f"{p}self_attn.{n}_proj.bias"] = (layer.qkv_bias, a, b)
        targets[f"{p}self_attn.o_proj.weight"] = (layer.o_proj, None, None)
        if layer.o_bias is not None:
            targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, None, None)
        inter = c.intermediate_size
        targets[f"{p}mlp.gate_proj.weight"] = (layer.gate_up_proj, 0, inter)
        targets[f"{p}mlp.up_proj.weight"] = (layer.gate_up_proj, inter, 2 * inter)
        targets[f"{p}mlp.down_proj.weight"] = (layer.down_proj, None, None)
        targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, None, None)
        targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None, None)
    return targets


def copy_weights(targets: dict[str, Target], weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig) -> set[str]:
    """Copy Hugging Face-named tensors into ``targets``, converting dtype and
    device; return the names loaded (see ``LlamaForCausalLM.load_weights``)."""
    loaded: set[str] = set()
    # inference_mode allows the in-place copy whether or not the
    # parameters were created under inference mode.
    with torch.inference_mode():
        for name, tensor in weights:
            if _IGNORED.fullmatch(name):
                continue
            target = targets.get(name)
            if target is None:
                raise ModelLoadError(f"unknown weight {name!r} for {config.architecture}")
            param, start, stop = target
            dest = param if start is None else param[start:stop]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(f"weight {name!r}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                dest.copy_(tensor)
            loaded.add(name)
    return loaded
