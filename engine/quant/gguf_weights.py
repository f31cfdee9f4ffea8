"""A GGUF file's tensors, read straight from the file under Hugging Face names.

Q4_0 and Q4_1 tensors come out as ``Int4Weight`` (groups of 32, exactly the
file's values: Q4_0 is ``(q - 8) d``, Q4_1 is ``q d + m = (q - 8) d + (m + 8 d)``);
Q8_0 as ``Int8GroupWeight`` (the file's int8 values and block scales; its
``dequantize`` is exact, and a kernel requantizes it per channel, one more
rounding); F32, F16 and BF16
as float32 tensors. Any other type is a ``ModelLoadError`` naming the tensor.
llama.cpp stores a Llama's q and k rows in another order for its rotary
layout; they are put back (a permutation of rows, so exact on quantized rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from .rtn import Int4Weight, Int8GroupWeight

Compressed = Int4Weight | Int8GroupWeight

GROUP = 32  # the block size of Q4_0, Q4_1 and Q8_0
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Derived from the config, never loaded.
_SKIPPED = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one that is derived, not loaded."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in _IN_LAYER:
        return f"model.layers.{match.group(1)}.{_IN_LAYER[match.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def _fp16(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """Each block's 16 bytes as its 32 values: low nibbles first, then high."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def decode_q4(kind: str, data: np.ndarray) -> Int4Weight:
    """Q4_0 or Q4_1 rows (``[out, blocks * bytes]`` uint8) as an ``Int4Weight``."""
    size = 18 if kind == "Q4_0" else 20
    out = data.shape[0]
    blocks = data.reshape(out, -1, size)
    d = _fp16(blocks, 0)
    zero = _fp16(blocks, 2) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    q = _nibbles(blocks[..., size - 16 :])
    return Int4Weight(q.reshape(out, -1), d, zero, GROUP)


def decode_q8_0_blocks(data: np.ndarray) -> Int8GroupWeight:
    """Q8_0 rows (``[out, blocks * 34]`` uint8) as an ``Int8GroupWeight``: ``q * d`` per block of 32."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 34)
    d = _fp16(blocks, 0)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    return Int8GroupWeight(q.reshape(out, -1), d, GROUP)


def decode_q8_0(data: np.ndarray) -> torch.Tensor:
    """Q8_0 rows as float32: ``q * d`` per block of 32, exactly."""
    return decode_q8_0_blocks(data).dequantize()


def _unpermute(weight: torch.Tensor | Compressed, heads: int) -> torch.Tensor | Compressed:
    """Undo llama.cpp's rotary row order for a q or k weight of ``heads`` heads."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        # llama.cpp stores each head's rows (2, half) as (half, 2): read the
        # stored rows as (half, 2) and put them back as (2, half).
        return t.reshape(heads, n // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    if isinstance(weight, Int4Weight):
        return Int4Weight(rows(weight.q), rows(weight.scale), rows(weight.zero), weight.group_size)
    if isinstance(weight, Int8GroupWeight):
        return Int8GroupWeight(rows(weight.q), rows(weight.scale), weight.group_size)
    return rows(weight)


def read_tensors(path: Path, *, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | Compressed]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the GGUF at ``path``, one at a time."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct.error, OSError...
        raise ModelLoadError(f"{path}: not a readable GGUF file: {type(exc).__name__}: {exc}") from None
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else ""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has GGUF type {kind}, which trioserve cannot load "
                f"compressed (supported: {', '.join(SUPPORTED_TYPES)}); use --quantization none to dequantize it"
            )
        data = np.asarray(tensor.data)
        if kind in ("Q4_0", "Q4_1"):
            value: torch.Tensor | Compressed = decode_q4(kind, data)
        elif kind == "Q8_0":
            value = decode_q8_0_blocks(data)
        elif kind == "BF16":
            bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
            value = torch.from_numpy(bits.view(np.float32))
        else:
            value = torch.from_numpy(np.array(data, dtype=np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _unpermute(value, num_heads if "q_proj" in name else num_kv_heads)
        yield name, value
