"""GGUF's Q6_K matrices held at the file's own width ("Q6_K lanes blocks",
csrc/q6k_lanes_vnni.h, whose header says the layout): how avx512vnni and
avx2int8 (``ISAS``) hold a projection every part of which a file stores as
Q6_K (a Q4_K_M file's ffn_down and some attn_v), a Q6_K LM head or tied
table, and Q6_K experts, read at every row count by one kernel with the
same bits on both: zmm on avx512vnni, ymm on avx2int8
(csrc/q6k_lanes_avx2.h).

Before, such a matrix was rounded into Q8_0 groups of 32 at load (one more
rounding: ~94% of its values moved, by up to half a Q8_0 step) and held as
Q8_0 lanes blocks, 9 bits a weight. Here the file's 6-bit values, int8
sub-block scales and float16 d run as they are: 6.5625 bits a weight (a
matrix's bytes down 27%), and a product closer to W x over the file's values.

The layout is the file's bytes rearranged (``to_lanes``): numpy on the
calling thread, a few panels at a time, every step on uint32 words (the
values are below 64, so no bits cross a byte); ``Q6KLanes.of`` takes
csrc/gguf_repack.cpp's ``q6k_lanes_into`` instead where the library is
built, the same bytes in one pass.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import torch

from trioserve.engine.kernels.q4k_blocks import read_only
from trioserve.engine.kernels.rtn import Int8GroupWeight

CHANNELS = 16  # a panel: csrc's kLanesChannels
# The native variants that hold a file's Q6_K matrices as these blocks (the
# others round them into Q8_0 groups at load).
ISAS = frozenset({"avx512vnni", "avx2int8"})
SUPER = 256  # inputs a super-block
BLOCK = 210  # GGUF's bytes a row and super-block: 128 low nibbles, 64 high bit pairs, 16 scales, d
LANES_BYTES = 3328  # csrc's kQ6kLanesBytes: a panel and super-block, without its d
PAIR_BYTES = LANES_BYTES // 4  # two groups of 32 inputs: csrc's kQ6kPairBytes
# The file's bytes laid out at once by to_lanes: the temporaries stay in a core's cache.
_CHUNK_BYTES = 1 << 19
# Rows Q6KLanes.lookup decodes at once: their temporaries (about 60 bytes an
# input) a few MB.
_LOOKUP_ROWS = 256


def fits(out: int, k: int) -> bool:
    """Whether a ``[out, k]`` Q6_K matrix can be laid out in lanes: whole panels of 16 channels."""
    return out % CHANNELS == 0 and k % SUPER == 0


class Q6KGroups(Int8GroupWeight):
    """A GGUF Q6_K tensor: the file's rows ``blocks`` (uint8 ``[out, in /
    256 * 210]``, a view of the mapped file), and as int8 groups of 16
    (``(u - 32) d sc``) ``decode(blocks)`` gives, made only when ``q`` or
    ``scale`` is first read. A kernel that reads Q6_K itself lays out the
    file's own bytes (``Q6KLanes.of``) and never asks for the groups, so
    the matrix is not decoded as well; anything that takes int8 groups
    takes it as one (``shape`` without decoding)."""

    __slots__ = ("blocks", "_decode", "_groups")
    group_size = 16  # Q6_K's sub-blocks (a class attribute over the parent's slot: never stored)

    def __init__(self, blocks: np.ndarray, decode: Callable[[np.ndarray], Int8GroupWeight]) -> None:
        # The parent is a frozen attrs class: its fields are set through object.
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "_decode", decode)
        object.__setattr__(self, "_groups", None)

    def groups(self) -> Int8GroupWeight:
        """The int8 groups, decoded on the first call and kept."""
        if self._groups is None:
            object.__setattr__(self, "_groups", self._decode(self.blocks))
        return self._groups  # type: ignore[return-value]

    @property  # type: ignore[override]
    def q(self) -> torch.Tensor:
        return self.groups().q

    @property  # type: ignore[override]
    def scale(self) -> torch.Tensor:
        return self.groups().scale

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's ``(out, in)``, from the blocks alone."""
        return self.blocks.shape[0], self.blocks.shape[1] // BLOCK * SUPER

    @property
    def decoded(self) -> bool:
        """Whether the int8 groups have been made."""
        return self._groups is not None

    def rows_of(self, blocks: np.ndarray) -> Q6KGroups:
        """The same kind of tensor over other rows ``blocks`` (decoded alike, when asked)."""
        return Q6KGroups(blocks, self._decode)

    def __repr__(self) -> str:
        return f"Q6KGroups(shape={self.shape}, decoded={self.decoded})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def to_lanes(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows (``[out, supers * 210]`` uint8, ``fits``) as lanes blocks
    ``[out / 16, supers, 3328]`` (uint8) and d ``[out / 16, supers, 16]``
    (float16): the file's bytes, rearranged, a few panels at a time."""
    out = data.shape[0]
    n = data.shape[1] // BLOCK
    assert fits(out, n * SUPER) and data.shape[1] == n * BLOCK, data.shape
    panels = out // CHANNELS
    lanes = np.empty((panels, n, LANES_BYTES), dtype=np.uint8)
    d = np.empty((panels, n, CHANNELS), dtype=np.float16)
    step = max(1, _CHUNK_BYTES // (CHANNELS * n * BLOCK))
    for p0 in range(0, panels, step):
        p1 = min(panels, p0 + step)
        _panels_into(data[p0 * CHANNELS : p1 * CHANNELS].reshape(-1, n, BLOCK), lanes[p0:p1], d[p0:p1])
    return torch.from_numpy(lanes), torch.from_numpy(d)


def _panels_into(blocks: np.ndarray, lanes: np.ndarray, d_out: np.ndarray) -> None:
    """A few panels' blocks ``[16 p, n, 210]`` into their lanes and d, on
    uint32 words, 4 bytes a lane: a quarter of numpy's elements."""
    panels, n = lanes.shape[:2]
    rows = blocks.shape[0]
    ql = np.ascontiguousarray(blocks[..., :128]).view(np.uint32).reshape(rows, n, 2, 16)  # [.., half, 64 bytes]
    qh = np.ascontiguousarray(blocks[..., 128:192]).view(np.uint32).reshape(rows, n, 2, 8)  # [.., half, 32 bytes]
    nibble = np.uint32(0x0F0F0F0F)
    # u's low 4 bits, [row, s, half, low/high nibble (values 0..63 / 64..127 of the half), 16 words]
    low = np.empty((rows, n, 2, 2, 16), dtype=np.uint32)
    np.bitwise_and(ql, nibble, out=low[:, :, :, 0])
    np.right_shift(ql, 4, out=low[:, :, :, 1])
    low[:, :, :, 1] &= nibble
    # input j = 32 g + 16 h + 4 q + b: word (g, h, q) of the 64 words a row and super-block
    low = low.reshape(rows, n, 8, 2, 4)  # [row, s, g, h, q]
    # u's high 2 bits as words: value 128 half + 32 m + i from qh word (half, i // 4), bits 2m
    three = np.uint32(0x03030303)
    high = np.empty((rows, n, 2, 4, 8), dtype=np.uint32)  # [row, s, half, m, word]
    for m in range(4):
        np.right_shift(qh, 2 * m, out=high[:, :, :, m])
        high[:, :, :, m] &= three
    u = low | (high.reshape(rows, n, 8, 2, 4) << 4)  # [row, s, g, h, q]: the 6-bit values, 4 a word
    w3 = u[..., 3]
    kept = np.empty((rows, n, 8, 2, 3), dtype=np.uint32)  # A, B, C: W[3] in their top two bits
    np.bitwise_or(u[..., 0], (w3 & np.uint32(0x30303030)) << 2, out=kept[..., 0])
    np.bitwise_or(u[..., 1], (w3 & np.uint32(0x0C0C0C0C)) << 4, out=kept[..., 1])
    np.bitwise_or(u[..., 2], (w3 & three) << 6, out=kept[..., 2])
    pairs = lanes.reshape(panels, n, 4, PAIR_BYTES)  # groups 2P and 2P + 1 of a super-block: 832 bytes
    pairs[..., :768].view(np.uint32).reshape(panels, n, 4, 2, 2, 3, CHANNELS)[...] = (
        kept.reshape(panels, CHANNELS, n, 4, 2, 2, 3).transpose(0, 2, 3, 4, 5, 6, 1)
    )
    sc = blocks[..., 192:208].reshape(panels, CHANNELS, n, 4, 2, 2)  # [p, c, s, P, e, sub]
    pairs[..., 768:].reshape(panels, n, 4, 2, 2, CHANNELS)[...] = sc.transpose(0, 2, 3, 4, 5, 1)
    d_out[...] = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).reshape(panels, CHANNELS, n).transpose(0, 2, 1)


@attrs.frozen
class Q6KLanes:
    """A ``[out, in]`` Q6_K matrix as lanes blocks ``lanes`` ``[out / 16,
    in / 256, 3328]`` (uint8) and their d ``[out / 16, in / 256, 16]``
    (float16). ``q`` and ``scale`` name them as csrc/decode.cpp's fused
    step takes a weight and its scale (native_decode)."""

    lanes: torch.Tensor
    d: torch.Tensor
    ops: object  # torch.ops.trioserve, loaded

    @classmethod
    def of(cls, blocks: np.ndarray, ops: object) -> Q6KLanes:
        """The Q6_K rows ``blocks`` (``[out, in / 256 * 210]`` uint8, ``fits``)
        laid out in lanes: by ``ops``' ``q6k_lanes_into`` (csrc/gguf_repack.cpp,
        one pass) where it has one, else ``to_lanes``; the same bytes."""
        native = getattr(ops, "q6k_lanes_into", None)
        if native is None:
            return cls(*to_lanes(blocks), ops)
        out, n = blocks.shape[0], blocks.shape[1] // BLOCK
        assert fits(out, n * SUPER) and blocks.shape[1] == n * BLOCK, blocks.shape
        lanes = torch.empty(out // CHANNELS, n, LANES_BYTES, dtype=torch.uint8)
        d = torch.empty(out // CHANNELS, n, CHANNELS, dtype=torch.float16)
        native(read_only(np.ascontiguousarray(blocks)), lanes, d)
        return cls(lanes, d, ops)

    @property
    def q(self) -> torch.Tensor:
        return self.lanes

    @property
    def scale(self) -> torch.Tensor:
        return self.d

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's ``(out, in)``."""
        panels, supers, _ = self.lanes.shape
        return panels * CHANNELS, supers * SUPER

    @property
    def nbytes(self) -> int:
        return self.lanes.numel() + self.d.nbytes

    def linear(self, x: torch.Tensor, isa: int) -> torch.Tensor:
        """``x @ W.T`` (float32 ``[rows, in]``) on variant ``isa``: int8
        activations on avx512vnni or avx2int8 (the same bits on both), at
        any row count with a row's bits the same at every row count; or
        float32 activations in bfloat16 (avx512bf16) or float32 (avx512,
        avx2) panels."""
        return self.ops.q6k_linear(x, self.lanes, self.d, isa)  # type: ignore[attr-defined]

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64, 1-D) dequantized, float32 ``[n, in]``, each
        value ``(u - 32) (d sc)`` as the file's groups have it
        (``Q6KGroups.dequantize``, bit for bit): a tied LM head's embeddings
        read their rows from the head's lanes blocks, so the table is held
        once, at the file's width. A chunk of rows at a time, so a prompt's
        thousands of tokens take a few MB of temporaries."""
        if len(index) <= _LOOKUP_ROWS:
            return self._rows(index)
        return torch.cat([self._rows(index[i : i + _LOOKUP_ROWS]) for i in range(0, len(index), _LOOKUP_ROWS)])

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        panels, supers, _ = self.lanes.shape
        pairs = self.lanes.view(panels, supers, 4, PAIR_BYTES)  # [panel, s, pair P, 832 bytes]
        # Words (A, B, C) of (group e of the pair, half h of the group) per
        # channel, and the int8 scale of each half's 16 inputs: views, so a
        # lookup is one gather each.
        words = pairs[..., :768].view(torch.int32).unflatten(-1, (2, 2, 3, CHANNELS))  # [p, s, P, e, h, t, c]
        scales = pairs[..., 768:].view(torch.int8).unflatten(-1, (2, 2, CHANNELS))  # [p, s, P, e, h, c]
        panel, channel = index // CHANNELS, index % CHANNELS
        a, b, c = words[panel, :, :, :, :, :, channel].unbind(-1)  # each [n, s, P, e, h]
        # W[3]'s bits back out of A, B and C's top two (to_lanes put them
        # there); the masks keep each byte's own bits (and drop the sign
        # an arithmetic shift brings in).
        w3 = ((a >> 2) & 0x30303030) | ((b >> 4) & 0x0C0C0C0C) | ((c >> 6) & 0x03030303)
        low = 0x3F3F3F3F
        u = torch.stack((a & low, b & low, c & low, w3), -1).view(torch.uint8)  # [n, s, P, e, h, 16 values]
        step = self.d[panel, :, channel].float()[..., None, None, None] * scales[panel, :, :, :, :, channel].float()
        return ((u.to(torch.int8) - 32).float() * step[..., None]).reshape(len(index), supers * SUPER)

    def dequantize_bf16(self) -> torch.Tensor:
        """The matrix in bfloat16 (each weight in float32, then rounded to nearest even)."""
        return self.ops.q6k_dequantize_bf16(self.lanes, self.d)  # type: ignore[attr-defined]
