"""What the model code needs from a Hugging Face ``config.json``:
``ModelConfig``, and ``ModelConfig.from_hf_config`` which reads each
supported family's fields into it (refusing, by field, what no family here
computes)."""

from __future__ import annotations

from typing import Any

import attrs

from trioserve.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
# config.json's model_type, for a config without ``architectures`` (a GGUF's).
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# config.json's model_type -> how its mixture of experts routes (models/moe.py).
MOE_MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# MLP activations: SwiGLU's SiLU, and GeGLU's tanh-approximated GELU (Gemma).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# transformers' GptOssConfig defaults where a config.json leaves rotary out:
# a 150k base, yarn from a 4096-token context without truncating its ramp.
GPT_OSS_ROPE_THETA = 150000.0
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _required(hf: dict[str, Any], key: str, source: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ModelLoadError(f"{source}: required field {key!r} is missing")
    return hf[key]


@attrs.frozen
class RopeScaling:
    """RoPE frequency scaling, as in transformers' ``rope_type`` values."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn and longrope: the context the model was pretrained on
    original_max_position_embeddings: int = 8192
    # yarn and longrope: scales cos and sin (None: derived from factor)
    attention_factor: float | None = None
    # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope only: per-frequency divisors up to and past the original context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@attrs.frozen
class Rope:
    """One rotary embedding: its base and scaling."""

    theta: float
    scaling: RopeScaling = RopeScaling()


@attrs.frozen
class ModelConfig:
    """The architecture of a decoder: Llama, Mistral, Qwen2, Qwen3, Gemma 2
    and 3, Phi-3 / Phi-4-mini, SmolLM3, and the mixtures of experts
    Qwen3-MoE, Mixtral and gpt-oss. Fields past ``sliding_window`` are what a
    family changes of the Llama layer; their defaults are Llama's."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Keys a sliding-window layer attends to: the last ``sliding_window``
    # positions (the query's own included). Which layers slide: ``layer_types``.
    sliding_window: int | None = None
    # Per layer, FULL_ATTENTION or SLIDING_ATTENTION; empty: every layer
    # slides when ``sliding_window`` is set, else none does.
    layer_types: tuple[str, ...] = ()
    # The rotary embedding of sliding layers where it is not the full
    # layers' (Gemma 3: a 10k base, unscaled).
    sliding_rope: Rope | None = None
    # Per layer, whether it applies rotary at all (SmolLM3's NoPE layers); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # The leading fraction of a head's dimensions that rotary turns (Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"  # the MLP's gate activation
    o_bias: bool = False  # o_proj carries a bias (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    # Gemma: norms multiply by 1 + weight (loaded as weight + offset).
    norm_weight_offset: float = 0.0
    # Gemma: embeddings scaled by sqrt(hidden_size), rounded to the model's dtype.
    embedding_multiplier: float = 1.0
    # Gemma 2 and 3: norms after attention and MLP too, and one before the MLP.
    sandwich_norms: bool = False
    # Attention scores scaled by this (None: head_dim ** -0.5; Gemma's query_pre_attn_scalar).
    attention_scale: float | None = None
    # Gemma 2: ``c * tanh(x / c)`` on attention scores and on the final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss: each attention head has a learned sink logit that joins its
    # softmax and draws weight from the keys (``paged_attention``'s ``sinks``).
    attention_sinks: bool = False
    # Mixture of experts (``moe_fields``): the layers in ``moe_layers`` run a
    # sparse block of ``num_experts`` experts of ``moe_intermediate_size``,
    # ``num_experts_per_tok`` per token, routed as ``moe_routing`` says.
    moe_routing: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_layers: tuple[int, ...] = ()

    @property
    def max_context_len(self) -> int:
        """The longest context this engine computes exactly."""
        return self.max_position_embeddings

    @property
    def attn_scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of a head rotary turns (even)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> Rope | None:
        """Layer ``layer``'s rotary embedding; None where it applies none."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        if self.sliding_rope is not None and self.layer_window(layer) is not None:
            return self.sliding_rope
        return Rope(self.rope_theta, self.rope_scaling)

    def rope_tables(self) -> list[Rope]:
        """The distinct rotary embeddings the layers use, in order of first use."""
        tables: list[Rope] = []
        for i in range(self.num_hidden_layers):
            rope = self.layer_rope(i)
            if rope is not None and rope not in tables:
                tables.append(rope)
        return tables

    @property
    def plain_attention(self) -> bool:
        """Whether every layer attends as Llama's does: the whole context,
        full rotary from one table, the default scale, no soft-capping."""
        return (
            all(self.layer_window(i) is None for i in range(self.num_hidden_layers))
            and not self.rope_layers
            and self.partial_rotary_factor == 1.0
            and self.attention_scale is None
            and self.attn_logit_softcapping is None
            and not self.attention_sinks
        )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4's field names
        or 5's); raise ``ModelLoadError`` naming ``source`` and the field for
        anything missing or unsupported."""
        arch = _architecture(hf, source)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(
                f"{source}: unsupported hidden_act {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if hf.get("mlp_bias"):
            # Llama's config allows biases on gate/up/down; the model has none
            # to load them into, and would fail later naming a weight.
            raise ModelLoadError(f"{source}: unsupported mlp_bias=true (field 'mlp_bias'); MLP projections carry no bias")
        hidden = int(_required(hf, "hidden_size", source))
        heads = int(_required(hf, "num_attention_heads", source))
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = int(hf.get("head_dim") or hidden // heads)
        layers = int(_required(hf, "num_hidden_layers", source))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        gpt_oss = arch == "GptOssForCausalLM"
        window, layer_types = _windows(hf, arch, layers, source)
        full_rope, sliding_rope = _ropes(hf, arch, source)
        rope_params = hf.get("rope_parameters") or {}
        partial = hf.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
        if not 0.0 < float(partial) <= 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
        # transformers' default: Qwen2's q/k/v always carry one, gpt-oss's by default.
        bias = bool(hf.get("attention_bias", arch in ("Qwen2ForCausalLM", "GptOssForCausalLM")))
        scalar = hf.get("query_pre_attn_scalar") if gemma else None
        return cls(
            architecture=arch,
            vocab_size=int(_required(hf, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_required(hf, "intermediate_size", source)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=full_rope.theta,
            rope_scaling=full_rope.scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            attention_bias=bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_types=layer_types,
            sliding_rope=sliding_rope if sliding_rope != full_rope else None,
            rope_layers=_rope_layers(hf, arch, layers),
            partial_rotary_factor=float(partial),
            hidden_act=act,
            # Llama's and gpt-oss's attention_bias covers o_proj too; Qwen2's q/k/v only.
            o_bias=bias and arch in ("LlamaForCausalLM", "GptOssForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            norm_weight_offset=1.0 if gemma else 0.0,
            embedding_multiplier=hidden**0.5 if gemma else 1.0,
            sandwich_norms=gemma,
            attention_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_logit_softcapping=_optional_float(hf, "attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=_optional_float(hf, "final_logit_softcapping") if gemma else None,
            attention_sinks=gpt_oss,
            **moe_fields(hf, source=source),
        )


def _first(hf: dict[str, Any], keys: tuple[str, ...], source: str) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ModelLoadError(f"{source}: required field {keys[0]!r} is missing")


def moe_fields(hf: dict[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The experts of a Qwen3-MoE, Mixtral or gpt-oss config.json as
    ``ModelConfig``'s fields: ``moe_routing``, ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size`` (an expert's),
    ``norm_topk_prob``, ``swiglu_alpha``, ``swiglu_limit`` and ``moe_layers``
    (the indices of the layers whose MLP is the sparse block; the others are
    dense, of ``intermediate_size``). Empty for any other ``model_type``."""
    routing = MOE_MODEL_TYPES.get(hf.get("model_type", ""))
    if routing is None:
        return {}
    layers = int(_first(hf, ("num_hidden_layers",), source))
    # transformers writes Qwen3-MoE's num_experts as num_local_experts
    # (its attribute map); the Hub's config.json says num_experts.
    experts = int(_first(hf, ("num_experts", "num_local_experts"), source))
    top_k = int(_first(hf, ("num_experts_per_tok", "experts_per_token"), source))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok {top_k} must be in 1..{experts} (the experts)")
    if routing == "qwen3_moe":
        inter = int(_first(hf, ("moe_intermediate_size",), source))
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        # transformers' Qwen3MoeDecoderLayer's rule.
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:
        inter = int(_first(hf, ("intermediate_size",), source))
        moe_layers = tuple(range(layers))
    return {
        "moe_routing": routing,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)) if routing == "qwen3_moe" else routing == "mixtral",
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "moe_layers": moe_layers,
    }


def _optional_float(hf: dict[str, Any], key: str) -> float | None:
    value = hf.get(key)
    return None if value is None else float(value)


def _architecture(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs and model_type in ARCHITECTURE_BY_MODEL_TYPE:
        arch = ARCHITECTURE_BY_MODEL_TYPE[model_type]
    if arch is None:
        found = ", ".join(archs) or f"model_type={model_type!r}"
        raise ModelLoadError(
            f"{source}: unsupported architecture {found} (field 'architectures'); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _windows(hf: dict[str, Any], arch: str, layers: int, source: str) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and which layers use it, from transformers 5's
    ``layer_types`` where the config has them, else from each family's own
    fields as transformers 4 read them."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        if arch == "LlamaForCausalLM" or window is None:
            return None, ()
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM"):
            if not hf.get("use_sliding_window", False):
                return None, ()
            first = int(hf.get("max_window_layers", 0) or 0)
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
        elif arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
            # Sliding first, then alternating (transformers' default for both).
            types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = int(hf.get("sliding_window_pattern", 6))
            types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
        else:  # Mistral, Phi-3: every layer
            types = [SLIDING_ATTENTION] * layers
    types = tuple(types)
    if len(types) != layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ModelLoadError(
            f"{source}: layer_types must name {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each of "
            f"the {layers} layers, got {list(types)!r}"
        )
    if SLIDING_ATTENTION not in types or window is None:
        return None, ()
    if int(window) < 1:
        raise ModelLoadError(f"{source}: sliding_window must be at least 1, got {window!r}")
    return int(window), types


def _rope_layers(hf: dict[str, Any], arch: str, layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers with rotary (its ``no_rope_layers`` holds 1 where a layer uses it)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    flags = tuple(bool(f) for f in flags)
    return () if all(flags) else flags


def _ropes(hf: dict[str, Any], arch: str, source: str) -> tuple[Rope, Rope]:
    """The full layers' rotary embedding and the sliding layers'."""
    params = dict(hf.get("rope_parameters") or {})
    theta = GPT_OSS_ROPE_THETA if arch == "GptOssForCausalLM" else 10000.0
    if arch == "GptOssForCausalLM" and not params and hf.get("rope_scaling") is None:
        # transformers' GptOssConfig fills in its yarn where the file says
        # nothing, but 4 read an explicit null rope_scaling (with no
        # rope_parameters, 5's field) as no scaling.
        if "rope_parameters" in hf or "rope_scaling" not in hf:
            params = dict(GPT_OSS_ROPE)
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:  # transformers 5, per layer type
        full = _rope(dict(params.get(FULL_ATTENTION) or {}), hf, source, theta)
        if SLIDING_ATTENTION not in params:
            return full, full
        return full, _rope(dict(params[SLIDING_ATTENTION] or {}), hf, source, theta)
    # transformers 4 kept the scaling apart; 5 folds it into rope_parameters.
    merged = {**params, **dict(hf.get("rope_scaling") or {})}
    full = _rope(merged, hf, source, theta)
    local = hf.get("rope_local_base_freq")
    if arch == "Gemma3ForCausalLM" and local is not None:
        return full, Rope(float(local))
    return full, full


def _rope(d: dict[str, Any], hf: dict[str, Any], source: str, default_theta: float) -> Rope:
    theta = float(d.get("rope_theta", hf.get("rope_theta") or default_theta))
    rope_type = d.get("rope_type", d.get("type", "default"))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope_scaling type {rope_type!r} (field 'rope_scaling'); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    original = d.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    factor = d.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and original:
        factor = int(hf.get("max_position_embeddings", original)) / int(original)
    attention_factor = d.get("attention_factor")
    return Rope(
        theta,
        RopeScaling(
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original or 8192),
            attention_factor=None if attention_factor is None else float(attention_factor),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            truncate=bool(d.get("truncate", True)),
            short_factor=tuple(float(f) for f in d.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in d.get("long_factor") or ()),
        ),
    )
