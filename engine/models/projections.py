"""How a decoder layer runs its projections: the choice (``choose_projections``,
by ``capability.CpuPaths``) and the float paths. On CPU they run on oneDNN
over weights reordered once into its blocked layout (``PackedProjections``),
with SiLU, the gate product and the residual adds fused into the matmuls,
where that path works in the model's dtype; elsewhere ``F.linear`` over the
parameters (``PlainProjections``). Both compute the same float32 result up
to summation order. Compressed weights run ``kernels.projections``."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.kernels import onednn
from trioserve.engine.kernels.capability import CpuPaths, dtype_name, packed_path
from trioserve.engine.kernels.projections import QuantizedProjections, gate_activation
from trioserve.engine.models.invariance import Invariance


@attrs.frozen
class ProjectionChoice:
    """How a model runs its projections, and why: shown at startup, in the
    load log and in ``/version``. ``fallback``: the packed path would have
    been taken, but this CPU (or ``TRIOSERVE_CPU_ASSUME``) lacks it."""

    device: str
    dtype: str
    packed: bool
    reason: str
    fallback: bool = False
    quantization: str | None = None  # e.g. "int4": compressed projections (engine/kernels)
    # Set once the model is built (``LlamaForCausalLM.invariance``).
    invariance: Invariance | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "projections": "packed" if self.packed else "plain",
            "fallback": self.fallback,
            "reason": self.reason,
            "quantization": self.quantization,
            "invariance": None if self.invariance is None else self.invariance.as_json(),
        }

    @property
    def summary(self) -> str:
        """The choice without the reason, e.g. ``bfloat16 on cpu, plain projections``."""
        if self.quantization is not None:
            return f"{self.dtype} on {self.device}, {self.quantization} projections"
        return f"{self.dtype} on {self.device}, {'packed' if self.packed else 'plain'} projections"

    def __str__(self) -> str:
        return f"{self.summary} ({self.reason})"


def choose_projections(
    device: torch.device | str, dtype: torch.dtype, cpu_paths: CpuPaths | None, pack_weights: bool | None
) -> ProjectionChoice:
    """Packed (oneDNN) or plain (``F.linear``) projections for a model on
    ``device`` in ``dtype``, by what ``cpu_paths`` found works.

    ``pack_weights`` None picks packed where that path works and plain
    otherwise; False is plain; True insists on packed: a ``ValueError``
    where the model never packs (float16, not CPU), a ``CpuCapabilityError``
    where this CPU cannot.
    """
    device = torch.device(device)
    where = {"device": str(device), "dtype": dtype_name(dtype)}
    name = packed_path(dtype)
    if pack_weights and (device.type != "cpu" or name is None):
        raise ValueError(f"pack_weights needs a CPU float32 or bfloat16 model with oneDNN, not {dtype} on {device}")
    if device.type != "cpu":
        return ProjectionChoice(**where, packed=False, reason=f"F.linear on {device.type}")
    if pack_weights is False:
        return ProjectionChoice(**where, packed=False, reason="pack_weights=False: F.linear")
    if name is None:
        return ProjectionChoice(**where, packed=False, reason=f"no packed path for {dtype_name(dtype)}: F.linear")
    if cpu_paths is None:
        raise ValueError("a CPU model needs cpu_paths to choose its projections")
    status = cpu_paths.status(name)
    if status.available:
        return ProjectionChoice(**where, packed=True, reason=status.reason)
    if pack_weights:
        raise CpuCapabilityError(
            f"pack_weights=True, but {status.reason}; on this CPU run {dtype_name(dtype)} unpacked "
            f"(pack_weights=None picks what works)"
        )
    reason = f"{status.reason}; F.linear on the plain weights instead"
    if dtype == torch.bfloat16:
        # Measured (docs/architecture.md, "CPU paths"): without oneDNN's
        # bfloat16 kernels torch's bfloat16 matmul is 6-13x slower than float32's.
        reason += " (in bfloat16 several times slower than float32 on such a CPU)"
    return ProjectionChoice(**where, packed=False, reason=reason, fallback=True)


@attrs.frozen
class PlainProjections:
    """One layer's projections as ``F.linear`` over its parameters (CUDA,
    or CPU without packing). Each method returns what the layer needs next:
    the fused q/k/v, or the residual stream with the projection added."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qkv_weight, self.qkv_bias)

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.o_weight, self.o_bias) + residual

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight) + residual

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.o_weight, self.o_bias)

    def mlp(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return F.linear(gate_activation(gate, activation) * up, self.down_weight)

    # The MLP's two halves apart, for LoRA's deltas between them (engine/lora).
    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate_up_weight)

    def down(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.down_weight)


@attrs.frozen
class PackedProjections:
    """The same projections on oneDNN over weights reordered once
    (``onednn.pack``), with the elementwise work fused into the matmuls: SiLU
    into the gate projection, the gate product into the up projection, the
    residual adds into the o and down projections."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_weight: torch.Tensor
    up_weight: torch.Tensor
    down_weight: torch.Tensor

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.qkv_weight, self.qkv_bias, "none")

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return onednn.linear_binary(x, self.o_weight, self.o_bias, "add", residual)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate = onednn.linear(x, self.gate_weight, None, "swish")  # SiLU
        hidden = onednn.linear_binary(x, self.up_weight, None, "mul", gate)
        return onednn.linear_binary(hidden, self.down_weight, None, "add", residual)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.o_weight, self.o_bias, "none")

    def mlp(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        gate = gate_activation(onednn.linear(x, self.gate_weight, None, "none"), activation)
        hidden = onednn.linear_binary(x, self.up_weight, None, "mul", gate)
        return onednn.linear(hidden, self.down_weight, None, "none")

    # The MLP's two halves apart, for LoRA's deltas between them (engine/lora).
    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        gate = onednn.linear(x, self.gate_weight, None, "none")
        return torch.cat([gate, onednn.linear(x, self.up_weight, None, "none")], dim=-1)

    def down(self, h: torch.Tensor) -> torch.Tensor:
        return onednn.linear(h, self.down_weight, None, "none")


Projections = PlainProjections | PackedProjections | QuantizedProjections
