"""A decode step's decoder layers in one native call (``csrc/decode.cpp``).

A batch-invariant model (the default) runs every token here, prompts too,
so a token gets one arithmetic whatever shares its step (``runs``).

At one row, a step on compressed weights spent more time in the ~200 small
torch ops per layer around the matmuls (norms, rotary, the cache write,
gather and attention, the activation) than in the matmuls themselves
(docs/benchmarks.md, "A lean decode step"). Where every projection's
kernel for the batch's row count is a native one, ``NativeDecode`` runs all
layers of a batch of decode rows (or short runs of tokens, as a speculative
step verifies) in a single call; any other batch (prefill, more rows than
the native kernels serve, a cache the op does not take) goes through the
layers in torch as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trioserve.engine.kernels import native
from trioserve.engine.kernels.int4_native import Int4NativeLinear
from trioserve.engine.kernels.int8_native import Int8GroupNativeLinear, Int8NativeLinear
from trioserve.engine.kernels.projections import QuantizedProjections

from trioserve.engine.kernels.native_attention import CACHE_DTYPES, MAX_QUERY_TOKENS
NativeLinear = Int4NativeLinear | Int8NativeLinear | Int8GroupNativeLinear
_EMPTY = torch.empty(0)
_INT8_HEADS = frozenset({native.ISAS["avx512vnni"], native.ISAS["avx2int8"]})


def _native(linear: object) -> NativeLinear | None:
    """The linear where it runs on a native kernel; None where it does not."""
    if isinstance(linear, Int4NativeLinear | Int8NativeLinear | Int8GroupNativeLinear):
        return linear
    return None


def _parts(linear: NativeLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and scale csrc/decode.cpp takes: 4-bit blocks and no scale,
    or int8 and its scales per channel ``[out]`` or per group ``[out, in / 32]``."""
    if isinstance(linear, Int4NativeLinear):
        return linear.blocks, _EMPTY
    if isinstance(linear, Int8GroupNativeLinear):
        return linear.weight.q, linear.weight.scale
    return linear.q, linear.scale


@attrs.frozen
class NativeDecode:
    """All decoder layers of a batch of decode rows (and, batch-invariant, prompts), natively."""

    weights: tuple[torch.Tensor, ...]  # csrc/decode.cpp's 12 per layer
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    isa: int
    op: object

    @classmethod
    def build(
        cls,
        projections: Sequence[QuantizedProjections],
        input_norms: Sequence[torch.Tensor],
        post_norms: Sequence[torch.Tensor],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> NativeDecode | None:
        """The fused step over these layers, or None where a projection has no native kernel."""
        weights: list[torch.Tensor] = []
        isas = set()
        for layer, input_norm, post_norm in zip(projections, input_norms, post_norms, strict=True):
            found = [_native(getattr(layer, f"{part}_linear")) for part in ("qkv", "o", "gate_up", "down")]
            if any(f is None for f in found) or any(f.bias is not None for f in found[2:]):  # type: ignore[union-attr]
                return None
            qkv, o, gate_up, down = found
            isas |= {f.isa for f in found}  # type: ignore[union-attr]
            weights += [input_norm.detach().float().contiguous(), *_parts(qkv), _bias(qkv)]
            weights += [*_parts(o), _bias(o), post_norm.detach().float().contiguous(), *_parts(gate_up), *_parts(down)]
        if len(isas) != 1:
            return None
        return cls(
            tuple(weights), num_heads, num_kv_heads, eps, head_dim**-0.5, isas.pop(),
            native.ops().decode_layers,  # type: ignore[attr-defined]
        )

    def runs(self, query_lens: Sequence[int], cache_dtype: torch.dtype, *, prompts: bool = False) -> bool:
        """Whether a batch of these query lengths, over a cache of
        ``cache_dtype``, runs here: decode rows or short runs of tokens such
        as a speculative step's verification; with ``prompts``, runs of any
        length too (a batch-invariant model computes every token here, so a
        prompt's tokens get the arithmetic of a decode step's:
        docs/architecture.md, "Same request, same answer")."""
        return (
            cache_dtype in CACHE_DTYPES
            and (prompts or all(n <= MAX_QUERY_TOKENS for n in query_lens))
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The residual stream after every layer, for ``hidden`` ``[tokens,
        hidden]``; writes each layer's key and value. ``block_tables`` and
        ``context_lens`` are per token (``native_attention.token_rows``)."""
        rows = hidden.shape[0]
        return self.op(  # type: ignore[operator]
            hidden.contiguous(),
            list(self.weights),
            key_cache,
            value_cache,
            cos.reshape(rows, -1).contiguous(),
            sin.reshape(rows, -1).contiguous(),
            slots,
            block_tables,
            context_lens,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.isa,
        )


def _bias(linear: NativeLinear) -> torch.Tensor:
    return _EMPTY if linear.bias is None else linear.bias.float().contiguous()


def decode_head(head: object) -> object | None:
    """The LM head for a decode step's logits: ``head`` on rounded
    activations at any batch size, where it is a native 4-bit or Q8_0
    linear on a variant that has them: avx512vnni's int8 panels
    (csrc/panel_vnni.h; 6 against 9 ms at 32 rows in bfloat16 panels) and,
    up to 8 rows, its row kernels with the panels' bits (csrc/rows_vnni.h);
    avx2int8's int8 activations for a 4-bit head and int16 ones for a Q8_0
    head, in panels from 10 rows and below them row kernels with the
    panels' bits (csrc/rows_avx2.h; a 4-bit head held as lanes blocks runs
    csrc/lanes_avx2.h at every row count, a Q8_0 one csrc/q8_lanes_avx2.h);
    else None (``head`` itself serves). A batch-invariant model takes it
    for a prompt's logits too; outside that mode a prompt's logits keep ``head``:
    float32 activations, from 10 rows in bfloat16 panels, or on AVX2 panels
    on float32 activations (Q8_0) or int16 ones (4-bit;
    ``int4_native.call_isa``; a Q8_0 head in lanes blocks: int16 at any row
    count)."""
    if isinstance(head, Int4NativeLinear | Int8GroupNativeLinear) and head.isa in _INT8_HEADS:
        return attrs.evolve(head, int8_panels=True)
    return None
