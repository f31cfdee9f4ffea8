"""A GGUF file's tensors, read straight from the file under Hugging Face names.

Q4_0, Q4_1 and Q4_K tensors come out as ``Int4Weight`` (groups of 32, exactly
the file's values: Q4_0 is ``(q - 8) d``, Q4_1 is ``q d + m = (q - 8) d + (m + 8 d)``,
and Q4_K's sub-blocks of 32 are Q4_1's form with ``d = d_super * sc`` and
``m = -dmin * min``). Q8_0, Q5_0 and Q6_K as ``Int8GroupWeight``, exactly
(Q8_0 ``q d`` and Q5_0 ``(q - 16) d`` in groups of 32, Q6_K ``(q - 32) d sc``
in sub-blocks of 16); Q5_1 and Q5_K, whose 5-bit values carry an offset an
int8 group has no room for, rounded to int8 in groups of 32 (the largest
value of a group to 127, as Q8_0 is made: one rounding, a quarter of their
own step or less). MXFP4 (gpt-oss's experts) as ``Int8GroupWeight``
exactly (``kernels/mxfp4``). A kernel requantizes an int8 group per channel where it
needs to (one more rounding). F32, F16 and BF16 as float32 tensors. Any
other type is a ``ModelLoadError`` naming the tensor, as is a quantized
tensor whose scales are not finite (a damaged file) or, for 4-bit groups,
beyond float16's range (the native kernel's blocks hold them in float16).
llama.cpp stores a Llama's q and k rows (weights and biases) in another
order for its rotary layout; they are put back (a permutation of rows, so
exact on quantized rows). Names follow each architecture's table (``hf_name``):
Gemma's norms, stored as ``1 + w``, come out as Hugging Face's ``w``; Phi-3's
fused ``attn_qkv`` and ``ffn_up`` as its fused names. A mixture's
``ffn_*_exps`` tensors (``[experts, out, in]``, every expert of a layer)
come out one expert at a time under the Hub's per-expert names (Qwen3-MoE's
``mlp.experts.E.gate_proj``, a Llama-architecture Mixtral's
``block_sparse_moe.experts.E.w1``), each decoded from its own rows of the
file, so no layer's experts are ever decoded whole; the router
(``ffn_gate_inp``) as ``mlp.gate`` (``block_sparse_moe.gate``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels import mxfp4
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, quantize_int8_groups

Compressed = Int4Weight | Int8GroupWeight

GROUP = 32  # the block size of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, and a K-quant's sub-block (Q6_K's: 16)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "MXFP4")
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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# What an architecture names otherwise (llama.cpp's tensor table): Gemma's
# ffn_norm is the MLP's input norm and its attention output has a norm of
# its own; Phi-3 keeps q/k/v and gate/up fused (``models/weights.fused_names``
# splits them by rows).
_GEMMA = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_BY_ARCH = {
    "llama": {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},  # Mixtral
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gpt-oss": {
        "attn_sinks.weight": "self_attn.sinks",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    },
}
# A mixture's stacked expert tensors -> which of an expert's (gate, up, down) each is.
# (gpt-oss's experts have biases, [experts, out], stacked the same way.)
_STACKED = re.compile(r"ffn_(gate|up|down)_exps\.(weight|bias)")
# Per architecture, the per-expert names: the block's prefix, then gate's,
# up's and down's (the Hub's, and for gpt-oss, whose checkpoints fuse all
# experts, moe_weights.ExpertCollector's).
_EXPERT_NAMES = {
    "llama": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "gpt-oss": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
# Architectures whose q and k rows llama.cpp permutes (its LlamaModel and subclasses).
_PERMUTED = ("llama", "smollm3")
# Architectures whose norms llama.cpp stores as 1 + w (Hugging Face's w).
_SHIFTED_NORMS = ("gemma2", "gemma3")
# Derived from the config, never loaded: llama3's and longrope's rotary tables.
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# The largest finite float16: the native 4-bit blocks hold a group's step
# and offset in float16 (int4_native.pack_blocks). A Q4_K sub-block's step
# is a float16 times a 6-bit scale, so a file can go past it.
_FLOAT16_MAX = 65504.0


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of ``arch`` (llama.cpp's
    architecture name); None for one that is derived, not loaded."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    table = {**_IN_LAYER, **_BY_ARCH.get(arch, {})}
    if match and match.group(2) in table:
        return f"model.layers.{match.group(1)}.{table[match.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a {arch or 'Llama'}-family model")


def expert_name(gguf_name: str, arch: str) -> str | None:
    """For a stacked expert tensor (``blk.N.ffn_gate_exps.weight``), the
    Hub's name of one expert's matrix with ``{expert}`` in place of its
    index; None for any other tensor."""
    match = _LAYER.fullmatch(gguf_name)
    stacked = None if match is None else _STACKED.fullmatch(match.group(2))
    if match is None or stacked is None:
        return None
    if arch not in _EXPERT_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r}: trioserve runs no mixture of experts of architecture {arch!r}")
    block, parts = _EXPERT_NAMES[arch]
    return f"model.layers.{match.group(1)}.{block}.experts.{{expert}}.{parts[stacked.group(1)]}.{stacked.group(2)}"


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


def decode_q4_k(data: np.ndarray) -> Int4Weight:
    """Q4_K rows (``[out, blocks * 144]`` uint8) as an ``Int4Weight`` in
    groups of 32: a block of 256 is float16 ``d`` and ``dmin``, 8 pairs of
    6-bit ``(sc, min)`` and the nibbles (a 64-value chunk's low nibbles are
    its first sub-block, the high ones its second); a value is
    ``q d sc - dmin min``, each sub-block's step ``d sc`` and offset
    ``dmin min`` the float32 products the reference computes."""
    import gguf

    out = data.shape[0]
    blocks = data.reshape(out, -1, 144)
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, mins = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = d[..., None] * torch.from_numpy(sc.astype(np.float32)).view(*d.shape, 8)
    offset = dmin[..., None] * torch.from_numpy(mins.astype(np.float32)).view(*d.shape, 8)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 16:])).view(out, -1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [out, blocks, chunk, low/high, 32]
    scale, offset = scale.reshape(out, -1), offset.reshape(out, -1)
    return Int4Weight(q.reshape(out, -1), scale, 8 * scale - offset, GROUP)


def decode_q5_0(data: np.ndarray) -> Int8GroupWeight:
    """Q5_0 rows (``[out, blocks * 22]`` uint8) as an ``Int8GroupWeight``:
    ``(q - 16) d`` per block of 32, ``q``'s fifth bit from the block's 32-bit mask."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 22)
    d = _fp16(blocks, 0)
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [out, blocks, 1]
    high = ((high >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles(blocks[..., 6:]) | torch.from_numpy(high << 4)
    return Int8GroupWeight((q.to(torch.int8) - 16).reshape(out, -1), d, GROUP)


def decode_q6_k(data: np.ndarray) -> Int8GroupWeight:
    """Q6_K rows (``[out, blocks * 210]`` uint8) as an ``Int8GroupWeight`` in
    groups of 16: a block of 256 holds each value's low 4 bits (128 bytes),
    its high 2 bits (64 bytes), 16 int8 scales and a float16 ``d``; a value
    is ``(q - 32) d sc``. Each half of 128 values takes its low bits from 64
    bytes (low nibbles first) and its high bits from 32 (two bits a value,
    lowest first)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 210)
    n = blocks.shape[1]
    low = np.ascontiguousarray(blocks[..., :128]).reshape(out, n, 2, 1, 64)
    low = (low >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [out, n, half, 2, 64]
    high = np.ascontiguousarray(blocks[..., 128:192]).reshape(out, n, 2, 1, 32)
    high = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [out, n, half, 4, 32]
    q = (low.reshape(out, n, 256) | (high.reshape(out, n, 256) << 4)).astype(np.int8) - np.int8(32)
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32))
    scale = _fp16(blocks, 208)[..., None] * sc  # [out, n, 16]
    return Int8GroupWeight(torch.from_numpy(q.reshape(out, -1)), scale.reshape(out, -1), 16)


def requantize_int8(kind: str, data: np.ndarray) -> Int8GroupWeight:
    """Rows of ``kind`` (Q5_1, Q5_K) dequantized by gguf's reference and
    rounded to int8 in groups of 32."""
    import gguf

    dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return quantize_int8_groups(torch.from_numpy(np.ascontiguousarray(dense)), GROUP)


def by_rows(decode: Callable[[np.ndarray], Compressed], data: np.ndarray, rows_at_once: int = 4096) -> Compressed:
    """``decode(data)``, ``rows_at_once`` rows of blocks at a time: a
    vocabulary's table (151,936 rows for Qwen2.5) decoded whole would pass
    through several bytes a value of temporaries (float32 ones for Q5_1 and
    Q5_K), where the result holds one."""
    if data.shape[0] <= rows_at_once:
        return decode(data)
    parts = [decode(data[i : i + rows_at_once]) for i in range(0, data.shape[0], rows_at_once)]
    first = parts[0]
    if isinstance(first, Int4Weight):
        return Int4Weight(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]), first.group_size,  # type: ignore[union-attr]
        )
    return Int8GroupWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), first.group_size)


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


_DECODERS = {"Q4_K": decode_q4_k, "Q5_0": decode_q5_0, "Q6_K": decode_q6_k, "Q8_0": decode_q8_0_blocks}


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


def _check_scales(path: Path, name: str, kind: str, weight: Compressed) -> None:
    """Raise ``ModelLoadError`` naming tensor ``name`` when ``weight``'s
    scales are not finite, or a 4-bit group's step or offset does not fit
    in float16: either would come out of every matmul as inf or NaN."""
    parts = (weight.scale, weight.zero) if isinstance(weight, Int4Weight) else (weight.scale,)
    if not all(bool(torch.isfinite(part).all()) for part in parts):
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({kind}) has scales that are not finite numbers: the file is damaged"
        )
    if isinstance(weight, Int4Weight):
        largest = max(float(weight.scale.abs().max()), float((weight.zero - 8 * weight.scale).abs().max()))
        if largest > _FLOAT16_MAX:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ({kind}) has a group scale of {largest:.4g}, beyond float16's range "
                f"({_FLOAT16_MAX:g}), which the native 4-bit kernel holds scales in; use --quantization none to "
                f"dequantize it"
            )


def _decoded(path: Path, name: str, kind: str, data: np.ndarray) -> torch.Tensor | Compressed:
    """Tensor ``name``'s rows ``data`` of GGUF type ``kind`` as held (the module's docstring)."""
    if kind in ("Q4_0", "Q4_1", "Q5_1", "Q5_K"):
        rows_of = decode_q4 if kind.startswith("Q4") else requantize_int8
        value: torch.Tensor | Compressed = by_rows(lambda rows: rows_of(kind, rows), data)
    elif kind in _DECODERS:
        value = by_rows(_DECODERS[kind], data)
    elif kind == "MXFP4":
        value = by_rows(lambda rows: mxfp4.decode_gguf(rows, name), data)
    elif kind == "BF16":
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        value = torch.from_numpy(bits.view(np.float32))
    else:
        value = torch.from_numpy(np.array(data, dtype=np.float32))
    if isinstance(value, Int4Weight | Int8GroupWeight):
        _check_scales(path, name, kind, value)
    return value


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
        per_expert = expert_name(tensor.name, arch)
        name = hf_name(tensor.name, arch) if per_expert is None else per_expert
        if name is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has GGUF type {kind}, which trioserve cannot load "
                f"compressed (supported: {', '.join(SUPPORTED_TYPES)}); use --quantization none to dequantize it"
            )
        data = np.asarray(tensor.data)
        if per_expert is not None:
            bias = tensor.name.endswith(".bias")
            if data.ndim != (2 if bias else 3):
                want = "[experts, out]" if bias else "[experts, out, in]"
                raise ModelLoadError(f"{path}: tensor {tensor.name!r}: expected {want}, got shape {data.shape}")
            for e in range(data.shape[0]):
                yield per_expert.format(expert=e), _decoded(path, tensor.name, kind, data[e])
            continue
        value = _decoded(path, tensor.name, kind, data)
        if arch in _PERMUTED and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            value = _unpermute(value, num_heads if "q_proj" in name else num_kv_heads)
        if arch in _SHIFTED_NORMS and name.endswith("norm.weight"):
            value = value - 1  # the model adds it back (ModelConfig.norm_weight_offset)
        yield name, value
