"""oneDNN's packed linear ops on CPU, and the trial that shows they work here.

``pack`` reorders a weight once into oneDNN's blocked layout; ``linear`` and
``linear_binary`` multiply by it with an elementwise op fused into the
epilogue. Whether they run depends on the CPU, not only on the dtype: the
bfloat16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so it fails on
an AVX2-only CPU such as AMD Zen 3. ``trial`` runs every op the model uses on
tiny inputs, so ``capability.CpuPaths.detect`` can tell before a model
depends on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The dtypes the model packs (oneDNN also has a float16 path, on AVX-512-FP16
# or AVX-NE-CONVERT CPUs; the model does not use it).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of ``weight`` ``[out, in]``, for any number of rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, post_op: str) -> torch.Tensor:
    """``x @ W.T + bias`` with ``post_op`` ("none", "swish", ...) applied in the matmul's epilogue."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post_op, [], "")


def linear_binary(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, op: str, other: torch.Tensor
) -> torch.Tensor:
    """``(x @ W.T + bias) <op> other`` in one call: ``op`` is "add" or "mul"."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, op)


def trial(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run every packed op the model uses in ``dtype`` on tiny inputs; return
    each result with its float32 reference (the caller compares them).
    Raises whatever the ops raise where they cannot run."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch build has no oneDNN (mkldnn)")
    gen = torch.Generator().manual_seed(0)
    x32, w32, other32 = (torch.randn(shape, generator=gen) for shape in ((4, 64), (32, 64), (4, 32)))
    bias32 = torch.randn(32, generator=gen)
    x, w, other, bias = (t.to(dtype) for t in (x32, w32, other32, bias32))
    packed = pack(w)
    product = F.linear(x.float(), w.float(), bias.float())
    return {
        "packed linear": (linear(x, packed, bias, "none"), product),
        "packed linear+swish": (linear(x, packed, None, "swish"), F.silu(product - bias.float())),
        "packed linear+add": (linear_binary(x, packed, bias, "add", other), product + other.float()),
        "packed linear*mul": (linear_binary(x, packed, None, "mul", other), (product - bias.float()) * other.float()),
    }

