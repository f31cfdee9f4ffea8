"""A GGUF Q4_K matrix held as the file's blocks, its values made only when
asked: the 4-bit lanes blocks (``int4_native.pack_lanes``, on avx512vnni
and avx2int8) are laid out straight from the file's nibbles
(csrc/gguf_repack.cpp's ``q4k_lanes_into``), so a start never writes and
reads back a byte a value (a 1B model's 0.7 GB) between the two.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from trioserve.engine.kernels.rtn import Int4Weight

SUPER = 256  # inputs a super-block
BLOCK = 144  # a row and super-block's bytes: d, dmin, 12 bytes of 6-bit (sc, min), 128 of nibbles


def read_only(array: np.ndarray) -> torch.Tensor:
    """``array`` (a read-only view of a mapped file, say) as a tensor for a
    native op that only reads it: no copy, and no warning from torch that
    the array is not writable."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class Q4KBlocks(Int4Weight):
    """Q4_K rows ``blocks`` (uint8 ``[out, in / 256 * 144]``, a view of the
    mapped file or its rows put back in order) as an ``Int4Weight`` in
    groups of 32: ``scale`` and ``zero`` (each sub-block's ``d sc`` and
    ``8 d sc - dmin min``, float32) given, ``q`` (uint8 ``[out, in]``)
    made by ``values(blocks)`` on its first read and kept."""

    __slots__ = ("blocks", "_values", "_q")
    group_size = 32  # a class attribute over the parent's slot: never stored

    def __init__(
        self, blocks: np.ndarray, scale: torch.Tensor, zero: torch.Tensor, values: Callable[[np.ndarray], torch.Tensor]
    ) -> None:
        # The parent is a frozen attrs class: its fields are set through object.
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_q", None)

    @property  # type: ignore[override]
    def q(self) -> torch.Tensor:
        if self._q is None:
            object.__setattr__(self, "_q", self._values(self.blocks))
        return self._q  # type: ignore[return-value]

    @property
    def decoded(self) -> bool:
        """Whether the values have been made."""
        return self._q is not None

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's ``(out, in)``, from the blocks alone."""
        return self.blocks.shape[0], self.blocks.shape[1] // BLOCK * SUPER

    def pack_lanes_into(self, lanes: np.ndarray, ops: object) -> None:
        """The lanes blocks (uint32 ``[out / 16, in / 32, 80]``, ``int4_native``'s
        layout) written into ``lanes`` from the file's nibbles and the steps,
        by ``ops`` (``torch.ops.trioserve``): the bytes ``pack_lanes`` makes
        from the values."""
        into = torch.from_numpy(lanes.view(np.uint8))
        ops.q4k_lanes_into(read_only(self.blocks), self.scale, self.zero, into)  # type: ignore[attr-defined]

    def rows_of(self, order: Callable[[np.ndarray], np.ndarray]) -> Q4KBlocks:
        """The rows put in another ``order`` (a function of an array's rows):
        the blocks, steps and offsets alike."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(order(t.numpy()))

        return Q4KBlocks(order(self.blocks), rows(self.scale), rows(self.zero), self._values)

    def __repr__(self) -> str:
        return f"Q4KBlocks(shape={self.shape}, decoded={self.decoded})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__
