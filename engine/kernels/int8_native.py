"""int8 on the native kernels (``csrc/linear.cpp``, loaded by ``native``),
float32 activations: per channel, ``x @ (q * scale).T`` with the scale
applied once per output after the int8 row's dot product; or in groups of
32 (GGUF's Q8_0), which a tied LM head runs on the embedding table itself
(on avx2int8 and avx512vnni laid out as Q8_0 lanes blocks, which the
embeddings read too: ``q8_lanes``) and the projections a GGUF stores wider
than 4 bits run on (``quant.load``; on avx512vnni in Q8_0 lanes blocks
too)."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.kernels import native

from trioserve.engine.kernels import q8_lanes
from trioserve.engine.kernels.int4_native import bf16_gemm, call_isa, dequantizes
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.q6k_lanes import Q6KLanes
from trioserve.engine.kernels.rtn import Int8GroupWeight, Int8Weight, quantize_int8

GROUP = 32
_AVX2_INT8, _AVX2 = native.ISAS["avx2int8"], native.ISAS["avx2"]
_NO_STEPS = torch.empty(0)  # Q8_0 lanes blocks hold their steps
_VNNI, _BF16 = native.ISAS["avx512vnni"], native.ISAS["avx512bf16"]


@attrs.frozen
class Int8NativeLinear:
    """``x @ W.T + bias`` with ``W = q * scale``, on one ISA variant of the native kernel."""

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    isa: int
    ops: object  # torch.ops.trioserve, loaded

    @classmethod
    def from_rtn(cls, weight: Int8Weight, bias: torch.Tensor | None, isa: str) -> Int8NativeLinear:
        out, k = weight.q.shape
        # Copies of its own, as for ATen's kernel (int8_pack): a weight read
        # straight out of a file may live in memory the tensor does not own.
        return cls(
            weight.q.contiguous().clone(),
            weight.scale.float().contiguous(),
            bias,
            k,
            out,
            native.ISAS[isa],
            native.ops(),
        )

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if dequantizes(self.isa, x.shape[0]):  # torch's GEMM over the dequantized matrix, as int4_native
            return F.linear(x, self.q.float().mul_(self.scale[:, None]), self.bias)
        y = self.ops.q8_linear(x, self.q, self.scale, self.isa)  # type: ignore[attr-defined]
        return y if self.bias is None else y.add_(self.bias)


@attrs.frozen
class Int8GroupNativeLinear:
    """``x @ W.T + bias`` with ``W = q * scale`` per group of 32, over
    ``weight``'s own tensors (shared, not copied: a tied LM head and the
    embeddings are one table). An avx2int8 LM head, and any avx512vnni
    table, is held as Q8_0 lanes blocks (``in_lanes``); on avx512vnni and
    avx2int8 a file's Q6_K matrix as Q6_K lanes blocks (``q6k``), at its
    width."""

    weight: Int8GroupWeight | Q8Lanes | Q6KLanes
    isa: int
    ops: object  # torch.ops.trioserve, loaded
    int8_panels: bool = False  # as Int4NativeLinear's
    bias: torch.Tensor | None = None
    gemm_from_rows: int | None = None  # as Int4NativeLinear's (choose.BF16_GEMM_FROM_ROWS)

    @classmethod
    def over(
        cls, weight: Int8GroupWeight, isa: str, bias: torch.Tensor | None = None, gemm_from_rows: int | None = None
    ) -> Int8GroupNativeLinear:
        if weight.group_size != GROUP:
            raise ValueError(f"int8 group size {weight.group_size}: the native kernel runs groups of {GROUP}")
        return cls(weight, native.ISAS[isa], native.ops(), bias=bias, gemm_from_rows=gemm_from_rows)

    @classmethod
    def q6k(
        cls, weight: Q6KLanes, isa: str, bias: torch.Tensor | None = None, gemm_from_rows: int | None = None
    ) -> Int8GroupNativeLinear:
        """Over a Q6_K matrix in lanes blocks (avx512vnni's and avx2int8's;
        their decode steps and batch-invariant prompts run
        csrc/q6k_lanes_vnni.h and csrc/q6k_lanes_avx2.h, the same bits)."""
        return cls(weight, native.ISAS[isa], weight.ops, bias=bias, gemm_from_rows=gemm_from_rows)

    def in_lanes(self, head: bool = True) -> Int8GroupNativeLinear:
        """This linear over its table as Q8_0 lanes blocks where the table
        has whole panels of 16 channels and it runs on avx512vnni, whose
        kernels read lanes blocks at every row count (csrc/lanes_vnni.h:
        one contiguous stream a thread, where GGUF's groups are read 16
        channels at once across 16 rows), or on avx2int8 as an LM head
        (``head``: its fused decode step takes a projection's groups as they
        are, csrc/rows_avx2.h); else itself."""
        w = self.weight
        held = self.isa == _VNNI or (self.isa == _AVX2_INT8 and head)
        if not held or not isinstance(w, Int8GroupWeight) or not q8_lanes.fits(w):
            return self
        return attrs.evolve(self, weight=Q8Lanes.of(w, self.ops))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y.add_(self.bias)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Q6KLanes):
            return self._q6k_product(w, x)
        if isinstance(w, Q8Lanes) and self.isa == _AVX2_INT8:
            # int16 activations at any row count: a decode step's bits, and as
            # wide as a prompt's 4-bit calls on AVX2 (int4_native.call_isa).
            return self.ops.q8g_linear(x, w.blocks, _NO_STEPS, _AVX2_INT8)  # type: ignore[attr-defined]
        if self.gemm_from_rows is not None and x.shape[0] >= self.gemm_from_rows and not self.int8_panels:
            g = w.groups() if isinstance(w, Q8Lanes) else w
            return bf16_gemm(x, self.ops.q8g_dequantize_bf16(g.q, g.scale))  # type: ignore[attr-defined]
        if dequantizes(self.isa, x.shape[0]):  # as int4_native
            return F.linear(x, w.dequantize())
        if self.int8_panels:
            isa = self.isa
        elif self.isa in (_AVX2_INT8, _VNNI):
            # A prompt's calls (its logits; a layer's wider projections) keep
            # wider activations at any row count: float32 rows, and from 10
            # rows avx512bf16's bfloat16 panels or avx2's float32 ones. With
            # int8 ones the default model's greedy answer to "What is the
            # capital of France?" left Paris. Decode steps take the int8
            # kernels (decode_head, native_decode).
            isa = _AVX2 if self.isa == _AVX2_INT8 else _BF16
        else:
            isa = call_isa(self.isa, x.shape[0])
        if isinstance(w, Q8Lanes):  # avx512vnni's (csrc/lanes_vnni.h), on isa as for the groups
            return self.ops.q8g_linear(x, w.blocks, _NO_STEPS, isa)  # type: ignore[attr-defined]
        return self.ops.q8g_linear(x, w.q, w.scale, isa)  # type: ignore[attr-defined]

    def _q6k_product(self, w: Q6KLanes, x: torch.Tensor) -> torch.Tensor:
        """As the Q8_0 groups run: int8 activations where asked
        (``int8_panels``: decode steps, batch-invariant prompts); else a
        prompt's float activations, on avx512vnni torch's bfloat16 GEMM from
        ``gemm_from_rows`` and below it avx512bf16's bfloat16 panels, on
        avx2int8 avx2's float32 panels, at any row count."""
        if self.int8_panels or self.isa not in (_VNNI, _AVX2_INT8):
            return w.linear(x, self.isa)
        if self.isa == _AVX2_INT8:
            return w.linear(x, _AVX2)
        if self.gemm_from_rows is not None and x.shape[0] >= self.gemm_from_rows:
            return bf16_gemm(x, w.dequantize_bf16())
        return w.linear(x, _BF16)


def trial(isa: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel on tiny inputs (12 rows, so the AVX-512 panels run too; 72
    inputs, so a tail past the vectors), with its float32 reference."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(12, 72, generator=gen), torch.randn(40, 72, generator=gen), torch.randn(40, generator=gen)
    weight = quantize_int8(w)
    got = Int8NativeLinear.from_rtn(weight, bias, isa)(x)
    return {f"Int8NativeLinear({isa})": (got, F.linear(x, weight.dequantize(), bias))}
