"""A decoder layer's projections on compressed-weight kernels: the same
three calls as ``model.PlainProjections`` (fused q/k/v, o plus residual,
SwiGLU MLP plus residual), each linear a kernel from ``choose``."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.choose import Linear


def gate_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's activation of its gate: SwiGLU's SiLU, or GeGLU's
    tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"unsupported MLP activation {activation!r}")


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

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_linear(x)

    def mlp(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = self.gate_up_linear(x).chunk(2, dim=-1)
        return self.down_linear(gate_activation(gate, activation).mul_(up))

    # The MLP's two halves apart, for LoRA's deltas between them (engine/lora).
    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up_linear(x)

    def down(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_linear(h)
