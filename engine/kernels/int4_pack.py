"""4-bit weights in groups: ATen's ``_weight_int4pack_mm_for_cpu`` over its
packed layout (two weights a byte), ``w = (q - 8) * scale + zero`` per group. ``act_dtype`` as in ``int8_pack``: bfloat16 is the fast kernel on AVX-512."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.rtn import Int4Weight, quantize_int4

# The group sizes _weight_int4pack_mm_for_cpu has kernels for.
GROUP_SIZES = (32, 64, 128, 256)


@attrs.frozen
class Int4PackLinear:
    """``x @ W.T + bias`` with ``W`` packed 4-bit, dequantized inside the kernel."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [in // group, out, 2]
    bias: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int
    act_dtype: torch.dtype

    @staticmethod
    def check_group_size(group_size: int) -> None:
        """Raise ``ValueError`` for a group size the kernel has no variant for."""
        if group_size not in GROUP_SIZES:
            raise ValueError(
                f"quantization group size {group_size}: the 4-bit kernel runs groups of "
                f"{', '.join(map(str, GROUP_SIZES))} only"
            )

    @classmethod
    def from_rtn(
        cls, weight: Int4Weight, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.float32
    ) -> Int4PackLinear:
        cls.check_group_size(weight.group_size)
        out, k = weight.q.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        sz = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).to(act_dtype).contiguous()
        return cls(packed, sz, bias, weight.group_size, k, out, act_dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_and_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_in = x.to(self.act_dtype)
        y = torch._weight_int4pack_mm_for_cpu(x_in, self.packed, self.group_size, self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias


def trial(act_dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel on tiny inputs in ``act_dtype``, with its float32 reference (``capability.Probe``)."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    weight = quantize_int4(w, 32)
    got = Int4PackLinear.from_rtn(weight, bias, act_dtype)(x)
    return {"Int4PackLinear": (got, F.linear(x, weight.dequantize(), bias))}
