"""avx512vnni's weights in groups of 32 held as lanes blocks
(csrc/lanes_vnni.h; int4_native.to_lanes, q8_lanes.Q8Lanes): its kernels
give the bits of its kernels over GGUF's layout (rows_vnni.h up to 8 rows,
panel_vnni.h beyond, and avx512bf16's float32 rows and bfloat16 panels for
a prompt's rows) at every row count, each row's result its own; a matrix
without whole panels of 16 channels keeps GGUF's layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.kernels import int4_native
from trioserve.engine.kernels import int8_native
from trioserve.engine.kernels import native
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int8GroupWeight, quantize_int4

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33)
_NONE = torch.empty(0)


@pytest.fixture(scope="module")
def vnni(isas) -> object:
    if "avx512vnni" not in isas:
        pytest.skip(f"this CPU cannot run avx512vnni ({native.ISA_REQUIREMENTS['avx512vnni']})")
    return native.ops()


def _q4_blocks(out: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randint(0, 256, (out, groups, int4_native.BLOCK_BYTES), generator=gen, dtype=torch.uint8)
    d, m = torch.rand(out, groups, generator=gen) * 0.02, torch.randn(out, groups, generator=gen) * 0.02
    blocks[..., 0:2] = d.half().view(torch.uint8).view(out, groups, 2)
    blocks[..., 2:4] = m.half().view(torch.uint8).view(out, groups, 2)
    return blocks


def _q8_groups(out: int, groups: int, gen: torch.Generator) -> Int8GroupWeight:
    q = torch.randint(-128, 128, (out, 32 * groups), generator=gen, dtype=torch.int8)
    return Int8GroupWeight(q, torch.rand(out, groups, generator=gen) * 0.02, 32)


def _rows(groups: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(max(ROWS), 32 * groups, generator=gen)
    x[3, :32] = 0.0  # a group of zeros: a zero step
    return x


# Odd group counts, one to four panels (the panels' tiles take two at a time).
@given(st.integers(1, 4), st.sampled_from([1, 3, 5]), st.integers(0, 2**31 - 1))
@settings(max_examples=12, deadline=None)
def test_4_bit_lanes_blocks_give_the_blocks_bits_at_every_row_count(vnni, panels, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = _q4_blocks(16 * panels, groups, gen)
    lanes, x = int4_native.to_lanes(blocks), _rows(groups, gen)
    isa, bf16 = native.ISAS["avx512vnni"], native.ISAS["avx512bf16"]
    alone = vnni.q4_linear(x, lanes, isa)  # type: ignore[attr-defined]
    for rows in ROWS:
        got = vnni.q4_linear(x[:rows], lanes, isa)  # type: ignore[attr-defined]
        assert torch.equal(got, vnni.q4_linear(x[:rows], blocks, isa)), rows  # type: ignore[attr-defined]
        assert torch.equal(got, alone[:rows]), rows  # each row's result its own
        if rows >= int4_native.PANEL_FROM_ROWS:  # a prompt's bfloat16 panels, decoded from the lanes
            want = vnni.q4_linear(x[:rows], blocks, bf16)  # type: ignore[attr-defined]
            assert torch.equal(vnni.q4_linear(x[:rows], lanes, bf16), want), rows  # type: ignore[attr-defined]


@given(st.integers(1, 4), st.sampled_from([1, 3, 5]), st.integers(0, 2**31 - 1))
@settings(max_examples=12, deadline=None)
def test_q8_0_lanes_blocks_give_the_groups_bits_at_every_row_count(vnni, panels, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = _q8_groups(16 * panels, groups, gen)
    lanes, x = Q8Lanes.of(weight, vnni).blocks, _rows(groups, gen)
    alone = vnni.q8g_linear(x, lanes, _NONE, native.ISAS["avx512vnni"])  # type: ignore[attr-defined]
    for rows in ROWS:
        for name in ("avx512vnni", "avx512bf16"):  # a decode step's int8 rows; a prompt's float32 ones
            isa = native.ISAS[name]
            want = vnni.q8g_linear(x[:rows], weight.q, weight.scale, isa)  # type: ignore[attr-defined]
            assert torch.equal(vnni.q8g_linear(x[:rows], lanes, _NONE, isa), want), (name, rows)  # type: ignore[attr-defined]
        assert torch.equal(vnni.q8g_linear(x[:rows], lanes, _NONE, native.ISAS["avx512vnni"]), alone[:rows])  # type: ignore[attr-defined]


def test_avx512vnni_lays_out_whole_panels_only_and_its_linears_keep_their_bits(vnni):
    gen = torch.Generator().manual_seed(5)
    isa = native.ISAS["avx512vnni"]
    assert int4_native.lanes_layout(isa, 48) and not int4_native.lanes_layout(isa, 40)
    assert not int4_native.lanes_layout(native.ISAS["avx512bf16"], 48)
    x = torch.randn(12, 96, generator=gen)
    for out in (48, 40):  # 40: 16 + 16 + 8 channels, GGUF's blocks and their kernels
        weight = quantize_int4(torch.randn(out, 96, generator=gen), 32)
        linear = int4_native.Int4NativeLinear.from_rtn(weight, None, "avx512vnni")
        blocks = int4_native.pack_blocks(weight)
        assert linear.blocks.shape[2] == (int4_native.LANES_BLOCK_BYTES if out % 16 == 0 else int4_native.BLOCK_BYTES)
        assert torch.equal(linear.row_blocks(), blocks)
        for rows in (1, 8, 12):  # 12: a prompt's rows take avx512bf16's panels (call_isa)
            want = vnni.q4_linear(x[:rows], blocks, int4_native.call_isa(isa, rows))  # type: ignore[attr-defined]
            assert torch.equal(linear(x[:rows]), want), (out, rows)
    for out, held in ((48, True), (40, False)):
        grouped = int8_native.Int8GroupNativeLinear.over(_q8_groups(out, 3, gen), "avx512vnni")
        projection = grouped.in_lanes(head=False)  # avx512vnni: a projection's table too
        assert isinstance(projection.weight, Q8Lanes) == held
        decode = int8_native.Int8GroupNativeLinear(projection.weight, isa, vnni, int8_panels=True)
        for rows in (1, 9, 12):
            w = grouped.weight
            assert torch.equal(decode(x[:rows]), vnni.q8g_linear(x[:rows], w.q, w.scale, isa))  # type: ignore[attr-defined]
            assert torch.equal(projection(x[:rows]), grouped(x[:rows]))  # a prompt's float32 rows
    avx2 = int8_native.Int8GroupNativeLinear.over(_q8_groups(48, 3, gen), "avx2int8")
    assert avx2.in_lanes(head=False) is avx2  # avx2int8's fused step takes a projection's groups


def test_lanes_blocks_on_a_variant_without_their_kernels_are_refused(vnni):
    gen = torch.Generator().manual_seed(6)
    lanes = int4_native.to_lanes(_q4_blocks(16, 2, gen))
    with pytest.raises(RuntimeError, match="4-bit lanes blocks run on isa 5 .avx512vnni., or its panels from 10 rows"):
        vnni.q4_linear(torch.randn(3, 64), lanes, native.ISAS["avx512bf16"])  # type: ignore[attr-defined]
    q8 = Q8Lanes.of(_q8_groups(16, 2, gen), vnni).blocks
    with pytest.raises(RuntimeError, match="Q8_0 lanes blocks run on isa 2"):
        vnni.q8g_linear(torch.randn(3, 64), q8, _NONE, native.ISAS["avx2"])  # type: ignore[attr-defined]
