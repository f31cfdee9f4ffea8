"""A decoder layer's projections on compressed-weight kernels: the same
three calls as ``model.PlainProjections`` (fused q/k/v, o plus residual,
SwiGLU MLP plus residual), each linear a kernel from ``choose``.

The kernels multiply in bfloat16. Where a linear has no bias and exposes
``mm`` (its product in the kernel's dtype), the o and down products are
added to the float32 residual as they are, in one op: ``torch.add`` promotes
them exactly, so the result is the same bits as converting first, with two
fewer ops a layer (a one-stream decode step runs a few hundred such small
ops, docs/benchmarks.md, "A lean decode step").
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from .choose import Linear
from .row_split import RowSplitLinear


def has_bare_product(linear: Linear) -> bool:
    """Whether ``linear.mm`` gives ``linear``'s whole result before its
    conversion back to the input dtype: it has ``mm`` and no bias."""
    if isinstance(linear, RowSplitLinear):
        return has_bare_product(linear.small) and has_bare_product(linear.large)
    return callable(getattr(linear, "mm", None)) and getattr(linear, "bias", True) is None


@attrs.frozen
class QuantizedProjections:
    """One layer's compressed projections; biases live inside the kernels."""

    qkv_linear: Linear
    o_linear: Linear
    gate_up_linear: Linear
    down_linear: Linear
    # The o, gate_up and down products are used in the kernels' dtype (see the module's doc).
    bare: bool = attrs.field(init=False)

    @bare.default
    def _bare(self) -> bool:
        return all(map(has_bare_product, (self.o_linear, self.gate_up_linear, self.down_linear)))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv_linear(x)

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.bare:
            return torch.add(residual, self.o_linear.mm(x))  # type: ignore[attr-defined]
        return self.o_linear(x).add_(residual)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.bare:
            gate, up = self.gate_up_linear.mm(x).to(x.dtype).chunk(2, dim=-1)  # type: ignore[attr-defined]
            return torch.add(residual, self.down_linear.mm(F.silu(gate).mul_(up)))  # type: ignore[attr-defined]
        gate, up = self.gate_up_linear(x).chunk(2, dim=-1)
        return self.down_linear(F.silu(gate).mul_(up)).add_(residual)
