"""A Q8_0 table held with 16 channels' values side by side ("Q8_0 lanes
blocks", csrc/q8_lanes_avx2.h): how ``avx2int8`` holds the LM head, and
``avx512vnni`` every table of whole panels (its projections too), read by
csrc/lanes_vnni.h in the same layout.

In GGUF's layout a group's dot of a row and channel lies across a vector's
lanes, and the exact sums need it added across them, which made a 5-row
verification's head cost 2.8x a one-row step's on AVX2; laid out so once at
load, the int16 tile reads each channel's sums in its own lane at any row
count, without staging panels (docs/benchmarks.md in git history, "The Q8_0 head in
lanes"). The same bytes as the groups (no memory added), and a tied model's
embeddings look their rows up in the same table (``rows``), so it is held
once.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trioserve.engine.kernels.rtn import Int8GroupWeight

GROUP = 32
CHANNELS = 16  # a panel: csrc's kLanesChannels
VALUE_BYTES = CHANNELS * GROUP  # 512 bytes of values a panel and group, then 16 float32 steps
BLOCK_BYTES = VALUE_BYTES + CHANNELS * 4  # 576: csrc's kQ8LanesBlockBytes
# Values laid out at once by Q8Lanes.of: a chunk's values and blocks stay in a core's cache.
_CHUNK_VALUES = 1 << 18


def fits(weight: Int8GroupWeight) -> bool:
    """Whether ``weight`` can be laid out in lanes: groups of 32, whole panels of 16 channels."""
    return weight.group_size == GROUP and weight.q.shape[0] % CHANNELS == 0 and weight.q.shape[1] % GROUP == 0


@attrs.frozen
class Q8Lanes:
    """A ``[out, in]`` Q8_0 table as lanes blocks ``[out / 16, in / 32, 576]`` (uint8)."""

    blocks: torch.Tensor
    ops: object  # torch.ops.trioserve, loaded: ``lookup``'s kernel

    @classmethod
    def of(cls, weight: Int8GroupWeight, ops: object) -> Q8Lanes:
        """``weight``'s values and steps laid out in lanes (``fits`` must
        hold): by ``ops``' ``q8_lanes_into`` where it has one, else numpy."""
        assert fits(weight), (tuple(weight.q.shape), weight.group_size)
        out, k = weight.q.shape
        panels, groups = out // CHANNELS, k // GROUP
        native = getattr(ops, "q8_lanes_into", None)  # csrc/gguf_repack.cpp: one pass, the same bytes
        if native is not None:
            blocks = torch.empty(panels, groups, BLOCK_BYTES, dtype=torch.uint8)
            native(weight.q.contiguous(), weight.scale.float().contiguous(), blocks)
            return cls(blocks, ops)
        # Group g of panel p: for each pair of inputs, the 16 channels' two
        # values, a pair moved as one uint16 (numpy, a chunk of panels at a
        # time: moved a byte at a time by torch's permuted copy it ran at
        # ~100 MB/s, the largest part of a start).
        pairs = weight.q.numpy().view(np.uint16)
        steps = weight.scale.float().numpy()
        blocks = np.empty((panels, groups, BLOCK_BYTES), dtype=np.uint8)
        step = max(1, _CHUNK_VALUES // (CHANNELS * k))
        for p in range(0, panels, step):
            rows, into = slice(p * CHANNELS, (p + step) * CHANNELS), blocks[p : p + step]
            n = into.shape[0]
            values = pairs[rows].reshape(n, CHANNELS, groups, GROUP // 2).transpose(0, 2, 3, 1)
            into[..., :VALUE_BYTES].view(np.uint16).reshape(n, groups, GROUP // 2, CHANNELS)[...] = values
            into[..., VALUE_BYTES:].view(np.float32)[...] = steps[rows].reshape(n, CHANNELS, groups).transpose(0, 2, 1)
        blocks = torch.from_numpy(blocks)
        return cls(blocks, ops)

    @property
    def shape(self) -> tuple[int, int]:
        """The table's ``(out, in)``."""
        panels, groups, _ = self.blocks.shape
        return panels * CHANNELS, groups * GROUP

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> Int8GroupWeight:
        """Rows ``index`` (int64, 1-D) as int8 groups of 32, exactly as stored."""
        panels, groups, _ = self.blocks.shape
        flat = self.blocks.view(-1)
        # The table as [panel, channel, group, pair, value of the pair] and its
        # steps as [panel, channel, group]: strided views of the blocks, so a
        # lookup is one gather each.
        values = flat.as_strided(
            (panels, CHANNELS, groups, GROUP // 2, 2), (groups * BLOCK_BYTES, 2, BLOCK_BYTES, 2 * CHANNELS, 1)
        )
        words = BLOCK_BYTES // 4  # float32 words a block; the steps from word VALUE_BYTES // 4
        steps = flat.view(torch.float32).as_strided(
            (panels, CHANNELS, groups), (groups * words, 1, words), VALUE_BYTES // 4
        )
        panel, channel = index // CHANNELS, index % CHANNELS
        q = values[panel, channel].view(len(index), groups * GROUP).view(torch.int8)
        return Int8GroupWeight(q, steps[panel, channel], GROUP)

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64, 1-D) dequantized, float32 ``[n, in]``: the
        bits of ``rows(index).dequantize()`` in one native call (a decode
        step's embeddings: 5 us a token, against 30 through ``rows`` and 13
        from the groups' table)."""
        return self.ops.q8g_lanes_rows(self.blocks, index)  # type: ignore[attr-defined]

    def groups(self) -> Int8GroupWeight:
        """The whole table as int8 groups of 32 (``rows`` of every channel)."""
        return self.rows(torch.arange(self.shape[0]))

    def dequantize(self) -> torch.Tensor:
        return self.groups().dequantize()
