"""A GGUF file's tensors, read straight from the file under Hugging Face names.

Q4_0, Q4_1 and Q4_K tensors come out as ``Int4Weight`` (groups of 32, exactly
the file's values: Q4_0 is ``(q - 8) d``, Q4_1 is ``q d + m = (q - 8) d + (m + 8 d)``,
and Q4_K's sub-blocks of 32 are Q4_1's form with ``d = d_super * sc`` and
``m = -dmin * min``). Q8_0, Q5_0 and Q6_K as ``Int8GroupWeight``, exactly
(Q8_0 ``q d`` and Q5_0 ``(q - 16) d`` in groups of 32, Q6_K ``(q - 32) d sc``
in sub-blocks of 16, a ``q6k_lanes.Q6KGroups`` that keeps the file's rows for
the kernels that read Q6_K itself and decodes them only when asked); Q5_1 and Q5_K, whose 5-bit values carry an offset an
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

Start-up reads the file once: the header without parsing the vocabulary
(``gguf_file``), each tensor's bytes from the mapped file when the model
reaches it, decoded a chunk of rows at a time (``by_rows``: numpy over the
blocks, the chunk's temporaries in cache) into the result's rows. Where
the native library is built (``repack_ops``), a Q4_K tensor comes as a
``q4k_blocks.Q4KBlocks`` instead: its steps decoded in one native pass
(csrc/gguf_repack.cpp), its values only when a consumer asks (the 4-bit
lanes are laid out from the file's nibbles); the same bits as numpy's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels import mxfp4
from trioserve.engine.kernels import native
from trioserve.engine.kernels.q4k_blocks import Q4KBlocks, read_only
from trioserve.engine.kernels.q6k_lanes import Q6KGroups
from trioserve.engine.loading.gguf_file import GGUFFile
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


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """Each block's float16 at byte ``at``, as float32 ``[rows, blocks]``."""
    return blocks[..., at : at + 2].view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, into: np.ndarray) -> None:
    """Each block's 16 bytes ``qs`` (``[..., 16]``) as its 32 values into
    ``into`` (``[..., 2, 16]``): low nibbles first, then high."""
    np.bitwise_and(qs, 0x0F, out=into[..., 0, :])
    np.right_shift(qs, 4, out=into[..., 1, :])


def decode_q4(kind: str, data: np.ndarray) -> Int4Weight:
    """Q4_0 or Q4_1 rows (``[out, blocks * bytes]`` uint8) as an ``Int4Weight``."""
    size = 18 if kind == "Q4_0" else 20
    out = data.shape[0]
    blocks = data.reshape(out, -1, size)
    d = _half(blocks, 0)
    zero = _half(blocks, 2) + 8 * d if kind == "Q4_1" else np.zeros_like(d)
    q = np.empty((out, blocks.shape[1], 2, 16), dtype=np.uint8)
    _nibbles(blocks[..., size - 16 :], q)
    return Int4Weight(torch.from_numpy(q.reshape(out, -1)), torch.from_numpy(d), torch.from_numpy(zero), GROUP)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant block's 12 bytes of 6-bit ``(sc, min)`` pairs (``[..., 12]``)
    as its 8 scales and 8 minimums (gguf-py's ``Q4_K.get_scale_min``, over
    every block at once)."""
    d, m, m_d = (packed[..., 4 * i : 4 * i + 4] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def decode_q4_k(data: np.ndarray) -> Int4Weight:
    """Q4_K rows (``[out, blocks * 144]`` uint8) as an ``Int4Weight`` in
    groups of 32: a block of 256 is float16 ``d`` and ``dmin``, 8 pairs of
    6-bit ``(sc, min)`` and the nibbles (a 64-value chunk's low nibbles are
    its first sub-block, the high ones its second); a value is
    ``q d sc - dmin min``, each sub-block's step ``d sc`` and offset
    ``dmin min`` the float32 products the reference computes."""
    out, values = data.shape[0], data.shape[1] // 144 * 256
    q = np.empty((out, values), dtype=np.uint8)
    scale, zero = (np.empty((out, values // GROUP), dtype=np.float32) for _ in range(2))
    _q4_k_into(data, (q, scale, zero))
    return Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), GROUP)


def _q4_k_into(data: np.ndarray, into: tuple[np.ndarray, ...]) -> None:
    """``decode_q4_k(data)``'s values, steps and offsets written into
    ``into`` (``q``, ``scale``, ``zero``: ``data``'s rows of the result)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 144)
    n = blocks.shape[1]
    q, scale, zero = (a.reshape(out, n, -1) for a in into)
    sc, mins = _k_scale_min(blocks[..., 4:16])
    np.multiply(_half(blocks, 0)[..., None], sc.astype(np.float32), out=scale)  # [out, n, 8]
    np.multiply(scale, np.float32(8), out=zero)
    zero -= _half(blocks, 2)[..., None] * mins.astype(np.float32)
    chunks = blocks[..., 16:].reshape(out, n, 4, 32)
    q = q.reshape(out, n, 4, 2, 32)  # [out, blocks, chunk, low/high, 32]
    np.bitwise_and(chunks, 0x0F, out=q[..., 0, :])
    np.right_shift(chunks, 4, out=q[..., 1, :])


def decode_q5_0(data: np.ndarray) -> Int8GroupWeight:
    """Q5_0 rows (``[out, blocks * 22]`` uint8) as an ``Int8GroupWeight``:
    ``(q - 16) d`` per block of 32, ``q``'s fifth bit from the block's 32-bit
    mask (little-endian: value ``j``'s is bit ``j``)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 22)
    n = blocks.shape[1]
    q = np.empty((out, n, 2, 16), dtype=np.uint8)
    _nibbles(blocks[..., 6:], q)
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").reshape(q.shape)
    q |= high << 4
    q -= 16  # 0..31 to -16..15, read as int8 below
    q = torch.from_numpy(q.view(np.int8).reshape(out, -1))
    return Int8GroupWeight(q, torch.from_numpy(_half(blocks, 0)), GROUP)


_Q6_LOW_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
_Q6_HIGH_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)


def decode_q6_k(data: np.ndarray) -> Int8GroupWeight:
    """Q6_K rows (``[out, blocks * 210]`` uint8) as an ``Int8GroupWeight`` in
    groups of 16: a block of 256 holds each value's low 4 bits (128 bytes),
    its high 2 bits (64 bytes), 16 int8 scales and a float16 ``d``; a value
    is ``(q - 32) d sc``. Each half of 128 values takes its low bits from 64
    bytes (low nibbles first) and its high bits from 32 (two bits a value,
    lowest first)."""
    out, values = data.shape[0], data.shape[1] // 210 * 256
    q = np.empty((out, values), dtype=np.int8)
    scale = np.empty((out, values // 16), dtype=np.float32)
    _q6_k_into(data, (q, scale))
    return Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(scale), 16)


def _q6_k_into(data: np.ndarray, into: tuple[np.ndarray, ...]) -> None:
    """``decode_q6_k(data)``'s values and steps written into ``into``
    (``q``, ``scale``: ``data``'s rows of the result)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 210)
    n = blocks.shape[1]
    q = into[0].view(np.uint8).reshape(out, n, 2, 2, 64)  # [out, n, half, low/high nibble, 64]
    np.right_shift(blocks[..., :128].reshape(out, n, 2, 1, 64), _Q6_LOW_SHIFTS, out=q)
    q &= 0x0F
    high = np.right_shift(blocks[..., 128:192].reshape(out, n, 2, 1, 32), _Q6_HIGH_SHIFTS)  # [out, n, half, 4, 32]
    high &= 0x03
    high <<= 4
    q |= high.reshape(q.shape)
    q -= 32  # 0..63 to -32..31, read as int8
    scale = into[1].reshape(out, n, 16)
    np.multiply(_half(blocks, 208)[..., None], blocks[..., 192:208].view(np.int8).astype(np.float32), out=scale)


def decode_q6_k_rows(data: np.ndarray) -> Int8GroupWeight:
    """``decode_q6_k(data)``, a chunk of rows at a time (``by_rows``): how
    a ``Q6KGroups`` makes its int8 groups when first asked."""
    return by_rows(decode_q6_k, data)  # type: ignore[return-value]


def requantize_int8(kind: str, data: np.ndarray) -> Int8GroupWeight:
    """Rows of ``kind`` (Q5_1, Q5_K) dequantized by gguf's reference and
    rounded to int8 in groups of 32."""
    import gguf

    dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return quantize_int8_groups(torch.from_numpy(np.ascontiguousarray(dense)), GROUP)


# The block bytes decoded at once (by_rows): a chunk's values and
# temporaries (a few bytes a value) stay in a core's cache, so each byte of
# the file is read from memory once and each value written once. The
# decoders and the copies are numpy's, on the calling thread: torch's
# parallel regions, one a chunk, wait on each other's threads, and on a
# busy machine every wait is a scheduler's time slice.
_CHUNK_BYTES = 1 << 20


def _arrays(weight: Compressed) -> list[np.ndarray]:
    parts = (weight.q, weight.scale, weight.zero) if isinstance(weight, Int4Weight) else (weight.q, weight.scale)
    return [p.numpy() for p in parts]


def by_rows(decode: Callable[[np.ndarray], Compressed], data: np.ndarray, rows_at_once: int | None = None) -> Compressed:
    """``decode(data)``, ``rows_at_once`` rows of blocks at a time (by
    default ``_CHUNK_BYTES`` of them), each part written into the result's
    rows as it is decoded: a vocabulary's table (151,936 rows for Qwen2.5)
    decoded whole would pass through several bytes a value of temporaries
    (float32 ones for Q5_1 and Q5_K), where the result holds one."""
    out = data.shape[0]
    if rows_at_once is None:
        rows_at_once = max(1, _CHUNK_BYTES // max(1, data[:1].nbytes))
    into = _INTO.get(decode)
    if into is not None and out > rows_at_once:  # each chunk decoded into its rows of the result: no copy
        first = decode(data[:1])  # the parts' widths and types
        whole = [np.empty((out, *p.shape[1:]), dtype=p.dtype) for p in _arrays(first)]
        for start in range(0, out, rows_at_once):
            into(data[start : start + rows_at_once], tuple(w[start : start + rows_at_once] for w in whole))
        return _like(first, whole)
    first = decode(data[:rows_at_once])
    if out <= rows_at_once:
        return first
    whole = [np.empty((out, *p.shape[1:]), dtype=p.dtype) for p in _arrays(first)]
    for start in range(0, out, rows_at_once):
        part = first if start == 0 else decode(data[start : start + rows_at_once])
        for rows, value in zip(whole, _arrays(part)):
            rows[start : start + rows_at_once] = value
    return _like(first, whole)


def _like(first: Compressed, arrays: list[np.ndarray]) -> Compressed:
    """``arrays`` (``_arrays``' parts) as a weight of ``first``'s kind and group size."""
    q, scale, *zero = (torch.from_numpy(a) for a in arrays)
    if isinstance(first, Int4Weight):
        return Int4Weight(q, scale, zero[0], first.group_size)
    return Int8GroupWeight(q, scale, first.group_size)


def decode_q8_0_blocks(data: np.ndarray) -> Int8GroupWeight:
    """Q8_0 rows (``[out, blocks * 34]`` uint8) as an ``Int8GroupWeight``: ``q * d`` per block of 32."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return Int8GroupWeight(torch.from_numpy(q.reshape(out, -1)), torch.from_numpy(_half(blocks, 0)), GROUP)


def decode_q8_0(data: np.ndarray) -> torch.Tensor:
    """Q8_0 rows as float32: ``q * d`` per block of 32, exactly."""
    return decode_q8_0_blocks(data).dequantize()


_DECODERS = {"Q4_K": decode_q4_k, "Q5_0": decode_q5_0, "Q6_K": decode_q6_k, "Q8_0": decode_q8_0_blocks}
# The decoders that write a chunk straight into its rows of the whole
# result (``by_rows``): the K-quants, most of a Q4_K_M file's bytes.
_INTO: dict[Callable[[np.ndarray], Compressed], Callable[[np.ndarray, tuple[np.ndarray, ...]], None]] = {
    decode_q4_k: _q4_k_into,
    decode_q6_k: _q6_k_into,
}


def _unpermute(weight: torch.Tensor | Compressed, heads: int) -> torch.Tensor | Compressed:
    """Undo llama.cpp's rotary row order for a q or k weight of ``heads`` heads."""

    def put_back(a: np.ndarray) -> np.ndarray:
        n = a.shape[0]
        # llama.cpp stores each head's rows (2, half) as (half, 2): read the
        # stored rows as (half, 2) and put them back as (2, half). (numpy's
        # copy, on this thread: see _CHUNK_BYTES.)
        swapped = a.reshape(heads, n // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2)
        return np.ascontiguousarray(swapped).reshape(a.shape)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(put_back(t.numpy()))

    if isinstance(weight, Q4KBlocks):  # its blocks' rows put back, with its steps': its values alike, if ever made
        return weight.rows_of(put_back)
    if isinstance(weight, Int4Weight):
        return Int4Weight(rows(weight.q), rows(weight.scale), rows(weight.zero), weight.group_size)
    if isinstance(weight, Q6KGroups):  # its blocks' rows put back: decoded alike, if ever
        return weight.rows_of(put_back(weight.blocks))
    if isinstance(weight, Int8GroupWeight):
        return Int8GroupWeight(rows(weight.q), rows(weight.scale), weight.group_size)
    return rows(weight)


def _check_scales(path: Path, name: str, kind: str, weight: Compressed) -> None:
    """Raise ``ModelLoadError`` naming tensor ``name`` when ``weight``'s
    scales are not finite, or a 4-bit group's step or offset does not fit
    in float16: either would come out of every matmul as inf or NaN. Read
    ``_CHUNK_BYTES`` of scales at a time (numpy's, as ``by_rows``)."""
    scales = weight.scale.numpy()
    zeros = weight.zero.numpy() if isinstance(weight, Int4Weight) else None
    rows = max(1, _CHUNK_BYTES // max(1, scales[:1].nbytes))
    finite, largest = True, 0.0
    for start in range(0, scales.shape[0], rows):
        scale = scales[start : start + rows]
        finite = bool(np.isfinite(scale).all())
        if finite and zeros is not None:
            zero = zeros[start : start + rows]
            finite = bool(np.isfinite(zero).all())
            if finite:
                offset = np.abs(zero - 8 * scale).max(initial=0)
                largest = max(largest, float(np.abs(scale).max(initial=0)), float(offset))
        if not finite:
            raise _damaged(path, name, kind)
    if largest > _FLOAT16_MAX:
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({kind}) has a group scale of {largest:.4g}, beyond float16's range "
            f"({_FLOAT16_MAX:g}), which the native 4-bit kernel holds scales in; use --quantization none to "
            f"dequantize it"
        )


def _damaged(path: Path, name: str, kind: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: tensor {name!r} ({kind}) has scales that are not finite numbers: the file is damaged")


def _check_finite(path: Path, name: str, kind: str, scales: np.ndarray) -> None:
    """Raise ``_damaged`` naming tensor ``name`` unless every one of ``scales`` is finite."""
    if not np.isfinite(scales).all():
        raise _damaged(path, name, kind)


def repack_ops() -> object | None:
    """``torch.ops.trioserve`` where the native library is built (its
    csrc/gguf_repack.cpp decodes and lays out blocks in one pass, with the
    bits of the numpy here), else None: numpy's, as before."""
    try:
        return native.ops()
    except native.NativeUnavailable:
        return None


def _q4_k_values(data: np.ndarray) -> torch.Tensor:
    """``decode_q4_k(data).q`` natively: how a ``Q4KBlocks`` makes its values when asked."""
    ops = repack_ops()
    if ops is None:
        return decode_q4_k(data).q
    return ops.q4k_values(read_only(data))  # type: ignore[attr-defined]


def _decoded(path: Path, name: str, kind: str, data: np.ndarray) -> torch.Tensor | Compressed:
    """Tensor ``name``'s rows ``data`` of GGUF type ``kind`` as held (the module's docstring)."""
    data = np.ascontiguousarray(data)  # the decoders view a block's bytes as float16: no copy of the file's rows
    ops = repack_ops() if kind == "Q4_K" else None
    if ops is not None:
        # decode_q4_k's steps and offsets (csrc/gguf_repack.cpp, one pass);
        # its values only when asked: the 4-bit lanes are laid out from the
        # file's nibbles (q4k_blocks).
        scale, zero = ops.q4k_steps(read_only(data))  # type: ignore[attr-defined]
        value: torch.Tensor | Compressed = Q4KBlocks(data, scale, zero, _q4_k_values)
    elif kind in ("Q4_0", "Q4_1", "Q5_1", "Q5_K"):
        rows_of = decode_q4 if kind.startswith("Q4") else requantize_int8
        value = by_rows(lambda rows: rows_of(kind, rows), data)
    elif kind == "Q6_K":
        # The file's rows kept, decoded only if asked: avx512vnni and
        # avx2int8 run them at their width (q6k_lanes), and a model that
        # does never needs the int8 groups. Their steps ``d sc`` are finite
        # where ``d`` is (sc is a byte), so the blocks' d are what
        # _check_scales would check.
        _check_finite(path, name, kind, _half(data.reshape(data.shape[0], -1, 210), 208))
        return Q6KGroups(data, decode_q6_k_rows)
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
    """Yield ``(hf_name, tensor)`` for every tensor of the GGUF at ``path``,
    one at a time, each decoded from its bytes in the mapped file
    (``gguf_file``) when it is reached."""
    file = GGUFFile(path)
    arch = file.architecture
    for info in file.tensors:
        per_expert = expert_name(info.name, arch)
        name = hf_name(info.name, arch) if per_expert is None else per_expert
        if name is None:
            continue
        kind = info.type_name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {info.name!r} has GGUF type {kind}, which trioserve cannot load "
                f"compressed (supported: {', '.join(SUPPORTED_TYPES)}); use --quantization none to dequantize it"
            )
        data = file.data(info)
        if per_expert is not None:
            bias = info.name.endswith(".bias")
            if data.ndim != (2 if bias else 3):
                want = "[experts, out]" if bias else "[experts, out, in]"
                raise ModelLoadError(f"{path}: tensor {info.name!r}: expected {want}, got shape {data.shape}")
            for e in range(data.shape[0]):
                yield per_expert.format(expert=e), _decoded(path, info.name, kind, data[e])
            continue
        value = _decoded(path, info.name, kind, data)
        if arch in _PERMUTED and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            value = _unpermute(value, num_heads if "q_proj" in name else num_kv_heads)
        if arch in _SHIFTED_NORMS and name.endswith("norm.weight"):
            value = value - 1  # the model adds it back (ModelConfig.norm_weight_offset)
        yield name, value
