"""Whether a model gives a request's tokens the same bits whatever shares
its steps (batch mates, the prefix cache, chunking, preemption,
speculation), and why: docs/architecture.md, "Same request, same answer".
Each path's answer is a rule about the kernels it runs, not a measurement;
tests/test_invariance.py checks the paths said to be invariant."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trioserve.engine.kernels.capability import dtype_name


@attrs.frozen
class Invariance:
    """Whether a request's tokens and logprobs are independent of what
    shares its steps (batch mates, the prefix cache, chunking, preemption,
    speculation), and why: shown in the load log and ``/version``."""

    invariant: bool
    reason: str

    def as_json(self) -> dict[str, object]:
        return {"invariant": self.invariant, "reason": self.reason}

    def __str__(self) -> str:
        return f"{'batch-invariant' if self.invariant else 'NOT batch-invariant'}: {self.reason}"


def on_device(device: torch.device) -> Invariance:
    """A model on an accelerator."""
    return Invariance(
        False,
        f"on {device.type}, torch's GEMMs and attention choose their kernels and reduction splits "
        "by the batch's shape (docs/architecture.md, \"Same request, same answer\")",
    )


def compressed_on_cpu(isa: str | None, batch_invariant: bool, unsupported: Sequence[str] = ()) -> Invariance:
    """Compressed projections on CPU; ``isa`` is the fused native step's
    variant, None where the projections or LM head run outside it, which
    ``unsupported`` (what of the model the step does not compute) may say why."""
    if isa is None:
        if unsupported:
            return Invariance(False, f"the layers run in torch: the fused native step does not compute {'; '.join(unsupported)}")
        return Invariance(
            False,
            "the projections or LM head run outside the fused native step (no native build, "
            "or a kernel whose arithmetic changes with the row count)",
        )
    if not batch_invariant:
        return Invariance(
            False,
            f"--no-batch-invariant: prompts run the layers in torch on wider activations, decode steps the "
            f"fused native step ({isa}, int8 activations), so a token's bits depend on which computed it",
        )
    return Invariance(
        True,
        f"every token (prompts, decode steps, verification) runs the fused native step ({isa}): "
        "activations rounded per row in groups of 32, integer products, sums in a fixed order, "
        "attention per token over its own context",
    )


def float_on_cpu(dtype: torch.dtype, *, packed: bool, native_attention: bool) -> Invariance:
    """Float projections on CPU: oneDNN's packed float32 GEMM gives a row
    the same bits at every row count from two (``onednn.MIN_ROWS``), MKL's
    ``F.linear`` does not (its kernel and blocking follow the row count);
    bfloat16 and float16 models are not checked."""
    if not packed:
        return Invariance(
            False,
            f"{dtype_name(dtype)} projections on F.linear (MKL), whose kernel and blocking follow the "
            "row count (float32 on oneDNN's packed GEMM, or compressed weights on the native kernels, are invariant)",
        )
    if dtype != torch.float32:
        return Invariance(
            False,
            f"{dtype_name(dtype)} projections on oneDNN's packed GEMM: not checked for invariance "
            "(float32 is, and compressed weights on the native kernels)",
        )
    if not native_attention:
        return Invariance(False, "attention runs in torch, whose kernels follow the batch's shape (no native build)")
    return Invariance(
        True,
        "float32 projections on oneDNN's packed GEMM, whose rows keep their bits at every row count; "
        "attention per token over its own context (native); the rest a row at a time",
    )


def lora_invariance(base: Invariance, *, compressed: bool) -> Invariance:
    """``base`` as an engine serving LoRA adapters runs the model: every
    batch runs the layers in torch (engine/lora), so compressed weights
    leave the fused native step; float weights keep their path, and the
    adapters' deltas are computed a row at a time in a fixed order."""
    if not compressed:
        return base
    return Invariance(
        False,
        "LoRA (--enable-lora): the layers run in torch, not the fused native step, on compressed "
        "kernels whose arithmetic follows the row count",
    )
