"""int8 weights per channel on torch's quantized engine (fbgemm on x86):
``torch.ops.quantized.linear_dynamic`` quantizes each call's activations to
uint8 (one scale per call) and multiplies in integers.

Torch marks this quantized-tensor API deprecated; it is kept behind this one
module so another kernel can take its place.
"""

from __future__ import annotations

import warnings

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.rtn import Int8Weight, quantize_int8

ENGINE = "fbgemm"


@attrs.frozen
class Int8DynamicLinear:
    """``x @ W.T + bias`` with ``W`` int8 per output channel, prepacked."""

    packed: object  # torch's LinearPackedParams
    in_features: int
    out_features: int
    nbytes: int

    @classmethod
    def from_rtn(cls, weight: Int8Weight, bias: torch.Tensor | None = None) -> Int8DynamicLinear:
        out, k = weight.q.shape
        zeros = torch.zeros(out, dtype=torch.long)
        with warnings.catch_warnings():
            # The deprecation notice of quantized tensors: known, and why this module stands alone.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(weight.q, weight.scale.double(), zeros, 0)
        # The packed layout is the engine's that is current at prepack time;
        # torch's default "x86" engine measured 6-10x slower than fbgemm at 32
        # and 64 rows here (docs/benchmarks.md), so prepack for fbgemm.
        before = torch.backends.quantized.engine
        torch.backends.quantized.engine = ENGINE
        try:
            packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
        finally:
            torch.backends.quantized.engine = before
        return cls(packed, k, out, weight.q.numel() + 4 * out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so AVX2's 16-bit pair sums cannot saturate.
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


def trial() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel on tiny inputs, with its float32 reference (``capability.Probe``)."""
    if ENGINE not in torch.backends.quantized.supported_engines:
        raise RuntimeError(f"this torch build has no {ENGINE} quantized engine")
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    weight = quantize_int8(w)
    return {"int8 dynamic linear": (Int8DynamicLinear.from_rtn(weight, bias)(x), F.linear(x, weight.dequantize(), bias))}
