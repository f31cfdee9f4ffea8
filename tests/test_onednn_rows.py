"""Packed linears run at bucketed row counts, so oneDNN's kernel caches
(one kernel per input shape) stop growing: exact counts up to EXACT_ROWS,
then less than an eighth of padding. The padding never reaches a result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine import onednn
from trioserve.engine.capability import CpuPaths, packed_path

pytestmark = pytest.mark.cpu_paths


@given(st.integers(1, 200_000))
def test_a_row_bucket_is_exact_for_small_counts_and_pads_under_an_eighth(rows):
    bucket = onednn.row_bucket(rows)
    if rows <= onednn.EXACT_ROWS:
        assert bucket == rows
    else:
        assert rows <= bucket < rows + rows / 8
    assert onednn.row_bucket(bucket) == bucket


def test_the_row_counts_seen_are_few():
    buckets = {onednn.row_bucket(rows) for rows in range(1, 8193)}
    # 64 exact counts, then at most 8 per doubling from 64 to 8192 (7 doublings).
    assert len(buckets) <= onednn.EXACT_ROWS + 8 * 7


@pytest.mark.parametrize("rows", [1, 7, onednn.EXACT_ROWS, onednn.EXACT_ROWS + 1, 100, 131, 300])
def test_padded_rows_never_reach_the_result(rows):
    if not CpuPaths.from_environment().available(packed_path(torch.float32)):
        pytest.skip("oneDNN's packed float32 path is off on this CPU")
    gen = torch.Generator().manual_seed(rows)
    x, w, other = (torch.randn(shape, generator=gen) for shape in ((rows, 96), (80, 96), (rows, 80)))
    bias = torch.randn(80, generator=gen)
    packed = onednn.pack(w)
    product = F.linear(x, w, bias)
    cases = {
        "linear": (onednn.linear(x, packed, bias, "none"), product),
        "swish": (onednn.linear(x, packed, None, "swish"), F.silu(product - bias)),
        "add": (onednn.linear_binary(x, packed, bias, "add", other), product + other),
        "mul": (onednn.linear_binary(x, packed, None, "mul", other), (product - bias) * other),
    }
    for name, (got, expected) in cases.items():
        assert got.shape == (rows, 80), name
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)
