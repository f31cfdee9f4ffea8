"""Two kernels over the same weights, picked by the number of rows.

Where the fastest kernel at one row is not the fastest at many (on an
AVX512-BF16 CPU: ATen's 4-bit kernel in bfloat16 at one row, fbgemm's int8
from a few rows up; docs/benchmarks.md), a linear keeps the weights in both
layouts and sends each call to the kernel that wins at its row count. Both
copies together (about 1.5 bytes a weight) are still a fifth of the float32
path's weights and packed copy (8 bytes a weight).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch


@attrs.frozen
class RowSplitLinear:
    """``small`` for calls of at most ``max_small_rows`` rows, ``large`` above."""

    small: Callable[[torch.Tensor], torch.Tensor]
    large: Callable[[torch.Tensor], torch.Tensor]
    max_small_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.max_small_rows else self.large(x)
