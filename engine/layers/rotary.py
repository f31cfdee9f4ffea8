"""Rotary position embeddings (RoPE), with ``linear`` and ``llama3`` scaling.

Uses the "rotate half" layout of Hugging Face checkpoints: a head's first
half of dimensions pairs with its second half.
"""

from __future__ import annotations

import math

import torch

from trioserve.engine.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """The ``[head_dim // 2]`` float32 rotation frequencies, scaled as ``scaling`` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        # Positions divided by factor is the same as frequencies divided by it.
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths are slowed by ``factor``, short
    ones kept, and the band between interpolated smoothly."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for every position up to
    ``max_position_embeddings``; a forward gathers the rows it needs once and
    every layer reuses them.

    The tables are laid out for ``apply_rotary``: cos repeated over both
    halves of a head, sin negated on the first half.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.head_dim = config.head_dim
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # Not saved with the model: it is derived from the config.
        self.register_buffer("cos_table", torch.cat((cos, cos), -1).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_table", torch.cat((-sin, sin), -1).to(dtype=dtype, device=device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sin tables for ``positions``, ready
        to broadcast over heads in ``apply_rotary``."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        return cos, self.sin_table.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``, any strides) by the angles of
    ``RotaryEmbedding.cos_sin``; returns a new contiguous tensor.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``:
    the sign lives in the sin table, so swapping the halves is one ``flip``
    and the whole rotation three ops.
    """
    tokens, heads, head_dim = x.shape
    swapped = x.view(tokens, heads, 2, head_dim // 2).flip(2).view(tokens, heads, head_dim)
    return torch.addcmul(x * cos, swapped, sin)
