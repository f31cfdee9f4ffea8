"""MXFP4 weights (gpt-oss's experts) held exactly as int8 groups of 32.

MXFP4 (OCP microscaling) stores a group of 32 weights as 4-bit e2m1 values
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with a sign, and one e8m0 scale ``2^(e - 127)``
a group. Twice an e2m1 value is an integer ``{0, 1, 2, 3, 4, 6, 8, 12}``, so a
group is exactly an ``Int8GroupWeight`` group with those integers and the
scale halved, ``2^(e - 128)`` (as llama.cpp holds it: ``kvalues_mxfp4`` and
``ggml_e8m0_to_fp32_half``): the native Q8_0 kernel then runs the file's
values without a rounding, in as many bytes as Q8_0.

Two layouts: a Hugging Face checkpoint's ``*_blocks`` (uint8 ``[out, in / 32,
16]``, a byte's low nibble the even value, its high nibble the odd one) and
``*_scales`` (uint8 ``[out, in / 32]``), as transformers'
``integrations/mxfp4.py`` reads them; and GGUF's MXFP4 rows (17-byte blocks:
the scale byte, then 16 bytes whose low nibbles are the first 16 values and
high nibbles the last 16, as Q4_0's).
"""

from __future__ import annotations

import numpy as np
import torch

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels.rtn import Int8GroupWeight

GROUP = 32
GGUF_BLOCK_BYTES = 1 + GROUP // 2
# Twice the e2m1 value of each code 0..15 (bit 3 the sign).
DOUBLED_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# e8m0's 0xFF is not a number (OCP MX spec); a file holding it is damaged.
_NAN_SCALE = 255


def half_scales(exponents: torch.Tensor, name: str) -> torch.Tensor:
    """Float32 ``2^(e - 128)`` of uint8 e8m0 ``exponents``, exactly: built
    from the bits (the smallest, ``2^-128`` and ``2^-127``, are subnormal);
    ``ModelLoadError`` naming tensor ``name`` for a scale that is NaN."""
    e = exponents.to(torch.int32)
    if bool((e == _NAN_SCALE).any()):
        raise ModelLoadError(f"tensor {name!r}: an MXFP4 scale is 0xFF, which e8m0 reserves for NaN: the file is damaged")
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _doubled(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(DOUBLED_VALUES, dtype=torch.int8)[codes.long()]


def decode_hf(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> Int8GroupWeight:
    """One matrix of a checkpoint's MXFP4 pair (``blocks`` uint8 ``[out,
    in / 32, 16]``, ``scales`` uint8 ``[out, in / 32]``; one expert's slice of
    the ``[experts, ...]`` tensors) as ``[out, in]`` int8 groups of 32;
    ``name`` is the tensor's, for errors."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"tensor {name!r}: MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 3 or blocks.shape[2] != GROUP // 2 or tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ModelLoadError(
            f"tensor {name!r}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
            f"[out, groups, {GROUP // 2}] and [out, groups]"
        )
    out, groups, _ = blocks.shape
    # Low nibble first: values 2j and 2j + 1 of a group share byte j.
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)
    q = _doubled(codes).reshape(out, groups * GROUP)
    return Int8GroupWeight(q, half_scales(scales, name), GROUP)


def decode_gguf(data: np.ndarray, name: str) -> Int8GroupWeight:
    """GGUF MXFP4 rows (uint8 ``[out, groups * 17]``) as ``[out, in]`` int8 groups of 32."""
    out = data.shape[0]
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % GGUF_BLOCK_BYTES:
        raise ModelLoadError(f"tensor {name!r}: {data.dtype} {data.shape} is not rows of {GGUF_BLOCK_BYTES}-byte MXFP4 blocks")
    # A copy: a GGUF's rows are a read-only map of the file, which torch will not wrap.
    blocks = torch.from_numpy(np.array(data, copy=True)).view(out, -1, GGUF_BLOCK_BYTES)
    qs = blocks[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # the first 16 values, then the last 16
    return Int8GroupWeight(_doubled(codes).reshape(out, -1), half_scales(blocks[..., 0], name), GROUP)
