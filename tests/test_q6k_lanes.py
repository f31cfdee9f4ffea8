"""GGUF's Q6_K held at the file's width on avx512vnni (engine/kernels/q6k_lanes.py,
csrc/q6k_lanes_vnni.h): the lanes hold the file's values; a row's result
has the same bits at every row count and batch composition, the bits of a
numpy emulation of the kernel's operations, and is close to float64 W x
over the file's values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trioserve.engine.kernels import native, q6k_lanes
from trioserve.engine.kernels.q6k_lanes import Q6KLanes
from trioserve.engine.loading import gguf_weights

from test_gguf_kquants import _random_blocks, _reference

VNNI, BF16, AVX512 = native.ISAS["avx512vnni"], native.ISAS["avx512bf16"], native.ISAS["avx512"]
ROWS = (1, 2, 5, 17, 40)
SHAPES = ((16, 256), (48, 768), (96, 2048))


@pytest.fixture(scope="module")
def ops(isas) -> object:
    if "avx512vnni" not in isas:
        pytest.skip(f"this CPU cannot run avx512vnni ({native.ISA_REQUIREMENTS['avx512vnni']})")
    return native.ops()


def _matrix(out: int, k: int, seed: int) -> np.ndarray:
    return _random_blocks("Q6_K", out, k, np.random.default_rng(seed))


def _emulate(x: torch.Tensor, data: np.ndarray) -> torch.Tensor:
    """csrc/q6k_lanes_vnni.h's operations in numpy: the rows rounded to int8
    in groups of 32 (quantize_rows_q8), each group's exact int32 sum of its
    two sub-blocks' scaled dots, then in float32 ``acc = fma(t * dx, d,
    acc)`` group after group (the fma exact in float64, then rounded)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 210)
    n = blocks.shape[1]
    u = (gguf_weights.decode_q6_k(data).q.numpy().astype(np.int64)).reshape(out, n * 16, 16)  # u - 32
    sc = blocks[..., 192:208].view(np.int8).astype(np.int64).reshape(out, n * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)[..., 0]  # [out, n]
    g = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(g * inv[..., None]).astype(np.int64).reshape(x.shape[0], n * 16, 16)
    step = (amax / np.float32(127)).astype(np.float32)  # [rows, groups]
    t = (np.einsum("rsi,osi->ros", q, u) * sc).reshape(x.shape[0], out, n * 8, 2).sum(-1)  # exact
    acc = np.zeros((x.shape[0], out), np.float32)
    for b in range(n * 8):
        a = t[:, :, b].astype(np.float32) * step[:, b : b + 1]
        acc = (a.astype(np.float64) * d[:, b // 8].astype(np.float64) + acc).astype(np.float32)
    return torch.from_numpy(acc)


def test_the_lanes_hold_the_files_values(ops):
    """Each channel decoded back from the lanes (float32 panels against the
    identity: exact) is the file's Q6_K values, as gguf's reference reads
    them; the bfloat16 matrix is each of them rounded."""
    for out, k in SHAPES:
        data = _matrix(out, k, out + k)
        lanes = Q6KLanes.of(data, ops)
        assert lanes.shape == (out, k) and lanes.nbytes == data.nbytes  # the file's bytes, rearranged
        assert lanes.lanes.shape == (out // 16, k // 256, q6k_lanes.LANES_BYTES)
        want = _reference("Q6_K", data)
        assert torch.equal(lanes.linear(torch.eye(k), AVX512).T, want)
        assert torch.equal(lanes.dequantize_bf16(), want.to(torch.bfloat16))


def test_a_rows_bits_are_the_same_at_every_row_count_and_in_any_batch(ops):
    for out, k in SHAPES:
        lanes = Q6KLanes.of(_matrix(out, k, out), ops)
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
        x[3, :32] = 0.0  # a group of zeros: a zero step
        whole = lanes.linear(x, VNNI)
        for rows in ROWS:
            assert torch.equal(lanes.linear(x[:rows], VNNI), whole[:rows]), (out, k, rows)
        # Row 7 alone, and among other rows at another place in the batch.
        others = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
        mixed = torch.cat([others[:11], x[7:8], others[11:]])
        assert torch.equal(lanes.linear(x[7:8], VNNI)[0], whole[7])
        assert torch.equal(lanes.linear(mixed, VNNI)[11], whole[7])
        # The panels a prompt's rows take outside batch-invariant mode too.
        for isa in (BF16, AVX512):
            panels = lanes.linear(x, isa)
            assert torch.equal(lanes.linear(x[:5], isa), panels[:5]) and torch.equal(lanes.linear(mixed, isa)[11], panels[7])


def test_the_kernel_computes_its_documented_operations_and_is_close_to_w_x(ops):
    for out, k in SHAPES:
        data = _matrix(out, k, 2 * out)
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(out))
        got = Q6KLanes.of(data, ops).linear(x, VNNI)
        assert torch.equal(got, _emulate(x, data))
        exact = x.double() @ _reference("Q6_K", data).double().T
        # The int8 activations' rounding alone (at most amax / 254 a value).
        assert (got.double() - exact).abs().max() <= 1e-2 * exact.abs().max()


def test_shapes_without_whole_panels_do_not_fit():
    assert q6k_lanes.fits(16, 256) and q6k_lanes.fits(512, 8192)
    assert not q6k_lanes.fits(24, 256) and not q6k_lanes.fits(16, 288)
