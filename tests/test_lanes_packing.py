"""The load-time packing of the native kernels' tables (``int4_native.pack_blocks``,
``pack_lanes``, ``to_lanes``; ``q8_lanes.Q8Lanes.of``): numpy, a chunk of
panels at a time, byte for byte the layouts their docstrings and csrc's
readers describe, here rebuilt one block and one channel at a time."""

from __future__ import annotations

from unittest import mock

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trioserve.engine.kernels import int4_native, q8_lanes
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight

# Any finite float32 step: float16's overflow and subnormals included.
_STEP = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 values as float16 bytes, by torch's rounding (the old path's)."""
    return torch.from_numpy(np.ascontiguousarray(values)).half().view(torch.uint8).numpy().reshape(*values.shape, 2)


def _reference_blocks(weight: Int4Weight) -> np.ndarray:
    """GGUF's Q4_1 blocks, ``[out, in // 32, 20]``, one block at a time."""
    q, scale, zero = weight.q.numpy(), weight.scale.numpy(), weight.zero.numpy()
    out, k = q.shape
    d = np.repeat(scale, weight.group_size // 32, axis=1)
    with np.errstate(over="ignore"):
        m = np.repeat(zero, weight.group_size // 32, axis=1) - np.float32(8) * d
    d_bytes, m_bytes = _half_bytes(d), _half_bytes(m)
    blocks = np.zeros((out, k // 32, 20), dtype=np.uint8)
    for r in range(out):
        for g in range(k // 32):
            values = q[r, 32 * g : 32 * g + 32]
            blocks[r, g, 0:2], blocks[r, g, 2:4] = d_bytes[r, g], m_bytes[r, g]
            blocks[r, g, 4:] = values[:16] | (values[16:] << 4)
    return blocks


def _reference_lanes(blocks: np.ndarray) -> np.ndarray:
    """Lanes blocks ``[out // 16, in // 32, 320]``, one channel at a time."""
    out, groups, _ = blocks.shape
    lanes = np.zeros((out // 16, groups, 320), dtype=np.uint8)
    for p in range(out // 16):
        for g in range(groups):
            for c in range(16):
                block = blocks[16 * p + c, g]
                for word in range(4):
                    lanes[p, g, 64 * word + 4 * c : 64 * word + 4 * c + 4] = block[4 + 4 * word : 8 + 4 * word]
                lanes[p, g, 256 + 2 * c : 258 + 2 * c] = block[0:2]
                lanes[p, g, 288 + 2 * c : 290 + 2 * c] = block[2:4]
    return lanes


def _reference_q8_lanes(weight: Int8GroupWeight) -> np.ndarray:
    """Q8_0 lanes blocks ``[out // 16, in // 32, 576]``, one channel at a time."""
    q, steps = weight.q.numpy().view(np.uint8), weight.scale.numpy()
    out, k = q.shape
    blocks = np.zeros((out // 16, k // 32, 576), dtype=np.uint8)
    for p in range(out // 16):
        for g in range(k // 32):
            for c in range(16):
                row = 16 * p + c
                for pair in range(16):
                    blocks[p, g, 32 * pair + 2 * c : 32 * pair + 2 * c + 2] = q[row, 32 * g + 2 * pair : 32 * g + 2 * pair + 2]
                blocks[p, g, 512 + 4 * c : 516 + 4 * c] = steps[row, g : g + 1].view(np.uint8)
    return blocks


@st.composite
def int4_weights(draw: st.DrawFn, *, panels: bool) -> Int4Weight:
    group_size = draw(st.sampled_from([32, 64]))
    out = 16 * draw(st.integers(1, 3)) if panels else draw(st.integers(1, 20))
    k = group_size * draw(st.integers(1, 3))
    q = draw(hnp.arrays(np.uint8, (out, k), elements=st.integers(0, 15)))
    scale = draw(hnp.arrays(np.float32, (out, k // group_size), elements=_STEP))
    zero = draw(hnp.arrays(np.float32, (out, k // group_size), elements=_STEP))
    return Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), group_size)


@settings(max_examples=40, deadline=None)
@given(int4_weights(panels=False))
def test_pack_blocks_is_gguf_q4_1(weight: Int4Weight) -> None:
    assert np.array_equal(int4_native.pack_blocks(weight).numpy(), _reference_blocks(weight))


@settings(max_examples=40, deadline=None)
@given(int4_weights(panels=True), st.sampled_from([1, 32 * 16, 1 << 18]))
def test_pack_lanes_and_to_lanes_lay_the_blocks_out_by_channel(weight: Int4Weight, chunk: int) -> None:
    # chunk: one panel a chunk up to the whole matrix in one.
    expected = _reference_lanes(_reference_blocks(weight))
    with mock.patch.object(int4_native, "_CHUNK_VALUES", chunk):
        packed = int4_native.pack_lanes(weight)
    assert np.array_equal(packed.numpy(), expected)
    assert np.array_equal(int4_native.to_lanes(int4_native.pack_blocks(weight)).numpy(), expected)
    assert torch.equal(int4_native.from_lanes(packed), int4_native.pack_blocks(weight))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 32 * 16, 1 << 18]), st.data())
def test_q8_lanes_lay_the_groups_out_by_channel(panels: int, groups: int, chunk: int, data: st.DataObject) -> None:
    out, k = 16 * panels, 32 * groups
    q = data.draw(hnp.arrays(np.int8, (out, k)))
    steps = data.draw(hnp.arrays(np.float32, (out, groups), elements=_STEP))
    weight = Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(steps), 32)
    with mock.patch.object(q8_lanes, "_CHUNK_VALUES", chunk):
        lanes = q8_lanes.Q8Lanes.of(weight, None)
    assert np.array_equal(lanes.blocks.numpy(), _reference_q8_lanes(weight))
    back = lanes.groups()
    assert torch.equal(back.q, weight.q) and torch.equal(back.scale, weight.scale)
