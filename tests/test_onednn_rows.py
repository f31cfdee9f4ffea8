"""Packed linears run at few row counts, so oneDNN's kernel caches (one
kernel per input shape) stop growing: exact counts up to EXACT_ROWS, then
less than an eighth of padding, and slices of MAX_ROWS beyond. The padding
never reaches a result, and warming the kernels up changes no token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.kernels import onednn
from trioserve.engine.kernels.capability import CpuPaths, packed_path

pytestmark = pytest.mark.cpu_paths


@given(st.integers(1, onednn.MAX_ROWS))
def test_a_row_bucket_is_exact_for_small_counts_and_pads_under_an_eighth(rows):
    bucket = onednn.row_bucket(rows)
    if rows <= onednn.EXACT_ROWS:
        assert bucket == max(rows, onednn.MIN_ROWS)  # one row runs as two: the kernel of two or more
    else:
        assert rows <= bucket < rows + rows / 8
    assert onednn.row_bucket(bucket) == bucket


def test_the_row_counts_a_linear_runs_at_are_few():
    buckets = onednn.row_buckets()
    assert buckets == sorted({onednn.row_bucket(rows) for rows in range(1, onednn.MAX_ROWS + 1)})
    # The exact counts from MIN_ROWS, then 8 per doubling up to MAX_ROWS.
    doublings = (onednn.MAX_ROWS // onednn.EXACT_ROWS).bit_length() - 1
    assert len(buckets) == onednn.EXACT_ROWS - onednn.MIN_ROWS + 1 + 8 * doublings


@pytest.mark.parametrize("rows", [1, 7, onednn.EXACT_ROWS, onednn.EXACT_ROWS + 1, 100, 131, 300, onednn.MAX_ROWS, 2500])
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


def test_warm_up_builds_every_row_count_and_changes_no_result():
    from actor_fixtures import tiny_loaded

    from trioserve import testing
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.sampling.sampling_params import SamplingParams

    def tokens(core: EngineCore) -> list[int]:
        core.add_request("r", "warm kernels change nothing", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        out: list[int] = []
        while core.has_unfinished():
            for output in core.step():
                out.extend(output.new_token_ids)
        return out

    loaded = tiny_loaded()
    cold = tokens(EngineCore(loaded, testing.engine_config()))
    buckets = onednn.row_buckets()
    calls = loaded.model.warm_up(max_logit_rows=16)
    if not loaded.model.projection_choice.packed:
        assert calls == 0  # plain projections have no kernels to build
    else:
        assert calls == 5 * len(buckets) + sum(1 for rows in buckets if rows <= 16)
    assert tokens(EngineCore(loaded, testing.engine_config(warm_up=True))) == cold


@pytest.mark.parametrize(("inputs", "outputs"), [(576, 1536), (1536, 576), (576, 960), (96, 80)])
def test_a_packed_float32_rows_bits_do_not_depend_on_the_rows_beside_it(inputs, outputs):
    """What batch invariance on the float path rests on (docs/architecture.md,
    "Same request, same answer"): a row alone (run as MIN_ROWS rows) and the
    same row among others, at any count, get the same bits."""
    if not CpuPaths.from_environment().available(packed_path(torch.float32)):
        pytest.skip("oneDNN's packed float32 path is off on this CPU")
    gen = torch.Generator().manual_seed(inputs)
    w, x = torch.randn(outputs, inputs, generator=gen) * 0.05, torch.randn(300, inputs, generator=gen)
    packed = onednn.pack(w)
    alone = torch.cat([onednn.linear(x[i : i + 1], packed, None, "none") for i in range(3)])
    for rows in (1, 2, 3, 5, 17, 64, 65, 100, 300):
        got = onednn.linear(x[:rows], packed, None, "none")[:3]
        assert torch.equal(got, alone[: min(rows, 3)]), rows
