"""oneDNN's packed linear ops on CPU, and the trial that shows they work here.

``pack`` reorders a weight once into oneDNN's blocked layout; ``linear`` and
``linear_binary`` multiply by it with an elementwise op fused into the
epilogue. Whether they run depends on the CPU, not only on the dtype: the
bfloat16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so it fails on
an AVX2-only CPU such as AMD Zen 3. ``trial`` runs every op the model uses on
tiny inputs, so ``capability.CpuPaths.detect`` can tell before a model
depends on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The dtypes the model packs (oneDNN also has a float16 path, on AVX-512-FP16
# or AVX-NE-CONVERT CPUs; the model does not use it).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of ``weight`` ``[out, in]``, for any number of rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


# oneDNN builds and caches a kernel for every input shape it meets (in its
# primitive cache and in ideep's, 1,024 entries each), up to a few MiB apiece
# for large shapes, and a step's row count is its number of tokens, which
# varies from step to step. Left alone, a server's memory grows for as long
# as new counts keep coming (docs/reliability.md, "Soak"). So a linear runs
# at few row counts: exact up to EXACT_ROWS (decode batches, where every
# size is common and a matmul costs the weights' bandwidth, not its rows),
# then rounded up by less than an eighth, and past MAX_ROWS in slices of
# MAX_ROWS rows (a GEMM is at its peak by then; 256-row slices cost a
# prefill about a fifth). That is EXACT_ROWS + 32 shapes in all, built once
# (``Model.warm_up``).
EXACT_ROWS = 64
MAX_ROWS = 1024
# A single row runs as two: at one row oneDNN's float32 GEMM takes a kernel
# that sums a row in another order than at two rows or more (seen at 1,536
# inputs on AVX-512), so a sequence decoding alone would get other bits
# than the same sequence in a batch. From two rows on, a row's sums do not
# depend on the row count (tests/test_invariance.py checks the whole model).
MIN_ROWS = 2


def row_bucket(num_rows: int) -> int:
    """The row count a packed linear of ``num_rows`` rows (at most
    ``MAX_ROWS``) runs at."""
    assert 0 < num_rows <= MAX_ROWS
    if num_rows <= EXACT_ROWS:
        return max(num_rows, MIN_ROWS)
    step = 1 << (num_rows.bit_length() - 4)  # 1/16 to 1/8 of num_rows
    return -(-num_rows // step) * step


def row_buckets() -> list[int]:
    """Every row count a packed linear runs at, ascending."""
    buckets = []
    rows = 1
    while rows <= MAX_ROWS:
        bucket = row_bucket(rows)
        buckets.append(bucket)
        rows = bucket + 1
    return buckets


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    # Zero rows: a matmul's rows are independent, so they change no real row.
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def by_row_buckets(
    call, x: torch.Tensor, *others: torch.Tensor, bucket=row_bucket, max_rows: int = MAX_ROWS
) -> torch.Tensor:
    """``call(x, *others)`` over row slices of at most ``max_rows``, each
    padded to its ``bucket`` (a row count of at most ``max_rows`` for any
    count up to it); the padding is cut off again. For any oneDNN matmul
    whose row count varies: it then builds a kernel for each bucket only."""
    rows = x.shape[0]
    if rows == 0:
        return call(x, *others)
    if rows <= max_rows:
        padded = bucket(rows)
        return call(_pad_rows(x, padded), *(_pad_rows(o, padded) for o in others))[:rows]
    parts = [
        by_row_buckets(
            call, x[start : start + max_rows], *(o[start : start + max_rows] for o in others), bucket=bucket, max_rows=max_rows
        )
        for start in range(0, rows, max_rows)
    ]
    return torch.cat(parts)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, post_op: str) -> torch.Tensor:
    """``x @ W.T + bias`` (``x`` 2-D) with ``post_op`` ("none", "swish", ...)
    applied in the matmul's epilogue."""

    def call(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, post_op, [], "")

    return by_row_buckets(call, x)


def linear_binary(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, op: str, other: torch.Tensor
) -> torch.Tensor:
    """``(x @ W.T + bias) <op> other`` in one call (``x`` 2-D): ``op`` is "add" or "mul"."""

    def call(rows: torch.Tensor, other_rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(rows, other_rows, packed, bias, op)

    return by_row_buckets(call, x, other)


def trial(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run every packed op the model uses in ``dtype`` on tiny inputs; return
    each result with its float32 reference (the caller compares them).
    Raises whatever the ops raise where they cannot run."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch build has no oneDNN (mkldnn)")
    gen = torch.Generator().manual_seed(0)
    x32, w32, other32 = (torch.randn(shape, generator=gen) for shape in ((4, 64), (32, 64), (4, 32)))
    bias32 = torch.randn(32, generator=gen)
    x, w, other, bias = (t.to(dtype) for t in (x32, w32, other32, bias32))
    packed = pack(w)
    product = F.linear(x.float(), w.float(), bias.float())
    return {
        "packed linear": (linear(x, packed, bias, "none"), product),
        "packed linear+swish": (linear(x, packed, None, "swish"), F.silu(product - bias.float())),
        "packed linear+add": (linear_binary(x, packed, bias, "add", other), product + other.float()),
        "packed linear*mul": (linear_binary(x, packed, None, "mul", other), (product - bias.float()) * other.float()),
    }

