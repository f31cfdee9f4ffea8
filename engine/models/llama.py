"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Our own modules, not transformers': q/k/v are one fused projection and
gate/up another (one matmul each instead of three and two), the rotary
cos/sin and the attention plan are computed once per forward for all layers,
and only the rows that want logits go through the final norm and LM head.
``load_weights`` maps Hugging Face checkpoint names onto the fused layout.

How the projections run (oneDNN's packed GEMM, ``F.linear`` or compressed
kernels) is ``models/projections.py``; whether the result is batch-invariant,
``models/invariance.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from trioserve.engine.kernels import onednn
from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from trioserve.engine.kernels.capability import CpuPaths, packed_path
from trioserve.engine.config import ModelConfig
from trioserve.engine.layers.forward_batch import ForwardBatch
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.kernels.native_attention import BoundAttention, NativeAttention, token_rows
from trioserve.engine.kernels.native import ISAS as NATIVE_ISAS
from trioserve.engine.kernels.native_decode import NativeDecode, decode_head, unsupported
from trioserve.engine.kernels.projections import QuantizedProjections
from trioserve.engine.layers.rotary import RotaryEmbedding, apply_rotary
from trioserve.engine.lora.projections import wrap_layers
from trioserve.engine.models.invariance import Invariance, compressed_on_cpu, float_on_cpu, on_device
from trioserve.engine.models import moe_weights
from trioserve.engine.models.moe import GroupedExperts, SparseMoeBlock
from trioserve.engine.models.weights import Mxfp4Pairs, Target, copy_weights, weight_targets
from trioserve.engine.models.projections import (
    PackedProjections,
    PlainProjections,
    ProjectionChoice,
    Projections,
    choose_projections,
)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights, so random
    # init would only cost time.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP blocks with residuals, and what each
    family changes of them (``ModelConfig``): q/k norms, Gemma's norms after
    each block, a sliding window, rotary on part of a head or none,
    gpt-oss's attention sinks, a mixture of experts for the MLP."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        float_projections: bool = True,
        index: int = 0,
    ):
        super().__init__()
        hidden, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.eps = config.rms_norm_eps
        self.norm_shape = (hidden,)
        self.scale = config.attn_scale
        self.window = config.layer_window(index)
        self.softcap = config.attn_logit_softcapping
        self.activation = config.hidden_act
        # Which of the model's rotary tables this layer turns q and k by (None: no rotary).
        rope = config.layer_rope(index)
        self.rope = None if rope is None else config.rope_tables().index(rope)
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * hd
        self.input_layernorm = _param(hidden, dtype=dtype, device=device)
        # Without float projections (a quantized model) the four matrices
        # live only in the kernels' compressed layouts (engine/kernels).
        proj = _param if float_projections else lambda *shape, **kw: None
        self.qkv_proj = proj(qkv_out, hidden, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = proj(hidden, self.num_heads * hd, dtype=dtype, device=device)
        self.o_bias = _param(hidden, dtype=dtype, device=device) if config.o_bias else None
        self.q_norm = _param(hd, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = _param(hd, dtype=dtype, device=device) if config.qk_norm else None
        # gpt-oss: one sink logit per query head (``paged_attention``'s ``sinks``).
        self.sinks = _param(self.num_heads, dtype=dtype, device=device) if config.attention_sinks else None
        self.post_attention_layernorm = _param(hidden, dtype=dtype, device=device)
        # Gemma: post_attention_layernorm norms the attention's output; these
        # norm the MLP's input and output.
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = _param(hidden, dtype=dtype, device=device) if sandwich else None
        self.post_feedforward_layernorm = _param(hidden, dtype=dtype, device=device) if sandwich else None
        # A mixture-of-experts layer's MLP is the sparse block (models/moe.py).
        self.mlp: SparseMoeBlock | None = None
        if index in config.moe_layers:
            assert config.moe_routing is not None
            self.mlp = SparseMoeBlock(
                hidden, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                config.moe_routing, norm_topk_prob=config.norm_topk_prob, swiglu_alpha=config.swiglu_alpha,
                swiglu_limit=config.swiglu_limit, dtype=dtype, device=device, float_experts=float_projections,
            )  # fmt: skip
            proj = lambda *shape, **kw: None  # noqa: E731
        self.gate_up_proj = proj(2 * config.intermediate_size, hidden, dtype=dtype, device=device)
        self.down_proj = proj(hidden, config.intermediate_size, dtype=dtype, device=device)

    def mlp_targets(self, layer_prefix: str) -> tuple[dict[str, Target], set[str]]:
        """A mixture-of-experts layer's checkpoint names -> targets, and the
        names a complete block needs (``models/moe_weights.py``)."""
        assert self.mlp is not None
        return moe_weights.weight_targets(self.mlp, layer_prefix), moe_weights.required_weight_names(
            self.mlp, layer_prefix
        )

    def forward(
        self,
        residual: torch.Tensor,
        projections: Projections,
        rotary: list[tuple[torch.Tensor, torch.Tensor]],
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None,
        attend: BoundAttention | None = None,
    ) -> torch.Tensor:
        """Return the residual stream after this layer's attention and MLP
        blocks; ``projections`` is ``self.projections(...)``, ``rotary`` the
        model's ``(cos, sin)`` per table. With ``attend``, the tokens'
        rotary, cache write and attention run natively in one call
        (``native_attention``); without, in torch as ``meta`` plans."""
        norm_shape, eps, heads, head_dim = self.norm_shape, self.eps, self.num_heads, self.head_dim
        x = F.rms_norm(residual, norm_shape, self.input_layernorm, eps)
        qkv = projections.qkv(x)
        tokens = qkv.shape[0]
        q_and_k = heads + self.num_kv_heads
        if self.q_norm is not None:
            # Each head of q and k normed on its own, before rotary (Qwen3, Gemma 3).
            qk = qkv[:, : q_and_k * head_dim].view(tokens, q_and_k, head_dim)
            qk[:, :heads] = F.rms_norm(qk[:, :heads], (head_dim,), self.q_norm, eps)
            qk[:, heads:] = F.rms_norm(qk[:, heads:], (head_dim,), self.k_norm, eps)
        if attend is not None:
            attn = attend(qkv, key_cache, value_cache, heads, self.scale)
        else:
            assert meta is not None
            qk = qkv[:, : q_and_k * head_dim].view(tokens, q_and_k, head_dim)
            if self.rope is not None:
                # Rotate q and k together: one rotary op per layer.
                qk = apply_rotary(qk, *rotary[self.rope])
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_and_k * head_dim :].view(tokens, self.num_kv_heads, head_dim)
            write_kv(k, v, key_cache, value_cache, slot_mapping)
            attn = paged_attention(
                q, k, v, key_cache, value_cache, meta,
                scale=self.scale, window=self.window, softcap=self.softcap, sinks=self.sinks,
            )  # fmt: skip
        if self.pre_feedforward_layernorm is None:
            residual = projections.o_add(attn, residual)
            x = F.rms_norm(residual, norm_shape, self.post_attention_layernorm, eps)
            if self.activation == "silu":
                return projections.mlp_add(x, residual)
            return projections.mlp(x, self.activation) + residual
        residual = residual + F.rms_norm(projections.o(attn), norm_shape, self.post_attention_layernorm, eps)
        x = F.rms_norm(residual, norm_shape, self.pre_feedforward_layernorm, eps)
        out = projections.mlp(x, self.activation)
        return residual + F.rms_norm(out, norm_shape, self.post_feedforward_layernorm, eps)

    def projections(self, pack: bool) -> Projections:
        """This layer's projections, on packed copies of its weights when ``pack``."""
        if not pack:
            made: Projections = PlainProjections(
                self.qkv_proj, self.qkv_bias, self.o_proj, self.o_bias, self.gate_up_proj, self.down_proj
            )
        else:
            gate, up = (None, None) if self.gate_up_proj is None else self.gate_up_proj.chunk(2)
            made = PackedProjections(
                onednn.pack(self.qkv_proj),
                self.qkv_bias,
                onednn.pack(self.o_proj),
                self.o_bias,
                None if gate is None else onednn.pack(gate),
                None if up is None else onednn.pack(up),
                None if self.down_proj is None else onednn.pack(self.down_proj),
            )
        return made if self.mlp is None else ExpertProjections(made, self.mlp.experts(pack))


@attrs.frozen
class ExpertProjections:
    """A mixture-of-experts layer's projections: attention's from ``attention``,
    the MLP the sparse block's grouped experts (the gate's activation is the
    block's own)."""

    attention: Projections
    experts: GroupedExperts

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.qkv(x)

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.attention.o_add(x, residual)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.o(x)

    def mlp(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return self.experts(x)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.experts(x).add_(residual)


@attrs.frozen
class _Made:
    """The projections a forward runs, and the device and dtype they were made for."""

    layers: list[Projections]
    lm_head: torch.Tensor
    packed: bool
    where: tuple[torch.device, torch.dtype]
    head: Callable[[torch.Tensor], torch.Tensor] | None = None  # a compressed LM head
    decode: NativeDecode | None = None  # all layers of a decode batch in one native call
    decode_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # the LM head after it, where not ``head``


class LlamaForCausalLM(nn.Module):
    """A causal LM of any family ``ModelConfig`` describes (Llama, Mistral,
    Qwen2 and 3, Gemma 2 and 3, Phi-3, SmolLM3, Qwen3-MoE, Mixtral, gpt-oss);
    parameters start uninitialised and are filled by ``load_weights``.

    ``pack_weights`` (see ``choose_projections``; default: wherever that
    path works, that is on CPU in float32, and in bfloat16 on CPUs with
    AVX-512 or AVX-NE-CONVERT) runs the projections and the LM head on
    oneDNN over packed copies of their weights: on CPU the matmuls of a
    batch-64 decode step take about half the time of ``F.linear`` (MKL) on
    the plain weights. The copies are made at the first forward after
    ``load_weights`` and cost as much memory again as those weights.

    ``cpu_paths`` is what this CPU can run (default on CPU:
    ``CpuPaths.from_environment()``, a few milliseconds of trials); a dtype
    it cannot run raises ``CpuCapabilityError``. ``projection_choice`` says
    which path the model took and why.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack_weights: bool | None = None,
        cpu_paths: CpuPaths | None = None,
        quantization: ProjectionChoice | None = None,
        batch_invariant: bool = True,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        # Every token through one arithmetic, whatever shares its step
        # (``forward``, ``invariance``); False lets prompts take the faster
        # arithmetic of the layers in torch.
        self.batch_invariant = batch_invariant
        if cpu_paths is None and torch.device(device).type == "cpu":
            cpu_paths = CpuPaths.from_environment()
        if cpu_paths is not None and torch.device(device).type == "cpu":
            cpu_paths.require_dtype(dtype)
        self.cpu_paths = cpu_paths
        # ``quantization``: the projections are compressed, given by
        # ``set_quantized`` (engine/loading/compressed.py), and have no float parameters.
        self.projection_choice = quantization or choose_projections(device, dtype, cpu_paths, pack_weights)
        self.pack_weights = self.projection_choice.packed
        self._made: _Made | None = None
        self._quantized: _Made | None = None
        # Compressed token embeddings (``set_quantized``): rows dequantized on lookup.
        self._embedding: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._pack_lock = threading.Lock()
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype, device=device, float_projections=quantization is None, index=i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = _param(config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        elif quantization is not None:
            self.lm_head = None  # compressed, given by set_quantized
        else:
            self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # One table per distinct rotary embedding the layers use (Gemma 3:
        # the full layers' and the sliding layers').
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(config, rope=rope, dtype=dtype, device=device) for rope in config.rope_tables()
        )
        # Every batch attends natively where that path works here (None: in
        # torch): layers that attend as Llama's do, on one rotary table.
        self.native_attention = (
            NativeAttention.choose(cpu_paths, device, dtype, config.head_dim) if config.plain_attention else None
        )
        self._targets = weight_targets(self)
        # gpt-oss's MXFP4 experts: each half held until its other half loads.
        self._mxfp4_pairs = Mxfp4Pairs()

    def invariance(self) -> Invariance:
        """Whether this model, as built and set (``batch_invariant``), gives a
        token the same bits whatever shares its step, and why."""
        device = self.embed_tokens.device
        if device.type != "cpu":
            return on_device(device)
        made = self._quantized
        if made is None:
            packed = self.pack_weights and self._can_pack(device, self.dtype)
            return float_on_cpu(self.dtype, packed=packed, native_attention=self.native_attention is not None)
        if made.decode is None or (made.decode_head is None and self.batch_invariant):
            return compressed_on_cpu(None, self.batch_invariant, unsupported(self.config))
        isa = next(name for name, index in NATIVE_ISAS.items() if index == made.decode.isa)
        return compressed_on_cpu(isa, self.batch_invariant)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache, *, normed_hidden: bool = False) -> torch.Tensor:
        """Run ``batch``, writing its keys and values into ``kv_cache``.

        Returns float32 logits ``[len(batch.logits_indices), vocab_size]``,
        one row per entry of ``logits_indices``, in that order; with
        ``normed_hidden``, those rows' final hidden states after the final
        norm instead (embeddings pool them; ``head_logits`` gives their logits).
        """
        made = self._projections()
        if batch.lora is not None:
            # An engine serving LoRA (engine/lora) runs every batch's layers
            # in torch, adapters or not, so every request gets one
            # arithmetic; an adapter's rows get its deltas there.
            made = attrs.evolve(made, layers=wrap_layers(batch.lora, made.layers), decode=None)
        rotary = [r.cos_sin(batch.positions) for r in self.rotaries]
        hidden = self.embed(batch.input_ids)
        slots = batch.slot_mapping
        fused = made.decode is not None and made.decode.runs(
            batch.query_lens_cpu, kv_cache.key.dtype, prompts=self.batch_invariant
        )
        if fused:
            tables, lens = token_rows(batch.query_lens_cpu, batch.positions, batch.block_tables, batch.context_lens)
            hidden = made.decode(hidden, *rotary[0], kv_cache.key, kv_cache.value, slots, tables, lens)
            if made.decode_head is not None:
                made = attrs.evolve(made, head=made.decode_head)
        else:
            native = self.native_attention
            runs = native is not None and native.runs(hidden, kv_cache.key)
            attend = native.bind(batch, *rotary[0]) if runs else None
            meta = None if attend is not None else AttentionMetadata.build(batch, kv_cache)
            window = None
            if kv_cache.window is not None:
                # Sliding layers in a pool of their own, on their own tables (kv_cache.py).
                sliding = batch.window_batch()
                window = (sliding.slot_mapping, AttentionMetadata.build(sliding, kv_cache.window))
            hidden = self._decoder_layers(hidden, made, rotary, kv_cache, slots, meta, attend, window)
        hidden = hidden.index_select(0, batch.logits_indices)
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        if normed_hidden:
            return hidden
        return self.lm_logits(hidden, made)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-normed rows (``forward(..., normed_hidden=True)``)."""
        return self.lm_logits(hidden, self._projections())

    def forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """One token per row at ``positions``, as ``meta`` plans their
        attention (``AttentionMetadata.for_decode_tables``), writing keys and
        values at ``slot_mapping``; float32 logits for every row.

        Nothing here reads a tensor back to the host or branches on a
        batch's lengths, so a CUDA graph can record it once per shape and
        replay it (engine/runtime/cuda_graphs.py); attention runs in torch, not on
        the CPU's native paths.
        """
        made = self._projections()
        rotary = [r.cos_sin(positions) for r in self.rotaries]
        hidden = self._decoder_layers(self.embed(input_ids), made, rotary, kv_cache, slot_mapping, meta, None)
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.lm_logits(hidden, made)

    def _decoder_layers(
        self,
        hidden: torch.Tensor,
        made: _Made,
        rotary: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None,
        attend: BoundAttention | None,
        window: tuple[torch.Tensor, AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """The residual stream after every layer; ``window``: the slots and
        plan of the sliding layers' own pool, when the cache has one."""
        if window is not None:
            for layer, projections, (keys, values, slides) in zip(self.layers, made.layers, kv_cache.layer_pools()):
                slots, layer_meta = window if slides else (slot_mapping, meta)
                hidden = layer.forward(hidden, projections, rotary, keys, values, slots, layer_meta, attend)
            return hidden
        # ``forward`` directly, not through nn.Module's call (hook checks),
        # and each layer's pools from one unbind: a one-stream decode step
        # is bound by such per-layer overheads (docs/benchmarks.md in git history, "A lean
        # decode step").
        for layer, projections, keys, values in zip(self.layers, made.layers, kv_cache.key, kv_cache.value):
            hidden = layer.forward(hidden, projections, rotary, keys, values, slot_mapping, meta, attend)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (a tensor-parallel shard
        overrides this and ``lm_logits``: engine/parallel/tensor_parallel.py)."""
        hidden = self._embedding(input_ids) if self._embedding is not None else F.embedding(input_ids, self.embed_tokens)
        if self.config.embedding_multiplier != 1.0:
            # Gemma: the multiplier is rounded to the model's dtype first, as transformers does.
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=self.dtype).to(hidden.dtype)
        return hidden

    def lm_logits(self, hidden: torch.Tensor, made: _Made) -> torch.Tensor:
        """Float32 logits of the final-normed ``hidden`` rows."""
        if made.head is not None:
            logits = made.head(hidden).float()
        elif made.packed:
            logits = onednn.linear(hidden, made.lm_head, None, "none").float()
        else:
            logits = F.linear(hidden, made.lm_head).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _projections(self) -> _Made:
        """Each layer's projections and the LM head weight, packed when
        ``pack_weights``; made once, and again after ``load_weights`` or a
        move to another device or dtype."""
        if self._quantized is not None:
            return self._quantized
        where = (self.embed_tokens.device, self.embed_tokens.dtype)
        made = self._made
        if made is not None and made.where == where:
            return made
        with self._pack_lock, torch.inference_mode():
            if self._made is None or self._made.where != where:
                pack = self.pack_weights and self._can_pack(*where)
                lm_head = onednn.pack(self.lm_head) if pack else self.lm_head
                self._made = _Made([layer.projections(pack) for layer in self.layers], lm_head, pack, where)
            return self._made

    def warm_up(self, max_logit_rows: int) -> int:
        """Run each packed projection once at every row count it runs at
        (``onednn.row_buckets``; the LM head up to ``max_logit_rows``, the
        most sequences a step samples), so oneDNN builds all its kernels
        now: the memory they take is there from the start, not added while
        serving, and no request waits for one. Returns how many calls it
        made (0 when the projections are not packed)."""
        made = self._projections()
        if not made.packed:
            return 0
        c = self.config
        layer = made.layers[0]  # every layer has the same shapes
        calls = 0
        with torch.inference_mode():
            for rows in onednn.row_buckets():
                # The weights' dtype and device, which a ``.to`` may have changed.
                x = self.embed_tokens.new_zeros(rows, c.hidden_size)
                attention = x.new_zeros(rows, c.num_attention_heads * c.head_dim)
                layer.qkv(x)
                layer.o_add(attention, x)
                layer.mlp_add(x, x)
                calls += 5
                if rows <= onednn.row_bucket(min(max_logit_rows, onednn.MAX_ROWS)):
                    onednn.linear(x, made.lm_head, None, "none")
                    calls += 1
        return calls

    def set_quantized(
        self,
        layers: list[QuantizedProjections | ExpertProjections],
        head: Callable[[torch.Tensor], torch.Tensor] | None,
        embedding: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Run on compressed projections (one per layer: a mixture's layer
        wraps its compressed attention and experts) and, when ``head``
        is given, a compressed LM head; else the LM head is ``F.linear``.
        Where the projections (and a mixture's experts) run on the native
        kernels, decode batches run all layers in one native call. With
        ``embedding`` (``quant.embedding``; it needs ``head`` when the
        embeddings are tied) token ids look up their rows there, and the
        float table is dropped (``embed_tokens`` keeps no rows)."""
        assert self.projection_choice.quantization is not None and len(layers) == len(self.layers)
        if embedding is not None:
            assert head is not None or not self.config.tie_word_embeddings
            self._embedding = embedding
            e = self.embed_tokens
            self.embed_tokens = _param(0, self.config.hidden_size, dtype=e.dtype, device=e.device)
            if self.config.tie_word_embeddings:
                self.lm_head = self.embed_tokens
            self._targets = weight_targets(self)
        where = (self.embed_tokens.device, self.embed_tokens.dtype)
        c = self.config
        decode = NativeDecode.build(
            layers,
            [layer.input_layernorm for layer in self.layers],
            [layer.post_attention_layernorm for layer in self.layers],
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            eps=c.rms_norm_eps,
            config=c,  # a config with a feature the step was not checked for runs the layers
            head_norms=[None if l.q_norm is None else (l.q_norm, l.k_norm) for l in self.layers],  # type: ignore[misc]
        )
        self._quantized = _Made(list(layers), self.lm_head, False, where, head, decode, decode_head(head))

    def _can_pack(self, device: torch.device, dtype: torch.dtype) -> bool:
        # After a move (``.to``): pack only where that path works too.
        name = packed_path(dtype)
        return device.type == "cpu" and name is not None and self.cpu_paths is not None and self.cpu_paths.available(name)

    def required_weight_names(self) -> set[str]:
        """Checkpoint names ``load_weights`` must see for a complete model
        (no ``lm_head.weight`` when the embeddings are tied)."""
        names = set(self._targets)
        for i, layer in enumerate(self.layers):
            if layer.mlp is not None:
                # The block takes the Hub's names and transformers' fused ones: it needs one set.
                targets, required = layer.mlp_targets(f"model.layers.{i}.")
                names = (names - set(targets)) | required
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
        gpt-oss's MXFP4 experts (``{name}_blocks`` and ``{name}_scales``)
        decode into the float experts; ``{name}`` is returned with the second
        half of its pair.
        """
        loaded = copy_weights(self._targets, weights, self.config, self._mxfp4_pairs)
        if loaded:
            self._made = None  # packed copies are stale
        return loaded

