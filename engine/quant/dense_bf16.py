"""The many-rows side of a row split: a compressed weight expanded once to
bfloat16 and multiplied on oneDNN (the ``onednn_packed_bfloat16`` path,
AVX-512 or AVX-NE-CONVERT).

ATen's packed 4-bit and int8 kernels are the fastest here at one row, but
they are GEMV kernels: at 32 rows they are slower than the float32 path's
oneDNN matmul, so a compressed model would serve many streams slower than
the float one. A bfloat16 copy (2 bytes a weight, a quarter of the float32
path's weights and packed copy) runs batched steps on oneDNN's bfloat16
GEMM. Never chosen alone: it is no compression (``choose.choose_kernel``).
The copy holds the dequantized weight rounded to bfloat16 (8 bits of
mantissa; the kernels already round activations the same way).
"""

from __future__ import annotations

import attrs
import torch

from .. import onednn
from .rtn import Int4Weight, Int8Weight


@attrs.frozen
class DenseBf16Linear:
    """``x @ W.T + bias`` over ``W`` in bfloat16, packed for oneDNN."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int

    @classmethod
    def from_weight(cls, weight: torch.Tensor | Int4Weight | Int8Weight, bias: torch.Tensor | None) -> DenseBf16Linear:
        dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        out, k = dense.shape
        return cls(onednn.pack(dense.to(torch.bfloat16).contiguous()), bias, k, out)

    @property
    def nbytes(self) -> int:
        return 2 * self.in_features * self.out_features

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias, in bfloat16."""
        return onednn.linear(x.to(torch.bfloat16), self.packed, None, "none")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x).to(x.dtype)
        return y if self.bias is None else y + self.bias
