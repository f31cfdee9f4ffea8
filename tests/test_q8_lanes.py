"""avx2int8's Q8_0 LM head held as lanes blocks (engine/kernels/q8_lanes.py,
csrc/q8_lanes_avx2.h): the same values, the same bits as the kernels over
GGUF's groups at every row count, and a tied model's embeddings read from
the same table."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.kernels import int8_native

from trioserve.engine.kernels import native

from trioserve.engine.kernels import q8_lanes
from trioserve.engine.kernels.embedding import CompressedEmbedding
from trioserve.engine.kernels.int4_native import PANEL_FROM_ROWS
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int8GroupWeight


def _groups(out: int, k: int, gen: torch.Generator) -> Int8GroupWeight:
    q = torch.randint(-128, 128, (out, k), generator=gen, dtype=torch.int8)
    return Int8GroupWeight(q, torch.rand(out, k // 32, generator=gen) * 0.02, 32)


@pytest.fixture(scope="module")
def avx2int8() -> None:
    try:
        isas = native.cpu_isas()
    except native.NativeUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"scripts/setup.sh must build the native kernels under CI: {exc}")
        pytest.skip(str(exc))
    if "avx2int8" not in isas:
        pytest.skip(f"this CPU cannot run avx2int8 ({native.ISA_REQUIREMENTS['avx2int8']})")


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_q8_lanes_hold_the_groups_values_and_steps(panels, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = _groups(16 * panels, 32 * groups, gen)
    lanes = Q8Lanes.of(weight, None)
    assert lanes.blocks.shape == (panels, groups, q8_lanes.BLOCK_BYTES) and lanes.blocks.dtype == torch.uint8
    assert lanes.shape == tuple(weight.q.shape) and lanes.nbytes == weight.q.nbytes + weight.scale.nbytes
    back = lanes.groups()
    assert torch.equal(back.q, weight.q) and torch.equal(back.scale, weight.scale) and back.group_size == 32
    index = torch.randint(0, 16 * panels, (7,), generator=gen)
    rows = lanes.rows(index)
    assert torch.equal(rows.q, weight.q[index]) and torch.equal(rows.scale, weight.scale[index])
    assert torch.equal(lanes.dequantize(), weight.dequantize())


def test_only_whole_panels_of_groups_of_32_fit():
    gen = torch.Generator().manual_seed(0)
    assert q8_lanes.fits(_groups(48, 64, gen))
    assert not q8_lanes.fits(_groups(40, 64, gen))  # 16 + 16 + 8 channels
    q = torch.zeros(16, 64, dtype=torch.int8)
    assert not q8_lanes.fits(Int8GroupWeight(q, torch.ones(16, 4), 16))


def test_a_tied_tables_embeddings_read_the_lanes_as_the_groups(avx2int8):
    gen = torch.Generator().manual_seed(3)
    weight = _groups(64, 96, gen)
    lanes = Q8Lanes.of(weight, native.ops())
    ids = torch.tensor([[0, 17, 63], [5, 5, 48]])
    got, want = CompressedEmbedding(lanes), CompressedEmbedding(weight)
    assert (got.num_embeddings, got.embedding_dim, got.nbytes) == (want.num_embeddings, want.embedding_dim, want.nbytes)
    assert torch.equal(got(ids), want(ids))
    every = torch.arange(64)
    assert torch.equal(lanes.lookup(every), lanes.rows(every).dequantize())
    assert lanes.lookup(every[:0]).shape == (0, 96)
    with pytest.raises(RuntimeError, match="id 64 is outside the table's 64 rows"):
        lanes.lookup(torch.tensor([3, 64]))
    with pytest.raises(RuntimeError, match="id -1 is outside"):
        lanes.lookup(torch.tensor([-1]))


def test_avx2int8_runs_a_q8_0_head_as_lanes_blocks_with_the_groups_bits(avx2int8):
    """Every row count gives the bits of the kernels over GGUF's groups
    (rows_avx2.h's int16 row kernels below 10 rows, the int16 panels from
    10), through the op and through the linear; a prompt's logits (the
    linear without ``int8_panels``) take the same int16 rows. Other variants
    and shapes keep the groups, and the kernel refuses lanes blocks on
    another variant or cut short."""
    gen = torch.Generator().manual_seed(7)
    ops, isa, none = native.ops(), native.ISAS["avx2int8"], torch.empty(0)
    for out, k in ((16, 32), (48, 96), (64, 576)):
        weight = _groups(out, k, gen)
        grouped = int8_native.Int8GroupNativeLinear.over(weight, "avx2int8")
        held = grouped.in_lanes()
        assert isinstance(held.weight, Q8Lanes) and held.weight.shape == (out, k)
        decode = int8_native.Int8GroupNativeLinear(weight, isa, ops, int8_panels=True)
        x = torch.randn(40, k, generator=gen)
        x[2, :32] = 0.0
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, PANEL_FROM_ROWS, 13, 40):
            want = ops.q8g_linear(x[:rows], weight.q, weight.scale, isa)
            assert torch.equal(ops.q8g_linear(x[:rows], held.weight.blocks, none, isa), want), (out, k, rows)
            assert torch.equal(held(x[:rows]), want) and torch.equal(decode(x[:rows]), want), (out, k, rows)
        assert held(x[:0]).shape == (0, out)
    assert grouped.in_lanes() is not grouped
    for other in ("avx2", "scalar"):
        kept = int8_native.Int8GroupNativeLinear.over(_groups(32, 64, gen), other)
        assert kept.in_lanes() is kept
    narrow = int8_native.Int8GroupNativeLinear.over(_groups(40, 64, gen), "avx2int8")
    assert narrow.in_lanes() is narrow
    blocks = Q8Lanes.of(_groups(32, 64, gen), ops).blocks
    with pytest.raises(RuntimeError, match=r"Q8_0 lanes blocks run on isa 2 \(avx2int8\), not isa 1"):
        ops.q8g_linear(torch.randn(3, 64), blocks, none, native.ISAS["avx2"])
    with pytest.raises(RuntimeError, match=r"lanes blocks must be uint8 \[out / 16, in / 32, 576\]"):
        ops.q8g_linear(torch.randn(3, 64), blocks[..., :500], none, isa)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.q8g_linear(torch.randn(3, 32), blocks, none, isa)
