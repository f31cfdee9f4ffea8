"""A fused projection's 4-bit parts packed each into its own rows of the
native kernel's blocks (``int4_native.Int4NativeLinear.from_parts``, which
``compressed`` builds a fused qkv and gate_up with) give the bytes of the
stacked matrix packed whole (``from_rtn`` over ``compressed._cat``), in
either layout; and ``gguf_weights.by_rows``' in-place decoding is covered
by tests/test_gguf_load_speed_bits.py."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trioserve.engine.kernels import int4_native, native
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, quantize_int8_groups
from trioserve.engine.loading import compressed

_STEP = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def fused_parts(draw: st.DrawFn, *, panels: bool) -> list[Int4Weight]:
    """Two to three 4-bit matrices of one width and group size, whole
    panels of 16 rows each where ``panels``."""
    group_size = draw(st.sampled_from([32, 64]))
    k = group_size * draw(st.integers(1, 3))
    parts = []
    for _ in range(draw(st.integers(2, 3))):
        out = 16 * draw(st.integers(1, 3)) if panels else draw(st.integers(1, 20))
        q = draw(hnp.arrays(np.uint8, (out, k), elements=st.integers(0, 15)))
        scale, zero = (draw(hnp.arrays(np.float32, (out, k // group_size), elements=_STEP)) for _ in range(2))
        parts.append(Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), group_size))
    return parts


@pytest.fixture(autouse=True)
def _no_library():
    # The packing is numpy's: the linears are compared by their blocks, never called.
    with mock.patch.object(native, "ops", lambda: None):
        yield


@settings(max_examples=30, deadline=None)
@given(fused_parts(panels=True), st.sampled_from([1, 32 * 16, 1 << 18]))
def test_parts_pack_into_the_lanes_of_the_stacked_matrix(parts: list[Int4Weight], chunk: int) -> None:
    whole = compressed._cat(parts)
    with mock.patch.object(int4_native, "_CHUNK_VALUES", chunk):
        linear = int4_native.Int4NativeLinear.from_parts(parts, None, "avx512vnni")
    expected = int4_native.Int4NativeLinear.from_rtn(whole, None, "avx512vnni")
    assert linear.blocks.shape == expected.blocks.shape and linear.blocks.shape[2] == int4_native.LANES_BLOCK_BYTES
    assert torch.equal(linear.blocks, expected.blocks)
    shape = (linear.in_features, linear.out_features, linear.isa)
    assert shape == (expected.in_features, expected.out_features, expected.isa)


@settings(max_examples=30, deadline=None)
@given(fused_parts(panels=False), st.sampled_from(["avx512vnni", "avx512bf16", "avx2int8", "scalar"]))
def test_parts_pack_into_the_blocks_of_the_stacked_matrix(parts: list[Int4Weight], isa: str) -> None:
    # Rows that do not make whole panels, or a variant without lanes: GGUF's blocks, row by row.
    linear = int4_native.Int4NativeLinear.from_parts(parts, None, isa)
    expected = int4_native.Int4NativeLinear.from_rtn(compressed._cat(parts), None, isa)
    assert torch.equal(linear.blocks, expected.blocks)


def test_a_fused_projection_is_built_from_its_parts_as_from_the_stacked_matrix() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [
        Int4Weight(torch.randint(0, 16, (rows, 64), generator=gen, dtype=torch.uint8), torch.rand(rows, 2, generator=gen),
                   torch.rand(rows, 2, generator=gen), 32)
        for rows in (32, 16, 16)
    ]  # fmt: skip
    bias = torch.arange(64, dtype=torch.float32)
    kernel = next(k for k in compressed.KERNELS if k.name == "quant_int4_native_avx512vnni")
    for gemm_from_rows in (None, 512):
        choice = compressed.KernelChoice(kernel, "auto", 32, gemm_from_rows)
        built = compressed._stacked(choice, parts, bias)
        expected = choice.make(compressed._cat(parts), bias)
        assert torch.equal(built.blocks, expected.blocks) and built.bias is bias
        assert built.gemm_from_rows == expected.gemm_from_rows == gemm_from_rows


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.sampled_from([16, 64]), st.sampled_from([1, 64, 1 << 16]), st.data())
def test_int8_groups_round_as_quantize_int8_groups(out: int, groups: int, group: int, chunk: int, data) -> None:
    # Q6_K's groups of 16 (or wider ones; groups of 32 are taken as they
    # are) rounded into groups of 32, a chunk of rows at a time: zero and
    # negative-zero steps, all-zero groups and float32's extremes included.
    k = 64 * groups
    q = data.draw(hnp.arrays(np.int8, (out, k), elements=st.integers(-32, 31)))
    steps = data.draw(hnp.arrays(np.float32, (out, k // group), elements=_STEP | st.sampled_from([0.0, -0.0])))
    weight = Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(steps), group)
    with mock.patch.object(compressed, "_REGROUP_VALUES", chunk):
        got = compressed._int8_groups([weight])
    want = quantize_int8_groups(weight.dequantize(), 32)
    assert torch.equal(got.q, want.q)
    assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32))
