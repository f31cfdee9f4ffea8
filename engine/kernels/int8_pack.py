"""int8 weights per channel, float activations: ATen's ``_weight_int8pack_mm``
(runs on any CPU torch runs on). ``act_dtype`` is the dtype the kernel
multiplies in: its bfloat16 kernel on an AVX-512 CPU is some 20x faster than
its float32 one (trioserve bench kernels), at the cost of rounding the
activations to bfloat16."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.rtn import Int8Weight, quantize_int8


@attrs.frozen
class Int8PackLinear:
    """``x @ W.T + bias`` with ``W = q * scale`` dequantized inside the kernel."""

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    act_dtype: torch.dtype

    @classmethod
    def from_rtn(
        cls, weight: Int8Weight, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.float32
    ) -> Int8PackLinear:
        out, k = weight.q.shape
        # A copy of its own: the kernel crashed (torch 2.13) on a weight read
        # straight out of a safetensors file, whose memory it does not own.
        return cls(weight.q.clone(), weight.scale.to(act_dtype).contiguous(), bias, k, out, act_dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(self.act_dtype), self.q, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


def trial(act_dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel on tiny inputs in ``act_dtype``, with its float32 reference (``capability.Probe``)."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    weight = quantize_int8(w)
    got = Int8PackLinear.from_rtn(weight, bias, act_dtype)(x)
    return {"Int8PackLinear": (got, F.linear(x, weight.dequantize(), bias))}
