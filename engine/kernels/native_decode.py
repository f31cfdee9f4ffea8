"""A decode step's decoder layers in one native call (``csrc/decode.cpp``).

A batch-invariant model (the default) runs every token here, prompts too,
so a token gets one arithmetic whatever shares its step (``runs``).

At one row, a step on compressed weights spent more time in the ~200 small
torch ops per layer around the matmuls (norms, rotary, the cache write,
gather and attention, the activation) than in the matmuls themselves
(docs/benchmarks.md in git history, "A lean decode step"). Where every projection's
kernel for the batch's row count is a native one, ``NativeDecode`` runs all
layers of a batch of decode rows (or short runs of tokens, as a speculative
step verifies) in a single call; any other batch (prefill, more rows than
the native kernels serve, a cache the op does not take) goes through the
layers in torch as before.

The step's math is the model's decoder layer (engine/models/llama.py's
``DecoderLayer.forward``) written a second time in C++, so it runs only
the layers it was checked against: ``unsupported`` holds a config to
``REQUIREMENTS``, a rule for every ``ModelConfig`` field, and ``build``
refuses a config that breaks one, whose model then runs its layers in
torch. A field a new family adds must be given a rule here (a test checks
that every field has one); a family joins ``ARCHITECTURES`` once
tests/test_native_decode_families.py, which builds a tiny random model of
every supported family and variant, finds the step and the layers agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from trioserve.engine.config import ModelConfig
from trioserve.engine.kernels import native
from trioserve.engine.kernels.int4_native import Int4NativeLinear
from trioserve.engine.kernels.int8_native import Int8GroupNativeLinear, Int8NativeLinear
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.projections import QuantizedProjections

from trioserve.engine.kernels.native_attention import CACHE_DTYPES, MAX_QUERY_TOKENS

NativeLinear = Int4NativeLinear | Int8NativeLinear | Int8GroupNativeLinear

# The families whose decoder layer csrc/decode.cpp computes: pre-norm
# RMSNorm, fused q/k/v (a bias or none), each q and k head's RMSNorm (Qwen3's)
# or none, rotate-half rotary on the model's own cos/sin tables, attention
# over the whole context, o (a bias or none) plus the residual, RMSNorm,
# SwiGLU or routed experts (csrc/moe_step.h), down plus the residual.
ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
     "MixtralForCausalLM"}
)  # fmt: skip
# The mixtures' routings the step computes (engine/models/moe.py's ROUTINGS):
# softmax over every expert, top k, renormalised where the config says.
# gpt-oss's (the top k of biased logits, then their softmax; biased experts
# with gate and up interleaved and a clamped SwiGLU) runs in torch.
MOE_ROUTINGS = frozenset({"qwen3_moe", "mixtral"})
# The rotary scalings checked: each only changes the tables the model
# computes (engine/layers/rotary.py) and passes in.
ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def _any(value: object) -> bool:
    return True


# Every ModelConfig field: what the fused step needs of its value, and why.
# A size or a field outside the decoder layers takes any value.
REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "architecture": (
        ARCHITECTURES.__contains__, f"a family whose layer the step computes ({', '.join(sorted(ARCHITECTURES))})"
    ),
    "vocab_size": (_any, "outside the layers"),
    "hidden_size": (_any, "a size"),
    "intermediate_size": (_any, "a size"),
    "num_hidden_layers": (_any, "a size"),
    "num_attention_heads": (_any, "a size"),
    "num_key_value_heads": (_any, "a size: heads share KV heads in groups (GQA, MQA)"),
    "head_dim": (lambda v: v % 2 == 0, "an even head_dim: rotate-half pairs a head's halves"),
    "max_position_embeddings": (_any, "outside the layers (the rotary tables' length)"),
    "rms_norm_eps": (_any, "a constant of the norms"),
    "rope_theta": (_any, "in the rotary tables the model passes in"),
    "rope_scaling": (lambda v: v.rope_type in ROPE_TYPES, f"a rotary scaling of {', '.join(sorted(ROPE_TYPES))}"),
    "tie_word_embeddings": (_any, "outside the layers"),
    "attention_bias": (_any, "biases of q/k/v and o are added to the linears' outputs, as the layer does"),
    "bos_token_id": (_any, "outside the layers"),
    "eos_token_ids": (_any, "outside the layers"),
    "sliding_window": (lambda v: v is None, "attention over the whole context, no sliding window"),
    "layer_types": (_any, "which layers slide: only with a sliding_window, which has its own rule"),
    "sliding_rope": (lambda v: v is None, "one rotary table for every layer"),
    "rope_layers": (lambda v: v == (), "rotary in every layer"),
    "partial_rotary_factor": (lambda v: v == 1.0, "rotary over the whole head"),
    "hidden_act": (lambda v: v == "silu", "SwiGLU's SiLU"),
    "o_bias": (_any, "o's bias is added to the linear's output, as the layer does"),
    "qk_norm": (_any, "each q and k head's RMSNorm before rotary (Qwen3's), or none, as the layer does"),
    "norm_weight_offset": (_any, "folded into the norms' weights at load"),
    "embedding_multiplier": (_any, "outside the layers"),
    "sandwich_norms": (lambda v: not v, "pre-norm blocks only"),
    "attention_scale": (lambda v: v is None, "scores scaled by head_dim ** -0.5"),
    "attn_logit_softcapping": (lambda v: v is None, "no soft-capping of attention scores"),
    "final_logit_softcapping": (_any, "outside the layers"),
    "attention_sinks": (lambda v: not v, "no attention sinks (gpt-oss's per-head extra softmax logit)"),
    "moe_routing": (
        lambda v: v is None or v in MOE_ROUTINGS,
        f"a dense MLP, or experts routed as {', '.join(sorted(MOE_ROUTINGS))} route them (gpt-oss's runs in torch)",
    ),
    "num_experts": (_any, "a size"),
    "num_experts_per_tok": (_any, "a size"),
    "moe_intermediate_size": (_any, "a size"),
    "norm_topk_prob": (_any, "the top k's weights renormalised or not, as the layer does"),
    "swiglu_alpha": (_any, "gpt-oss's only, whose routing has its own rule"),
    "swiglu_limit": (_any, "gpt-oss's only, whose routing has its own rule"),
    "moe_layers": (_any, "which layers' MLP is experts: each layer's own weights say"),
}


def unsupported(config: ModelConfig) -> list[str]:
    """What of ``config``'s decoder layer the fused step does not compute, in
    words; empty where it computes the layer as the model does. A field
    without a rule in ``REQUIREMENTS`` is not supported."""
    found = []
    for field in attrs.fields(ModelConfig):
        value = getattr(config, field.name)
        rule = REQUIREMENTS.get(field.name)
        if rule is None:
            found.append(f"{field.name}={value!r}: a field native_decode.REQUIREMENTS has no rule for")
        elif not rule[0](value):
            found.append(f"{field.name}={value!r}: the fused step needs {rule[1]}")
    return found


_EMPTY = torch.empty(0)
_INT8_HEADS = frozenset({native.ISAS["avx512vnni"], native.ISAS["avx2int8"]})


def _native(linear: object) -> NativeLinear | None:
    """The linear where it runs on a native kernel; None where it does not."""
    if isinstance(linear, Int4NativeLinear | Int8NativeLinear | Int8GroupNativeLinear):
        return linear
    return None


def _parts(linear: NativeLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and scale csrc/decode.cpp takes: 4-bit blocks (or lanes
    blocks) and no scale, Q8_0 lanes blocks and no scale (avx512vnni's:
    csrc/lanes_vnni.h), or int8 and its scales per channel ``[out]`` or per
    group ``[out, in / 32]``."""
    if isinstance(linear, Int4NativeLinear):
        return linear.blocks, _EMPTY
    if isinstance(linear, Int8GroupNativeLinear):
        w = linear.weight
        return (w.blocks, _EMPTY) if isinstance(w, Q8Lanes) else (w.q, w.scale)
    return linear.q, linear.scale


def _experts(experts: Any) -> tuple[list[torch.Tensor], set[int]] | None:
    """A mixture's layer's MLP in csrc/decode.cpp's terms (its float router,
    routing, and each expert's native linears: csrc/moe_step.h) and the
    experts' variants; None where its routing is not one the step computes,
    its router is not a plain float matrix, or an expert has no native
    kernel or carries a bias. ``experts`` is engine/models/moe.py's
    ``GroupedExperts`` (by its fields: the kernels import no model)."""
    router = getattr(experts.router, "weight", None)
    if experts.routing not in MOE_ROUTINGS or router is None or experts.router.bias is not None:
        return None
    renormalise = experts.routing == "mixtral" or experts.norm_topk_prob
    weights = [_EMPTY] * 4 + [
        router.detach().float().contiguous(), torch.tensor([experts.top_k, int(renormalise)], dtype=torch.int64)
    ]
    isas = set()
    for expert in experts.experts:
        found = [_native(expert.gate_up), _native(expert.down)]
        if any(f is None or f.bias is not None for f in found):
            return None
        isas |= {f.isa for f in found}  # type: ignore[union-attr]
        weights += [*_parts(found[0]), *_parts(found[1])]  # type: ignore[arg-type]
    return weights, isas


@attrs.frozen
class NativeDecode:
    """All decoder layers of a batch of decode rows (and, batch-invariant, prompts), natively."""

    weights: tuple[torch.Tensor, ...]  # csrc/decode.cpp's 16 per layer, and a mixture's experts' after them
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
        config: ModelConfig | None = None,
        head_norms: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> NativeDecode | None:
        """The fused step over these layers, or None where a projection has
        no native kernel, an MLP projection has a bias, or ``config`` (the
        model's) has a layer feature the step lacks (``unsupported``).
        ``head_norms``: each layer's q and k head norm weights (Qwen3's), or
        None for a layer without. A mixture's layer (llama.py's
        ``ExpertProjections``: its ``attention`` and ``experts``) runs its
        routed experts in the step where ``_experts`` takes them."""
        if config is not None and unsupported(config):
            return None
        weights: list[torch.Tensor] = []
        isas = set()
        norms = [None] * len(projections) if head_norms is None else head_norms
        for layer, input_norm, post_norm, qk in zip(projections, input_norms, post_norms, norms, strict=True):
            experts = getattr(layer, "experts", None)
            parts = ("qkv", "o") if experts is not None else ("qkv", "o", "gate_up", "down")
            attention = getattr(layer, "attention", layer)
            found = [_native(getattr(attention, f"{part}_linear")) for part in parts]
            if any(f is None for f in found) or any(f.bias is not None for f in found[2:]):  # type: ignore[union-attr]
                return None
            qkv, o = found[:2]
            isas |= {f.isa for f in found}  # type: ignore[union-attr]
            q_norm, k_norm = (_EMPTY, _EMPTY) if qk is None else (_float(qk[0]), _float(qk[1]))
            weights += [_float(input_norm), *_parts(qkv), _bias(qkv), q_norm, k_norm]
            weights += [*_parts(o), _bias(o), _float(post_norm)]
            if experts is None:
                weights += [*_parts(found[2]), *_parts(found[3]), _EMPTY, _EMPTY]  # type: ignore[arg-type]
                continue
            mixture = _experts(experts)
            if mixture is None:
                return None
            weights += mixture[0]
            isas |= mixture[1]
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


def _float(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().contiguous()


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
    csrc/lanes_avx2.h at every row count, a Q8_0 one csrc/q8_lanes_avx2.h;
    on avx512vnni a head in lanes blocks, 4-bit or Q8_0, runs
    csrc/lanes_vnni.h at every row count, with the panels' bits; a head
    the file stores as Q6_K, held as Q6_K lanes blocks, runs
    csrc/q6k_lanes_vnni.h or csrc/q6k_lanes_avx2.h on int8 activations at
    every row count, with the same bits on both);
    else None (``head`` itself serves). A batch-invariant model takes it
    for a prompt's logits too; outside that mode a prompt's logits keep ``head``:
    float32 activations, from 10 rows in bfloat16 panels, or on AVX2 panels
    on float32 activations (Q8_0) or int16 ones (4-bit;
    ``int4_native.call_isa``; a Q8_0 head in lanes blocks: int16 at any row
    count)."""
    if isinstance(head, Int4NativeLinear | Int8GroupNativeLinear) and head.isa in _INT8_HEADS:
        return attrs.evolve(head, int8_panels=True)
    return None
