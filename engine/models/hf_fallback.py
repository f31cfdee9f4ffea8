"""The transformers fallback: any decoder-only model that transformers has
a causal-LM class for, run by that class over trioserve's paged KV cache.

An architecture without a native family here (``SUPPORTED_ARCHITECTURES``,
engine/models/llama.py) still serves when transformers' own class routes
its attention through transformers' ``AttentionInterface``: we register an
attention function there (``ATTENTION``) that writes each layer's keys and
values into the engine's ``KVCache`` at the step's slots and attends every
sequence over its own cached context with ``paged_attention``. The step's
plan reaches it through the model call's keyword arguments, which
transformers passes down to the attention function, never through a global.
The scheduler, the KV pool and the runner are the native ones, so
continuous batching, prefix caching, preemption, aborts and deadlines hold
as they do natively.

It is slower than a native family (transformers' unfused modules,
``F.linear``, logits through its own head) and runs without what only the
native families have: compressed weights, CUDA graphs, tensor parallelism.
What would make its answer differ from transformers' is refused at load
naming it (``resolve_model_config``, the probe step in ``load_fallback``):
an encoder or bidirectional attention, layers without attention (state
space, recurrent), attention sinks, a mask the model builds itself (ALiBi),
a sliding window in the config that never reaches the attention function.
A sliding window and soft-capped scores that do reach it (its
``sliding_window`` and ``softcap`` keywords) are computed by
``paged_attention``.

transformers is imported only when a fallback model is resolved or built:
a process serving a native model never loads its modelling code.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import attrs
import torch
from torch import nn

from trioserve.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels.capability import CpuPaths, dtype_name
from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.models.invariance import Invariance
from trioserve.engine.models.projections import ProjectionChoice

logger = logging.getLogger(__name__)

# The name our attention function is registered under in transformers'
# AttentionInterface, and the keyword the step's plan travels in.
ATTENTION = "trioserve_paged"
STEP_KWARG = "trioserve_step"
# Attention keywords that change the result in ways paged_attention does not compute.
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks"}
IMPLEMENTATION_NATIVE, IMPLEMENTATION_TRANSFORMERS = "native", "transformers"


def is_fallback(config: ModelConfig) -> bool:
    """Whether ``config`` is run by the transformers fallback (its
    architecture has no native family here)."""
    return config.architecture not in SUPPORTED_ARCHITECTURES


def implementation(config: ModelConfig) -> str:
    """``"native"`` or ``"transformers"``: what runs ``config``'s model, as
    ``/v1/models`` says it."""
    return IMPLEMENTATION_TRANSFORMERS if is_fallback(config) else IMPLEMENTATION_NATIVE


def require_native(config: ModelConfig, feature: str) -> None:
    """Raise ``ModelLoadError`` when ``config`` runs on the fallback, which
    lacks ``feature`` (named in the message)."""
    if is_fallback(config):
        raise ModelLoadError(
            f"{config.architecture} runs on the transformers fallback, which does not support {feature}; "
            f"natively supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def resolve_model_config(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` of a parsed ``config.json``: the native family's
    where its architecture has one, else the transformers fallback's. Raises
    ``ModelLoadError`` naming ``source`` and the field at fault; for an
    architecture that runs neither way, naming it, the native ones and why
    the fallback cannot run it."""
    archs = hf.get("architectures") or []
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return ModelConfig.from_hf_config(hf, source=source)
    if not archs:
        # A config without ``architectures`` (a GGUF's) is native by its model_type, if at all.
        try:
            return ModelConfig.from_hf_config(hf, source=source)
        except ModelLoadError:
            pass
    return fallback_model_config(hf, source=source)


def fallback_model_config(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The fallback's ``ModelConfig`` for ``hf``: what sizes the KV cache and
    the context, read from transformers' own config class. Raises
    ``ModelLoadError`` when transformers cannot run it over the paged cache."""
    config, cls = transformers_config(hf, source=source)
    return _model_config(config, cls.__name__, source)


def transformers_config(hf: dict[str, Any], *, source: str = "config.json") -> tuple[Any, type]:
    """transformers' config object for ``hf`` and the causal-LM class that
    runs it, with everything checked that can be before any weight is read."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    named = ", ".join(archs) or f"model_type={model_type!r}"

    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{source}: unsupported architecture {named} (field 'architectures'); natively supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}; other decoder-only models run on the transformers fallback, "
            f"which needs a transformers causal-LM class whose attention goes through its attention interface, "
            f"but {why}"
        )

    if hf.get("auto_map"):
        raise refuse("this checkpoint's model is custom code (field 'auto_map'), which trioserve does not run")
    if hf.get("is_encoder_decoder"):
        raise refuse("it is an encoder-decoder model (field 'is_encoder_decoder')")
    causal_lm_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs:
        name = next((a for a in archs if a in causal_lm_classes), None)
        if name is None:
            raise refuse(f"transformers {transformers.__version__} has no causal-LM class named {named}")
    else:
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if name is None:
            raise refuse(f"transformers {transformers.__version__} has no causal-LM class for {named}")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise refuse(f"transformers {transformers.__version__} cannot import {name} (a missing dependency?)")
    if not getattr(cls, "_supports_attention_backend", False):
        raise refuse(f"transformers' {name} does not route its attention through the attention interface")
    if model_type is None:
        raise ModelLoadError(f"{source}: required field 'model_type' is missing")
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise refuse(f"transformers cannot read its config: {exc}") from None
    return config, cls


def _model_config(config: Any, architecture: str, source: str) -> ModelConfig:
    """What the engine sizes from ``config`` (a transformers config)."""
    hidden = _size(config, "hidden_size", source)
    heads = _size(config, "num_attention_heads", source)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    max_positions = int(getattr(config, "max_position_embeddings", None) or 4096)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        architecture=architecture,
        vocab_size=_size(config, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=int(getattr(config, "intermediate_size", None) or 4 * hidden),
        num_hidden_layers=_size(config, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-6),
        rope_theta=10000.0,  # the fallback's own modules apply its rotary embedding
        rope_scaling=RopeScaling(),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=eos_ids,
    )


def _size(config: Any, field: str, source: str) -> int:
    value = getattr(config, field, None)
    if not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source}: required field {field!r} is missing or not a positive integer (got {value!r})")
    return value


@attrs.frozen(eq=False)
class Step:
    """What the attention function needs of one forward: the cache, the
    batch's attention plan and the slots its keys and values go to.
    ``layers_seen`` (the probe step only) records each layer that attended,
    with its sliding window."""

    kv_cache: KVCache
    meta: AttentionMetadata
    slot_mapping: torch.Tensor
    layers_seen: list[tuple[int, int | None]] | None = None


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature over the paged cache:
    ``query`` ``[1, heads, T, head_dim]`` and ``key``/``value`` ``[1,
    kv_heads, T, head_dim]`` hold every token of the step (all sequences
    flattened into one row); returns ``[1, T, heads, head_dim]``.

    Raises ``ValueError`` naming what the model asked for that this does
    not compute, rather than attend differently from transformers."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, Step):
        raise ValueError(f"{type(module).__name__}: called without the step's plan (keyword {STEP_KWARG!r})")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no layer_idx: the paged cache cannot tell its layers apart")
    if not 0 <= layer < step.kv_cache.key.shape[0]:
        raise ValueError(f"layer_idx {layer} is outside the KV cache's {step.kv_cache.key.shape[0]} layers (num_hidden_layers)")
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"layer {layer}: {feature} ({name!r}) is not computed by the paged attention")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(f"layer {layer}: bidirectional attention (is_causal=False); the paged attention is causal")
    if attention_mask is not None:
        raise ValueError(
            f"layer {layer}: the model passes its own attention mask (e.g. ALiBi), which the paged attention does not apply"
        )
    if dropout:
        raise ValueError(f"layer {layer}: attention dropout {dropout} (the model is in training mode)")
    key_cache, value_cache = step.kv_cache.key[layer], step.kv_cache.value[layer]
    _, heads, tokens, head_dim = query.shape
    if tuple(key.shape[1:2]) + tuple(key.shape[3:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"layer {layer}: keys of {key.shape[1]} heads x {key.shape[3]} dims, but the KV cache holds "
            f"{key_cache.shape[2]} x {key_cache.shape[3]} (num_key_value_heads, head_dim)"
        )
    if step.layers_seen is not None:
        step.layers_seen.append((layer, sliding_window))
    # [1, heads, T, d] -> [T, heads, d], contiguous: paged_attention views its rows.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    write_kv(k, v, key_cache, value_cache, step.slot_mapping)
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    out = paged_attention(q, k, v, key_cache, value_cache, step.meta, scale=scale, window=sliding_window, softcap=softcap)
    return out.view(1, tokens, heads, head_dim), None


def register_attention() -> None:
    """Register ``paged_attention_forward`` in transformers'
    AttentionInterface as ``ATTENTION`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM (``hf_model``, built with
    ``attn_implementation=ATTENTION``) behind the engine's model interface:
    ``forward(batch, kv_cache)`` returns float32 logits of the batch's
    ``logits_indices``, as ``LlamaForCausalLM.forward`` does."""

    fallback = True

    def __init__(self, hf_model: nn.Module, config: ModelConfig, *, cpu_paths: CpuPaths | None) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = config
        self.cpu_paths = cpu_paths
        self.batch_invariant = True  # set by the loader; the fallback is never invariant (``invariance``)
        param = next(hf_model.parameters())
        self.projection_choice = ProjectionChoice(
            device=str(param.device),
            dtype=dtype_name(param.dtype),
            packed=False,
            reason=f"the transformers fallback: transformers' own {type(hf_model).__name__} modules on F.linear",
        )
        # The window the config declares (None where it declares none or
        # turns it off): the probe checks that it reaches the attention.
        hf_config = hf_model.config
        window = getattr(hf_config, "sliding_window", None)
        types = getattr(hf_config, "layer_types", None)
        use = getattr(hf_config, "use_sliding_window", True) is not False and (
            not types or any("sliding" in str(t) for t in types)
        )
        self.sliding_window = int(window) if window is not None and use else None
        # Only the rows that want logits go through the head, where the class allows.
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters

    def invariance(self) -> Invariance:
        """Never batch-invariant: transformers' modules run on ``F.linear``
        and torch's attention, whose kernels follow the batch's shape."""
        return Invariance(
            False,
            "the transformers fallback: transformers' own modules on F.linear and torch attention, "
            "whose kernels follow the batch's shape",
        )

    def warm_up(self, max_logit_rows: int) -> int:
        """Nothing to build ahead: no packed kernels. Returns 0 calls."""
        return 0

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run ``batch``, writing its keys and values into ``kv_cache``; float32
        logits ``[len(batch.logits_indices), vocab_size]``."""
        return self.run(batch, kv_cache, None)

    def run(
        self, batch: ForwardBatch, kv_cache: KVCache, layers_seen: list[tuple[int, int | None]] | None
    ) -> torch.Tensor:
        """``forward``, recording each layer that attends in ``layers_seen`` when given."""
        step = Step(
            kv_cache=kv_cache,
            meta=AttentionMetadata.build(batch, kv_cache),
            slot_mapping=batch.slot_mapping,
            layers_seen=layers_seen,
        )
        kwargs: dict[str, Any] = {STEP_KWARG: step}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = batch.logits_indices
        out = self.hf_model(
            input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False, **kwargs
        )
        logits = out.logits[0]
        if not self._keeps_logits:
            logits = logits.index_select(0, batch.logits_indices)
        return logits.float()

    def probe(self) -> None:
        """Run one small step (a prompt in two chunks, then a decode token)
        over a scratch cache and check that every layer attended through the
        paged cache exactly once per forward. Raises ``ModelLoadError``
        naming what the model does that the fallback cannot follow."""
        config = self.config
        param = next(self.hf_model.parameters())
        kv = KVCache.allocate(config, num_blocks=2, block_size=4, dtype=param.dtype, device=param.device)
        tokens = [min(i + 1, config.vocab_size - 1) for i in range(5)]
        steps = (
            SeqChunk(tokens[:3], 0, [1, 0], 0),  # a prompt's first chunk
            SeqChunk(tokens[3:], 3, [1, 0], 2),  # its last, over the cached first
            SeqChunk(tokens[:1], 5, [1, 0], 1),  # a decode token
        )
        cannot = f"{config.architecture} cannot run on the transformers fallback"
        window = self.sliding_window
        for chunk in steps:
            batch = ForwardBatch.build([chunk], block_size=4, device=param.device)
            seen: list[tuple[int, int | None]] = []
            try:
                with torch.inference_mode():
                    logits = self.run(batch, kv, seen)
            except (ValueError, RuntimeError, IndexError, TypeError) as exc:
                raise ModelLoadError(f"{cannot}: {type(exc).__name__}: {exc}") from None
            layers = sorted(layer for layer, _ in seen)
            if layers != list(range(config.num_hidden_layers)):
                # Layers that never attended keep state elsewhere (state-space,
                # recurrent, attention shared across layers): not in our cache.
                raise ModelLoadError(
                    f"{cannot}: its layers attended through the attention interface as {layers}, "
                    f"not once each of its {config.num_hidden_layers} (num_hidden_layers)"
                )
            if window is not None and all(w is None for _, w in seen):
                # The window would live only in a mask the fallback does not build.
                raise ModelLoadError(
                    f"{cannot}: its config sets a sliding window (field 'sliding_window' = {window}), "
                    "but no layer passes it to the attention function"
                )
            if logits.shape != (len(batch.logits_indices), config.vocab_size):
                raise ModelLoadError(
                    f"{config.architecture}: the transformers fallback's logits have shape {tuple(logits.shape)}, "
                    f"expected ({len(batch.logits_indices)}, {config.vocab_size}) (vocab_size)"
                )
