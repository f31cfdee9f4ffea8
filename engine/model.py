"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Our own modules, not transformers': q/k/v are one fused projection and
gate/up another (one matmul each instead of three and two), the rotary
cos/sin and the attention plan are computed once per forward for all layers,
and only the rows that want logits go through the final norm and LM head.
``load_weights`` maps Hugging Face checkpoint names onto the fused layout.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv
from .config import ModelConfig
from .errors import ModelLoadError
from .forward_batch import ForwardBatch
from .kv_cache import KVCache
from .rotary import RotaryEmbedding, apply_rotary

# Checkpoint buffers derived from the config, never weights we load.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*rotary_emb\.(cos|sin)_cached$")


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights, so random
    # init would only cost time.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def can_pack_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``pack_weights`` works for ``device`` and ``dtype``: CPU
    float32 or bfloat16 with torch's oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # oneDNN's blocked layout for this weight, for any number of rows.
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@attrs.frozen
class LayerWeights:
    """One layer's projection weights and the ``linear(x, weight, bias)`` that takes them."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP blocks with residuals."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.eps = config.rms_norm_eps
        self.scale = hd**-0.5
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * hd
        self.input_layernorm = _param(hidden, dtype=dtype, device=device)
        self.qkv_proj = _param(qkv_out, hidden, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = _param(hidden, self.num_heads * hd, dtype=dtype, device=device)
        # Llama's attention_bias also covers o_proj; Qwen2's covers q/k/v only.
        has_o_bias = config.attention_bias and config.architecture == "LlamaForCausalLM"
        self.o_bias = _param(hidden, dtype=dtype, device=device) if has_o_bias else None
        self.post_attention_layernorm = _param(hidden, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * config.intermediate_size, hidden, dtype=dtype, device=device)
        self.down_proj = _param(hidden, config.intermediate_size, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        weights: LayerWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this layer's MLP output and the residual stream before it;
        the next layer adds them, which saves one add per layer.

        ``weights`` are this layer's projections as ``linear`` takes them:
        the parameters themselves, or their CPU-packed copies."""
        linear = weights.linear
        residual = hidden if residual is None else hidden + residual
        x = F.rms_norm(residual, (residual.shape[-1],), self.input_layernorm, self.eps)
        qkv = linear(x, weights.qkv, self.qkv_bias)
        tokens = qkv.shape[0]
        q_and_k = self.num_heads + self.num_kv_heads
        # Rotate q and k together: one rotary op per layer.
        qk = apply_rotary(qkv[:, : q_and_k * self.head_dim].view(tokens, q_and_k, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_and_k * self.head_dim :].view(tokens, self.num_kv_heads, self.head_dim)
        write_kv(k, v, key_cache, value_cache, slot_mapping)
        attn = paged_attention(q, k, v, key_cache, value_cache, meta, scale=self.scale)
        residual = linear(attn, weights.o, self.o_bias) + residual
        x = F.rms_norm(residual, (residual.shape[-1],), self.post_attention_layernorm, self.eps)
        gate, up = linear(x, weights.gate_up, None).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, weights.down, None), residual

    def weights(self, pack: bool) -> LayerWeights:
        """This layer's projection weights, packed for oneDNN when ``pack``."""
        if not pack:
            return LayerWeights(F.linear, self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        return LayerWeights(
            _packed_linear,
            _pack(self.qkv_proj),
            _pack(self.o_proj),
            _pack(self.gate_up_proj),
            _pack(self.down_proj),
        )


class LlamaForCausalLM(nn.Module):
    """A Llama, Mistral or Qwen2 causal LM; parameters start uninitialised
    and are filled by ``load_weights``.

    ``pack_weights`` (default: where ``can_pack_weights`` allows, that is on
    CPU) runs the projections and the LM head on oneDNN with its weights
    reordered once into its blocked layout: on CPU that runs the matmuls of
    a decode step up to twice as fast as ``F.linear`` on plain weights. The
    packed copies are made at the first forward after ``load_weights`` and
    cost one more copy of those weights' memory.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack_weights: bool | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        if pack_weights is None:
            pack_weights = can_pack_weights(device, dtype)
        elif pack_weights and not can_pack_weights(device, dtype):
            raise ValueError(f"pack_weights needs a CPU float32 or bfloat16 model with oneDNN, not {dtype} on {device}")
        self.pack_weights = pack_weights
        self._packed: tuple[list[LayerWeights], torch.Tensor] | None = None
        self._pack_lock = threading.Lock()
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        )
        self.norm = _param(config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config, dtype=dtype, device=device)
        self._targets = self._weight_targets()

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run ``batch``, writing its keys and values into ``kv_cache``.

        Returns float32 logits ``[len(batch.logits_indices), vocab_size]``,
        one row per entry of ``logits_indices``, in that order.
        """
        layer_weights, lm_head = self._linear_weights()
        meta = AttentionMetadata.build(batch, kv_cache)
        cos, sin = self.rotary.cos_sin(batch.positions)
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        residual = None
        for i, (layer, weights) in enumerate(zip(self.layers, layer_weights)):
            hidden, residual = layer(
                hidden, residual, weights, cos, sin, kv_cache.key[i], kv_cache.value[i], batch.slot_mapping, meta
            )
        if residual is not None:
            hidden = hidden + residual
        hidden = hidden.index_select(0, batch.logits_indices)
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        return layer_weights[0].linear(hidden, lm_head, None).float()

    def _linear_weights(self) -> tuple[list[LayerWeights], torch.Tensor]:
        """Each layer's projection weights and the LM head's, packed when
        ``pack_weights``; made once, and again after ``load_weights``."""
        packed = self._packed
        if packed is not None:
            return packed
        with self._pack_lock, torch.inference_mode():
            if self._packed is None:
                lm_head = _pack(self.lm_head) if self.pack_weights else self.lm_head
                self._packed = ([layer.weights(self.pack_weights) for layer in self.layers], lm_head)
            return self._packed

    def required_weight_names(self) -> set[str]:
        """Checkpoint names ``load_weights`` must see for a complete model
        (no ``lm_head.weight`` when the embeddings are tied)."""
        names = set(self._targets)
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters,
        converting dtype and device; return the names loaded.

        Threads may call this at once with disjoint names: each name owns a
        disjoint slice and nothing else is shared. Raises ``ModelLoadError``
        naming the weight for an unknown name or a shape mismatch. Derived
        buffers such as ``rotary_emb.inv_freq`` are skipped and not returned.
        A tied model accepts (and ignores) a redundant ``lm_head.weight``.
        """
        loaded: set[str] = set()
        # inference_mode allows the in-place copy whether or not the
        # parameters were created under inference mode.
        with torch.inference_mode():
            for name, tensor in weights:
                if _IGNORED.fullmatch(name):
                    continue
                target = self._targets.get(name)
                if target is None:
                    raise ModelLoadError(f"unknown weight {name!r} for {self.config.architecture}")
                param, start, stop = target
                dest = param if start is None else param[start:stop]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"weight {name!r}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}"
                    )
                if not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                    dest.copy_(tensor)
                    self._packed = None  # the packed copies are stale
                loaded.add(name)
        return loaded

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None, int | None]]:
        """Each checkpoint name -> (parameter, row slice) it fills."""
        c = self.config
        q_rows = c.num_attention_heads * c.head_dim
        kv_rows = c.num_key_value_heads * c.head_dim
        targets: dict[str, tuple[torch.Tensor, int | None, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None, None),
            "model.norm.weight": (self.norm, None, None),
            "lm_head.weight": (self.lm_head, None, None),
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
            for n, (a, b) in qkv.items():
                targets[f"{p}self_attn.{n}_proj.weight"] = (layer.qkv_proj, a, b)
                if layer.qkv_bias is not None:
                    targets[f"{p}self_attn.{n}_proj.bias"] = (layer.qkv_bias, a, b)
            targets[f"{p}self_attn.o_proj.weight"] = (layer.o_proj, None, None)
            if layer.o_bias is not None:
                targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, None, None)
            inter = c.intermediate_size
            targets[f"{p}mlp.gate_proj.weight"] = (layer.gate_up_proj, 0, inter)
            targets[f"{p}mlp.up_proj.weight"] = (layer.gate_up_proj, inter, 2 * inter)
            targets[f"{p}mlp.down_proj.weight"] = (layer.down_proj, None, None)
            targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, None, None)
            targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None, None)
        return targets
