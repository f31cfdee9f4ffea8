"""Weight-only round-to-nearest formats, the values every kernel starts from.

``Int8Weight``: symmetric int8 per output channel, ``w = q * scale``.
``Int8GroupWeight``: int8 in groups along the input dimension, ``w = q * scale``
per group: exactly GGUF's Q8_0 and Q5_0 (groups of 32) and Q6_K (16).
``Int4Weight``: 4 bits per weight in groups along the input dimension,
``w = (q - 8) * scale + zero`` with ``q`` in 0..15: the convention of torch's
packed int4 kernel, and exactly GGUF's Q4_0 (``zero = 0``), Q4_1
(``zero = m + 8 d``) and Q4_K (a sub-block's ``d sc`` and ``8 d sc - dmin min``).
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Int8Weight:
    """``q`` int8 ``[out, in]``, ``scale`` float32 ``[out]``."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@attrs.frozen
class Int8GroupWeight:
    """``q`` int8 ``[out, in]``, ``scale`` float32 ``[out, in // group_size]``."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, k = self.q.shape
        groups = self.q.float().view(out, k // self.group_size, self.group_size)
        return (groups * self.scale[..., None]).view(out, k)


@attrs.frozen
class Int4Weight:
    """``q`` uint8 ``[out, in]`` holding 0..15; ``scale`` and ``zero``
    float32 ``[out, in // group_size]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, k = self.q.shape
        groups = (self.q.float() - 8).view(out, k // self.group_size, self.group_size)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(out, k)


def check_group_size(shape: tuple[int, ...], group_size: int, name: str = "weight") -> None:
    """Raise ``ValueError`` unless ``group_size`` divides ``name``'s input dimension."""
    if group_size <= 0 or shape[-1] % group_size:
        raise ValueError(
            f"quantization group size {group_size} does not divide {name}'s input dimension {shape[-1]} "
            f"(shape {tuple(shape)}); pick a divisor such as 32 or 64"
        )


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-channel int8 of a float ``[out, in]`` weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int8_groups(weight: torch.Tensor, group_size: int, name: str = "weight") -> Int8GroupWeight:
    """Symmetric int8 of a float ``[out, in]`` weight in groups of
    ``group_size`` inputs, as GGUF's Q8_0 is made (a group's largest
    magnitude to 127), with float32 steps."""
    check_group_size(tuple(weight.shape), group_size, name)
    out, k = weight.shape
    w = weight.float().view(out, k // group_size, group_size)
    scale = w.abs().amax(dim=-1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    q = torch.round(w / divisor[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8GroupWeight(q.view(out, k), scale, group_size)


def regroup_int8(weight: Int8GroupWeight, group_size: int, rows_at_once: int = 4096) -> Int8GroupWeight:
    """``weight`` rounded into int8 groups of ``group_size`` (``quantize_int8_groups``
    of its values), ``rows_at_once`` rows at a time: a vocabulary's table
    (151,936 x 1,536 for Qwen2.5-1.5B) would otherwise pass through float32
    whole, several of its sizes at once."""
    out, k = weight.q.shape
    check_group_size((out, k), group_size)
    q = torch.empty(out, k, dtype=torch.int8)
    scale = torch.empty(out, k // group_size)
    for start in range(0, out, rows_at_once):
        rows = slice(start, start + rows_at_once)
        part = Int8GroupWeight(weight.q[rows], weight.scale[rows], weight.group_size)
        done = quantize_int8_groups(part.dequantize(), group_size)
        q[rows], scale[rows] = done.q, done.scale
    return Int8GroupWeight(q, scale, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int, name: str = "weight") -> Int4Weight:
    """Asymmetric 4-bit of a float ``[out, in]`` weight in groups of ``group_size`` inputs."""
    check_group_size(tuple(weight.shape), group_size, name)
    out, k = weight.shape
    w = weight.float().view(out, k // group_size, group_size)
    # The group's scale and minimum are float16 values, as in GGUF's Q4_1,
    # so the native kernel's 20-byte blocks hold them exactly; the nibbles
    # are chosen against the rounded pair.
    low, high = w.amin(dim=-1).half().float(), w.amax(dim=-1)
    scale = ((high - low) / 15).half().float()
    # A constant group (or one whose range is below float16's smallest step) is its minimum.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - low[..., None]) / divisor[..., None]).clamp(0, 15)
    q = torch.where(scale[..., None] > 0, q, torch.zeros_like(q)).to(torch.uint8)
    return Int4Weight(q.view(out, k), scale, low + 8 * scale, group_size)
