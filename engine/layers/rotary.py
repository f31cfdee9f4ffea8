"""Rotary position embeddings (RoPE), with ``linear``, ``llama3``, ``yarn``
and ``longrope`` scaling, over a head's leading ``rotary_dim`` dimensions.

Uses the "rotate half" layout of Hugging Face checkpoints: the rotated
part's first half of dimensions pairs with its second half.
"""

from __future__ import annotations

import math

import torch

from trioserve.engine.config import ModelConfig, Rope, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, *, long: bool = False) -> torch.Tensor:
    """The ``[head_dim // 2]`` float32 rotation frequencies, scaled as
    ``scaling`` says (``head_dim``: the rotated dimensions). ``long``: for
    longrope, the factors of positions past the original context."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        # Positions divided by factor is the same as frequencies divided by it.
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope needs {head_dim // 2} factors per set, got {len(factors)}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")


def attention_factor(scaling: RopeScaling) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the others)."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    if scaling.rope_type == "yarn":
        return 0.1 * math.log(scaling.factor) + 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones divided by ``factor``, a linear
    ramp between the dimensions that turn ``beta_fast`` and ``beta_slow``
    times over the original context."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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

    def __init__(
        self,
        config: ModelConfig,
        *,
        rope: Rope | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        rope = Rope(config.rope_theta, config.rope_scaling) if rope is None else rope
        self.head_dim = config.head_dim
        self.rotary_dim = dim = config.rotary_dim
        scaling = rope.scaling
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inverse_frequencies(dim, rope.theta, scaling))
        if scaling.rope_type == "longrope":
            # Per position, as vLLM does: a token's rotation depends on its
            # position only, never on how long the rest of its batch is.
            past = positions >= scaling.original_max_position_embeddings
            long = torch.outer(positions, inverse_frequencies(dim, rope.theta, scaling, long=True))
            freqs = torch.where(past[:, None], long, freqs)
        mscale = attention_factor(scaling)
        cos, sin = freqs.cos() * mscale, freqs.sin() * mscale
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
    dim = cos.shape[-1]
    if dim < head_dim:  # partial rotary: the trailing dimensions pass unturned
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), -1)
    swapped = x.reshape(tokens, heads, 2, head_dim // 2).flip(2).view(tokens, heads, head_dim)
    return torch.addcmul(x * cos, swapped, sin)
