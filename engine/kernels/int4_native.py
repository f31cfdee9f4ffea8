"""4-bit groups on the native kernel (``csrc/linear.cpp``, loaded by ``native``).

Each group of 32 weights is one 20-byte block, ``w = q * d + m``: float16
``d`` and ``m``, then the 32 nibbles in GGUF's Q4 order (GGUF's Q4_1 block
byte for byte). That is
``Int4Weight``'s ``(q - 8) * scale + zero`` with ``d = scale`` and
``m = zero - 8 * scale``; a larger group is its scale repeated over each 32.
The activations stay float32, so the result is the dequantized weight's
matmul up to the order of the sums, except where a variant rounds them:
to int8 in groups of 32 in decode steps on ``avx512vnni`` and ``avx2int8``,
to bfloat16 in the panels of ``avx512bf16``, and to int16 in groups of 32
in the panels of ``avx2`` (``call_isa``).

On ``avx2int8`` and ``avx512vnni`` a matrix of whole panels of 16
channels is held as lanes blocks instead (``to_lanes``: the same bytes,
each block's nibbles with 16 channels in a 512-bit vector's lanes, 8 in
each 256-bit half), which their kernels read as they lie at every row
count (csrc/lanes_avx2.h, csrc/lanes_vnni.h); the kernels tell the layouts
by shape.

On a CPU with AMX tiles torch's bfloat16 GEMM (oneDNN) runs several times
faster than the bfloat16 panels: there a linear with ``gemm_from_rows``
runs calls of that many rows or more (a prompt's, through the model's
layers) as that GEMM over the matrix dequantized to bfloat16 for the call,
the same rounding of weights and activations as the panels'. The matrix
lives only for the call, so no second copy of the weights is kept. Only
outside batch-invariant mode, from ``choose.BF16_GEMM_FROM_ROWS`` rows:
the fused step, which a batch-invariant model runs every token on, never
calls it.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from trioserve.engine.kernels import onednn
from trioserve.engine.kernels import native
from trioserve.engine.kernels.q4k_blocks import Q4KBlocks
from trioserve.engine.kernels.rtn import Int4Weight, quantize_int4

GROUP = 32
BLOCK_BYTES = 20
# From this many rows a call on a variant without panels (scalar)
# dequantizes the matrix and runs torch's float32 GEMM: the row kernels are
# GEMV-shaped, and from 64-128 rows the GEMM's reuse pays for the
# conversion. The AVX2 and AVX-512 variants run panels from PANEL_FROM_ROWS
# rows instead (csrc/panel_avx2_int16.h, csrc/panel.h): on AVX2 the float32
# panels ran the default model's layers 1.2-1.5x faster than that GEMM (MKL
# capped to AVX2) at 128 to 2,048 rows, and the int16 panels that replaced
# them 1.4-1.5x faster again; on AVX-512 1.5-3.3x in float32 products,
# 2.8-4.3x in bfloat16 (docs/benchmarks.md). avx2int8's calls of 10 rows or
# more from the layers run avx2's panels (call_isa).
DEQUANTIZE_FROM_ROWS = 128
PANEL_ISAS = frozenset(native.ISAS[name] for name in ("avx2", "avx2int8", "avx512", "avx512bf16", "avx512vnni"))
# csrc/panel.h's kPanelFromRows: the AVX2 and AVX-512 variants' panels run from this many rows.
PANEL_FROM_ROWS = 10
_VNNI, _BF16 = native.ISAS["avx512vnni"], native.ISAS["avx512bf16"]
_AVX2_INT8, _AVX2 = native.ISAS["avx2int8"], native.ISAS["avx2"]
# The capability path of the bfloat16 GEMM over a call's dequantized matrix.
BF16_GEMM_PATH = "quant_int4_bf16_gemm"
# The most rows one bfloat16 GEMM multiplies; more go in slices of this
# many. A slice re-reads the matrix (oneDNN reorders it for the tiles on
# every call): one layer at 2,048 rows took 5.4 ms whole and 8.8 ms in
# slices of 1,024 (onednn.MAX_ROWS, the packed linears').
GEMM_MAX_ROWS = 4096


def gemm_rows(rows: int) -> int:
    """The row count the bfloat16 GEMM runs a call of ``rows`` rows at (at
    most ``GEMM_MAX_ROWS``): the next power of two. oneDNN builds and keeps
    a kernel for every row count it multiplies, about 2.5 MiB for one
    layer's four shapes on AMX (measured: 128 distinct counts took 330 MiB
    more), so a server meeting prompts of every length would grow without
    bound; powers of two leave 9 counts from 16 to 4,096 (about 22 MiB),
    for at most twice the rows' products."""
    return 1 << (rows - 1).bit_length()


def call_isa(isa: int, rows: int) -> int:
    """The variant a call of ``rows`` rows from the model's layers runs.

    ``avx512vnni``'s int8 kernels (csrc/panel_vnni.h, and csrc/rows_vnni.h
    with the same bits at up to 8 rows) are for decode steps and a
    speculative step's verification, which run in the fused call
    (``native_decode``, which passes ``isa`` itself, and its
    ``decode_head``). A prompt or a mixed batch of 10 rows or more, which
    runs through the model's layers, takes ``avx512bf16``'s bfloat16 panels
    instead: with int8 activations in the prompt the default model's
    greedy answer to "What is the capital of France?" left Paris (as
    llama-server's does), and a prompt's perplexity rose from +0.03% to
    +0.40% of float32's (docs/benchmarks.md). ``avx2int8`` likewise takes
    ``avx2``'s panels there, which round the activations to int16 in groups
    of 32 (csrc/panel_avx2_int16.h: 15 bits and a sign, against bfloat16's 8
    bits of mantissa)."""
    if rows >= PANEL_FROM_ROWS and isa in (_VNNI, _AVX2_INT8):
        return _BF16 if isa == _VNNI else _AVX2
    return isa


def dequantizes(isa: int, rows: int) -> bool:
    """Whether a call of ``rows`` rows on variant ``isa`` runs torch's GEMM over the dequantized matrix."""
    return rows >= DEQUANTIZE_FROM_ROWS and isa not in PANEL_ISAS


def pack_blocks(weight: Int4Weight) -> torch.Tensor:
    """``weight`` as the kernel's blocks, uint8 ``[out, in // 32, 20]``."""
    d, m = _steps(weight)
    return torch.from_numpy(_blocks(weight.q.numpy(), d, m).view(np.uint8))


def pack_lanes(weight: Int4Weight) -> torch.Tensor:
    """``to_lanes(pack_blocks(weight))`` (``out`` a multiple of 16), made
    straight from the values a chunk of panels at a time: the chunk's
    nibbles stay in a core's cache until they are laid out, and no matrix
    of blocks is made beside the lanes."""
    return pack_lanes_of([weight])


def pack_lanes_of(parts: list[Int4Weight]) -> torch.Tensor:
    """``pack_lanes`` of ``parts`` stacked by rows (each a multiple of 16
    rows, one width), each packed into its own panels: the same bytes, with
    no stacked copy of the values made first (a fused qkv or gate_up)."""
    k = _shape(parts[0])[1]
    panels = sum(_shape(part)[0] for part in parts) // LANES_CHANNELS
    lanes = np.empty((panels, k // GROUP, LANES_BLOCK_BYTES // 4), dtype=np.uint32)
    at = 0
    for part in parts:
        n = _shape(part)[0] // LANES_CHANNELS
        _pack_lanes_into(part, lanes[at : at + n])
        at += n
    return torch.from_numpy(lanes.view(np.uint8))


def _shape(weight: Int4Weight) -> tuple[int, int]:
    """``weight``'s ``(out, in)``, without making a ``Q4KBlocks``' values."""
    return weight.shape if isinstance(weight, Q4KBlocks) else tuple(weight.q.shape)  # type: ignore[return-value]


def _pack_lanes_into(weight: Int4Weight, lanes: np.ndarray) -> None:
    """``weight``'s lanes blocks into ``lanes`` (uint32 ``[out // 16, in // 32, 80]``):
    csrc/gguf_repack.cpp's ``q4_lanes_into`` where the library is built (one
    pass, 2-3x numpy's time less), else ``_pack_lanes_numpy``; the same bytes."""
    try:
        ops = native.ops()
    except native.NativeUnavailable:
        ops = None
    if ops is None:
        _pack_lanes_numpy(weight, lanes)
        return
    if isinstance(weight, Q4KBlocks) and not weight.decoded:  # from the file's nibbles: no values made
        weight.pack_lanes_into(lanes, ops)
        return
    if weight.group_size % GROUP:
        _steps(weight)  # raises, naming the group size
    parts = (weight.q.contiguous(), weight.scale.float().contiguous(), weight.zero.float().contiguous())
    ops.q4_lanes_into(*parts, weight.group_size, torch.from_numpy(lanes.view(np.uint8)))  # type: ignore[attr-defined]


def _pack_lanes_numpy(weight: Int4Weight, lanes: np.ndarray) -> None:
    """``_pack_lanes_into`` in numpy, a chunk of panels at a time."""
    out, k = weight.q.shape
    d, m = _steps(weight)
    q = weight.q.numpy()
    panels, groups = out // LANES_CHANNELS, k // GROUP
    nibble_words = LANES_NIBBLE_BYTES // 4
    step = max(1, _CHUNK_VALUES // (LANES_CHANNELS * k))
    for p in range(0, panels, step):
        rows, into = slice(p * LANES_CHANNELS, (p + step) * LANES_CHANNELS), lanes[p : p + step]
        n = into.shape[0]
        words = _nibbles(q[rows]).reshape(n, LANES_CHANNELS, groups, 4)
        into[..., :nibble_words].reshape(n, groups, 4, LANES_CHANNELS)[...] = words.transpose(0, 2, 3, 1)
        steps = into[..., nibble_words:].view(np.uint16).reshape(n, groups, 2, LANES_CHANNELS)
        for i, step_of in enumerate((d[rows], m[rows])):
            steps[:, :, i] = _half(step_of).reshape(n, LANES_CHANNELS, groups).transpose(0, 2, 1)


# Values packed at once by pack_lanes: a chunk's values, nibbles and lanes
# (under 3 bytes a value together, with numpy's temporaries) stay in a
# core's cache; from 2^16 values Python's per-chunk cost is already small.
_CHUNK_VALUES = 1 << 18


def _steps(weight: Int4Weight) -> tuple[np.ndarray, np.ndarray]:
    """Each block's ``d`` and ``m`` as the kernel's ``w = q * d + m`` takes
    them, float32 ``[out, in // 32]`` (``_half`` rounds them for the blocks)."""
    if weight.group_size % GROUP:
        raise ValueError(f"quantization group size {weight.group_size}: the native 4-bit kernel needs a multiple of {GROUP}")
    repeat = weight.group_size // GROUP
    d, zero = weight.scale.float().numpy(), weight.zero.float().numpy()
    if repeat > 1:
        d, zero = np.repeat(d, repeat, axis=1), np.repeat(zero, repeat, axis=1)
    with np.errstate(over="ignore"):
        return d, zero - np.float32(8) * d


def _half(steps: np.ndarray) -> np.ndarray:
    """float32 ``steps`` as float16 bits (uint16). Exact for GGUF's float16
    scales and for quantize_int4's, which it rounds to float16 before
    choosing the nibbles; out of float16's range, infinite. torch's
    conversion (F16C), 4x numpy's; ``pack_lanes`` calls it a chunk at a
    time, under torch's grain size (32,768), so on this thread alone."""
    return torch.from_numpy(np.ascontiguousarray(steps)).half().numpy().view(np.uint16)


def _blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Values ``q`` (uint8 ``[rows, in]``, 0..15) with their blocks' ``d``
    and ``m`` (``_steps``) as blocks, uint32 words ``[rows, in // 32, 5]``: the two
    float16 steps, then the 16 bytes of nibbles, value i low and i + 16
    high (GGUF's Q4_1 block; x86 is little-endian)."""
    rows, k = q.shape
    blocks = np.empty((rows, k // GROUP, BLOCK_BYTES // 4), dtype=np.uint32)
    halves = blocks[..., 0:1].view(np.uint16)  # [rows, groups, 2]: d, m
    halves[..., 0], halves[..., 1] = _half(d), _half(m)
    blocks[..., 1:] = _nibbles(q)
    return blocks


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values ``q`` (uint8 ``[rows, in]``, 0..15) as their blocks' nibble
    bytes, uint32 ``[rows, in // 32, 4]``: value i low, i + 16 high. Eight
    values a word: each byte holds 0..15, so a shift by 4 stays in its
    byte (x86 is little-endian)."""
    rows, k = q.shape
    words = np.ascontiguousarray(q, dtype=np.uint8).view(np.uint64).reshape(rows, k // GROUP, 4)
    return ((words[..., 2:] << np.uint64(4)) | words[..., :2]).view(np.uint32)


# Lanes blocks (csrc/lanes_avx2.h, csrc/lanes_vnni.h): avx2int8's and
# avx512vnni's 4-bit weights with 16 channels a panel in the lanes, as many
# bytes as the blocks.
LANES_CHANNELS = 16
LANES_BLOCK_BYTES = LANES_CHANNELS * BLOCK_BYTES
LANES_NIBBLE_BYTES = LANES_CHANNELS * GROUP // 2  # then the 16 d and 16 m


def lanes_layout(isa: int, out: int) -> bool:
    """Whether a 4-bit matrix of ``out`` channels for variant ``isa`` is
    stored as lanes blocks: on ``avx2int8`` and ``avx512vnni``, where their
    decode steps then read the weights as they lie, one contiguous stream a
    thread (no sums across lanes, no gathers, no panels staged each call:
    csrc/lanes_avx2.h, csrc/lanes_vnni.h), for whole panels of 16 channels;
    a matrix with a partial panel keeps GGUF's blocks and their kernels."""
    return isa in (_AVX2_INT8, _VNNI) and out % LANES_CHANNELS == 0


def to_lanes(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[out, in // 32, 20]`` (``out`` a multiple of 16) as lanes
    blocks ``[out // 16, in // 32, 320]``: per panel of 16 channels and
    block, for q = 0..3, 64 bytes with channel c's nibble bytes 4q..4q+3 at
    4c (on AVX2 two vectors, of channels 0-7 and 8-15); then the 16 d, then
    the 16 m (float16)."""
    out, groups, _ = blocks.shape
    lanes = np.empty((out // LANES_CHANNELS, groups, LANES_BLOCK_BYTES // 4), dtype=np.uint32)
    _lanes_into(np.ascontiguousarray(blocks.numpy()).view(np.uint32), lanes)
    return torch.from_numpy(lanes.view(np.uint8))


def _lanes_into(blocks: np.ndarray, lanes: np.ndarray) -> None:
    """``to_lanes`` in 4-byte words: blocks ``[out, groups, 5]`` into lanes
    ``[out // 16, groups, 80]``. The nibbles move a word at a time (channel
    c's word q to word 16q + c), the steps as float16s."""
    panels, groups, _ = lanes.shape
    by_panel = blocks.reshape(panels, LANES_CHANNELS, groups, BLOCK_BYTES // 4)
    nibble_words = LANES_NIBBLE_BYTES // 4
    lanes[..., :nibble_words].reshape(panels, groups, 4, LANES_CHANNELS)[...] = by_panel[..., 1:].transpose(0, 2, 3, 1)
    steps = lanes[..., nibble_words:].view(np.uint16).reshape(panels, groups, 2, LANES_CHANNELS)
    steps[...] = by_panel[..., :1].view(np.uint16).transpose(0, 2, 3, 1)


def from_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """``to_lanes``'s inverse: the blocks ``[out, in // 32, 20]``."""
    panels, groups, _ = lanes.shape
    nibbles = lanes[..., :LANES_NIBBLE_BYTES].reshape(panels, groups, 4, 2, 8, 4).permute(0, 3, 4, 1, 2, 5)
    scales = lanes[..., LANES_NIBBLE_BYTES:].reshape(panels, groups, 2, LANES_CHANNELS, 2).permute(0, 3, 1, 2, 4)
    out = panels * LANES_CHANNELS
    return torch.cat([scales.reshape(out, groups, 4), nibbles.reshape(out, groups, 16)], dim=2).contiguous()


@attrs.frozen
class Int4NativeLinear:
    """``x @ W.T + bias`` with ``W`` in 4-bit blocks, on one ISA variant of the native kernel."""

    # Blocks ``[out, in // 32, 20]``, or lanes blocks ``[out // 16, in // 32,
    # 320]`` where ``lanes_layout`` says (the kernels tell them by shape).
    blocks: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    isa: int
    ops: object  # torch.ops.trioserve, loaded
    # avx512vnni's or avx2int8's int8 kernels at any row count (a decode
    # step's LM head, native_decode.decode_head), not only below 10 rows
    # (call_isa).
    int8_panels: bool = False
    # From this many rows, torch's bfloat16 GEMM over the matrix dequantized
    # for the call (AMX machines outside batch-invariant mode: choose.BF16_GEMM_FROM_ROWS); None: never.
    gemm_from_rows: int | None = None

    @classmethod
    def from_rtn(cls, weight: Int4Weight, bias: torch.Tensor | None, isa: str) -> Int4NativeLinear:
        out, k = _shape(weight)
        index = native.ISAS[isa]
        blocks = pack_lanes(weight) if lanes_layout(index, out) else pack_blocks(weight)
        return cls(blocks, bias, k, out, index, native.ops())

    @classmethod
    def from_parts(cls, parts: list[Int4Weight], bias: torch.Tensor | None, isa: str) -> Int4NativeLinear:
        """``from_rtn`` of ``parts`` stacked by rows (one width and group
        size: a fused qkv or gate_up), each part packed into its own rows
        of the kernel's blocks: no stacked copy of the values made first."""
        out, k = sum(_shape(part)[0] for part in parts), _shape(parts[0])[1]
        index = native.ISAS[isa]
        if not lanes_layout(index, out):
            blocks = torch.from_numpy(np.concatenate([pack_blocks(part).numpy() for part in parts]))
        elif all(_shape(part)[0] % LANES_CHANNELS == 0 for part in parts):
            blocks = pack_lanes_of(parts)
        else:  # a panel across two parts: stacked first
            q, scale, zero = (np.concatenate([getattr(p, n).numpy() for p in parts]) for n in ("q", "scale", "zero"))
            stacked = Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), parts[0].group_size)
            blocks = pack_lanes(stacked)
        return cls(blocks, bias, k, out, index, native.ops())

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def row_blocks(self) -> torch.Tensor:
        """The weights as blocks ``[out, in // 32, 20]``, whichever layout they are held in."""
        return from_lanes(self.blocks) if self.blocks.shape[2] == LANES_BLOCK_BYTES else self.blocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if dequantizes(self.isa, x.shape[0]):
            return F.linear(x, self.ops.q4_dequantize(self.row_blocks()), self.bias)  # type: ignore[attr-defined]
        if self.gemm_from_rows is not None and x.shape[0] >= self.gemm_from_rows and not self.int8_panels:
            y = bf16_gemm(x, self.ops.q4_dequantize_bf16(self.row_blocks()))  # type: ignore[attr-defined]
            return y if self.bias is None else y.add_(self.bias)
        isa = self.isa if self.int8_panels else call_isa(self.isa, x.shape[0])
        y = self.ops.q4_linear(x, self.blocks, isa)  # type: ignore[attr-defined]
        return y if self.bias is None else y.add_(self.bias)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 for a bfloat16 ``weight``, on torch's
    bfloat16 GEMM (``x`` rounded to bfloat16), rows padded as ``gemm_rows`` says."""
    y = onednn.by_row_buckets(
        lambda rows: F.linear(rows, weight), x.to(torch.bfloat16), bucket=gemm_rows, max_rows=GEMM_MAX_ROWS
    )
    return y.float()


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (and the kernel lets a process use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def trial_bf16_gemm() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The bfloat16 GEMM path on tiny inputs (``capability.Probe``), where
    the CPU has AMX tiles (without them oneDNN's bfloat16 GEMM is no faster
    than the panels, so the path is not offered)."""
    if not amx_tiles():
        raise RuntimeError("this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported)")
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(12, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    weight = quantize_int4(w, 32)
    linear = attrs.evolve(Int4NativeLinear.from_rtn(weight, bias, "avx512bf16"), gemm_from_rows=1)
    return {"Int4NativeLinear(bf16 GEMM)": (linear(x), F.linear(x, weight.dequantize(), bias))}


def trial(isa: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel on tiny inputs, with its float32 reference (``capability.Probe``):
    12 rows, so the panels of the AVX-512 variants run too."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(12, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    weight = quantize_int4(w, 32)
    got = Int4NativeLinear.from_rtn(weight, bias, isa)(x)
    return {f"Int4NativeLinear({isa})": (got, F.linear(x, weight.dequantize(), bias))}
