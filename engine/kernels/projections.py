"""A decoder layer's projections on compressed-weight kernels: the same
three calls as ``model.PlainProjections`` (fused q/k/v, o plus residual,
SwiGLU MLP plus residual), each linear a kernel from ``choose``."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.choose import Linear


@attrs.frozen
class QuantizedProjections:
    """One layer's compressed projections; biases live inside the kernels."""

    qkv_linear: Linear
    o_linear: Linear
    gate_up_linear: Linear
    down_linear: Linear

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv_linear(x)

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.o_linear(x).add_(residual)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_linear(x).chunk(2, dim=-1)
        return self.down_linear(F.silu(gate).mul_(up)).add_(residual)
