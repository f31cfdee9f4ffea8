"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Our own modules, not transformers': q/k/v are one fused projection and
gate/up another (one matmul each instead of three and two), the rotary
cos/sin and the attention plan are computed once per forward for all layers,
and only the rows that want logits go through the final norm and LM head.
``load_weights`` maps Hugging Face checkpoint names onto the fused layout.

On CPU the projections run on oneDNN over weights reordered once into its
blocked layout (``PackedProjections``), with SiLU, the gate product and the
residual adds fused into the matmuls, where that path works on this CPU in
the model's dtype (``choose_projections``, by ``capability.CpuPaths``);
elsewhere ``F.linear`` over the parameters (``PlainProjections``). Both
compute the same float32 result up to summation order.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from trioserve.engine.kernels import onednn
from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from trioserve.engine.kernels.capability import CpuPaths, dtype_name, packed_path
from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import CpuCapabilityError, ModelLoadError
from trioserve.engine.layers.forward_batch import ForwardBatch
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.kernels.native_attention import BoundAttention, NativeAttention, token_rows
from trioserve.engine.kernels.native import ISAS as NATIVE_ISAS
from trioserve.engine.kernels.native_decode import NativeDecode, decode_head
from trioserve.engine.kernels.projections import QuantizedProjections
from trioserve.engine.layers.rotary import RotaryEmbedding, apply_rotary

# Checkpoint buffers derived from the config, never weights we load.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*rotary_emb\.(cos|sin)_cached$")


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights, so random
    # init would only cost time.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


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


@attrs.frozen
class ProjectionChoice:
    """How a model runs its projections, and why: shown at startup, in the
    load log and in ``/version``. ``fallback``: the packed path would have
    been taken, but this CPU (or ``TRIOSERVE_CPU_ASSUME``) lacks it."""

    device: str
    dtype: str
    packed: bool
    reason: str
    fallback: bool = False
    quantization: str | None = None  # e.g. "int4": compressed projections (engine/kernels)
    # Set once the model is built (``LlamaForCausalLM.invariance``).
    invariance: Invariance | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "projections": "packed" if self.packed else "plain",
            "fallback": self.fallback,
            "reason": self.reason,
            "quantization": self.quantization,
            "invariance": None if self.invariance is None else self.invariance.as_json(),
        }

    @property
    def summary(self) -> str:
        """The choice without the reason, e.g. ``bfloat16 on cpu, plain projections``."""
        if self.quantization is not None:
            return f"{self.dtype} on {self.device}, {self.quantization} projections"
        return f"{self.dtype} on {self.device}, {'packed' if self.packed else 'plain'} projections"

    def __str__(self) -> str:
        return f"{self.summary} ({self.reason})"


def choose_projections(
    device: torch.device | str, dtype: torch.dtype, cpu_paths: CpuPaths | None, pack_weights: bool | None
) -> ProjectionChoice:
    """Packed (oneDNN) or plain (``F.linear``) projections for a model on
    ``device`` in ``dtype``, by what ``cpu_paths`` found works.

    ``pack_weights`` None picks packed where that path works and plain
    otherwise; False is plain; True insists on packed: a ``ValueError``
    where the model never packs (float16, not CPU), a ``CpuCapabilityError``
    where this CPU cannot.
    """
    device = torch.device(device)
    where = {"device": str(device), "dtype": dtype_name(dtype)}
    name = packed_path(dtype)
    if pack_weights and (device.type != "cpu" or name is None):
        raise ValueError(f"pack_weights needs a CPU float32 or bfloat16 model with oneDNN, not {dtype} on {device}")
    if device.type != "cpu":
        return ProjectionChoice(**where, packed=False, reason=f"F.linear on {device.type}")
    if pack_weights is False:
        return ProjectionChoice(**where, packed=False, reason="pack_weights=False: F.linear")
    if name is None:
        return ProjectionChoice(**where, packed=False, reason=f"no packed path for {dtype_name(dtype)}: F.linear")
    if cpu_paths is None:
        raise ValueError("a CPU model needs cpu_paths to choose its projections")
    status = cpu_paths.status(name)
    if status.available:
        return ProjectionChoice(**where, packed=True, reason=status.reason)
    if pack_weights:
        raise CpuCapabilityError(
            f"pack_weights=True, but {status.reason}; on this CPU run {dtype_name(dtype)} unpacked "
            f"(pack_weights=None picks what works)"
        )
    reason = f"{status.reason}; F.linear on the plain weights instead"
    if dtype == torch.bfloat16:
        # Measured (docs/architecture.md, "CPU paths"): without oneDNN's
        # bfloat16 kernels torch's bfloat16 matmul is 6-13x slower than float32's.
        reason += " (in bfloat16 several times slower than float32 on such a CPU)"
    return ProjectionChoice(**where, packed=False, reason=reason, fallback=True)


@attrs.frozen
class PlainProjections:
    """One layer's projections as ``F.linear`` over its parameters (CUDA,
    or CPU without packing). Each method returns what the layer needs next:
    the fused q/k/v, or the residual stream with the projection added."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qkv_weight, self.qkv_bias)

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.o_weight, self.o_bias) + residual

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight) + residual


@attrs.frozen
class PackedProjections:
    """The same projections on oneDNN over weights reordered once
    (``onednn.pack``), with the elementwise work fused into the matmuls: SiLU
    into the gate projection, the gate product into the up projection, the
    residual adds into the o and down projections."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_weight: torch.Tensor
    up_weight: torch.Tensor
    down_weight: torch.Tensor

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.qkv_weight, self.qkv_bias, "none")

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return onednn.linear_binary(x, self.o_weight, self.o_bias, "add", residual)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate = onednn.linear(x, self.gate_weight, None, "swish")  # SiLU
        hidden = onednn.linear_binary(x, self.up_weight, None, "mul", gate)
        return onednn.linear_binary(hidden, self.down_weight, None, "add", residual)


Projections = PlainProjections | PackedProjections | QuantizedProjections


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP blocks with residuals."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, float_projections: bool = True
    ):
        super().__init__()
        hidden, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.eps = config.rms_norm_eps
        self.norm_shape = (hidden,)
        self.scale = hd**-0.5
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * hd
        self.input_layernorm = _param(hidden, dtype=dtype, device=device)
        # Without float projections (a quantized model) the four matrices
        # live only in the kernels' compressed layouts (engine/kernels).
        proj = _param if float_projections else lambda *shape, **kw: None
        self.qkv_proj = proj(qkv_out, hidden, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = proj(hidden, self.num_heads * hd, dtype=dtype, device=device)
        # Llama's attention_bias also covers o_proj; Qwen2's covers q/k/v only.
        has_o_bias = config.attention_bias and config.architecture == "LlamaForCausalLM"
        self.o_bias = _param(hidden, dtype=dtype, device=device) if has_o_bias else None
        self.post_attention_layernorm = _param(hidden, dtype=dtype, device=device)
        self.gate_up_proj = proj(2 * config.intermediate_size, hidden, dtype=dtype, device=device)
        self.down_proj = proj(hidden, config.intermediate_size, dtype=dtype, device=device)

    def forward(
        self,
        residual: torch.Tensor,
        projections: Projections,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None,
        attend: BoundAttention | None = None,
    ) -> torch.Tensor:
        """Return the residual stream after this layer's attention and MLP
        blocks; ``projections`` is ``self.projections(...)``. With ``attend``,
        the tokens' rotary, cache write and attention run natively in one
        call (``native_attention``); without, in torch as ``meta`` plans."""
        norm_shape, eps, heads, head_dim = self.norm_shape, self.eps, self.num_heads, self.head_dim
        x = F.rms_norm(residual, norm_shape, self.input_layernorm, eps)
        qkv = projections.qkv(x)
        if attend is not None:
            attn = attend(qkv, key_cache, value_cache, heads, self.scale)
        else:
            assert meta is not None
            tokens = qkv.shape[0]
            q_and_k = heads + self.num_kv_heads
            # Rotate q and k together: one rotary op per layer.
            qk = apply_rotary(qkv[:, : q_and_k * head_dim].view(tokens, q_and_k, head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_and_k * head_dim :].view(tokens, self.num_kv_heads, head_dim)
            write_kv(k, v, key_cache, value_cache, slot_mapping)
            attn = paged_attention(q, k, v, key_cache, value_cache, meta, scale=self.scale)
        residual = projections.o_add(attn, residual)
        x = F.rms_norm(residual, norm_shape, self.post_attention_layernorm, eps)
        return projections.mlp_add(x, residual)

    def projections(self, pack: bool) -> Projections:
        """This layer's projections, on packed copies of its weights when ``pack``."""
        if not pack:
            return PlainProjections(
                self.qkv_proj, self.qkv_bias, self.o_proj, self.o_bias, self.gate_up_proj, self.down_proj
            )
        gate, up = self.gate_up_proj.chunk(2)
        return PackedProjections(
            onednn.pack(self.qkv_proj),
            self.qkv_bias,
            onednn.pack(self.o_proj),
            self.o_bias,
            onednn.pack(gate),
            onednn.pack(up),
            onednn.pack(self.down_proj),
        )


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
    """A Llama, Mistral or Qwen2 causal LM; parameters start uninitialised
    and are filled by ``load_weights``.

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
            DecoderLayer(config, dtype=dtype, device=device, float_projections=quantization is None)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = _param(config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        elif quantization is not None:
            self.lm_head = None  # compressed, given by set_quantized
        else:
            self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config, dtype=dtype, device=device)
        # Every batch attends natively where that path works here (None: in torch).
        self.native_attention = NativeAttention.choose(cpu_paths, device, dtype, config.head_dim)
        self._targets = self._weight_targets()

    def invariance(self) -> Invariance:
        """Whether this model, as built and set (``batch_invariant``), gives a
        token the same bits whatever shares its step, and why."""
        device = self.embed_tokens.device
        if device.type != "cpu":
            return Invariance(
                False,
                f"on {device.type}, torch's GEMMs and attention choose their kernels and reduction splits "
                "by the batch's shape (docs/architecture.md, \"Same request, same answer\")",
            )
        made = self._quantized
        if made is None:
            return self._float_invariance(device)
        if made.decode is None or (made.decode_head is None and self.batch_invariant):
            return Invariance(
                False,
                "the projections or LM head run outside the fused native step (no native build, "
                "or a kernel whose arithmetic changes with the row count)",
            )
        isa = next(name for name, index in NATIVE_ISAS.items() if index == made.decode.isa)
        if not self.batch_invariant:
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

    def _float_invariance(self, device: torch.device) -> Invariance:
        """``invariance`` for float projections on CPU: oneDNN's packed
        float32 GEMM gives a row the same bits at every row count from two
        (``onednn.MIN_ROWS``; tests/test_invariance.py), MKL's ``F.linear``
        does not (its kernel and blocking follow the row count); bfloat16
        and float16 models are not checked."""
        packed = self.pack_weights and self._can_pack(device, self.dtype)
        if not packed:
            return Invariance(
                False,
                f"{dtype_name(self.dtype)} projections on F.linear (MKL), whose kernel and blocking follow the "
                "row count (float32 on oneDNN's packed GEMM, or compressed weights on the native kernels, are invariant)",
            )
        if self.dtype != torch.float32:
            return Invariance(
                False,
                f"{dtype_name(self.dtype)} projections on oneDNN's packed GEMM: not checked for invariance "
                "(float32 is, and compressed weights on the native kernels)",
            )
        if self.native_attention is None:
            return Invariance(False, "attention runs in torch, whose kernels follow the batch's shape (no native build)")
        return Invariance(
            True,
            "float32 projections on oneDNN's packed GEMM, whose rows keep their bits at every row count; "
            "attention per token over its own context (native); the rest a row at a time",
        )

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run ``batch``, writing its keys and values into ``kv_cache``.

        Returns float32 logits ``[len(batch.logits_indices), vocab_size]``,
        one row per entry of ``logits_indices``, in that order.
        """
        made = self._projections()
        cos, sin = self.rotary.cos_sin(batch.positions)
        hidden = self.embed(batch.input_ids)
        slots = batch.slot_mapping
        fused = made.decode is not None and made.decode.runs(
            batch.query_lens_cpu, kv_cache.key.dtype, prompts=self.batch_invariant
        )
        if fused:
            tables, lens = token_rows(batch.query_lens_cpu, batch.positions, batch.block_tables, batch.context_lens)
            hidden = made.decode(hidden, cos, sin, kv_cache.key, kv_cache.value, slots, tables, lens)
            if made.decode_head is not None:
                made = attrs.evolve(made, head=made.decode_head)
        else:
            native = self.native_attention
            attend = native.bind(batch, cos, sin) if native is not None and native.runs(hidden, kv_cache.key) else None
            meta = None if attend is not None else AttentionMetadata.build(batch, kv_cache)
            hidden = self._decoder_layers(hidden, made, cos, sin, kv_cache, slots, meta, attend)
        hidden = hidden.index_select(0, batch.logits_indices)
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.lm_logits(hidden, made)

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
        cos, sin = self.rotary.cos_sin(positions)
        hidden = self._decoder_layers(self.embed(input_ids), made, cos, sin, kv_cache, slot_mapping, meta, None)
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.lm_logits(hidden, made)

    def _decoder_layers(
        self,
        hidden: torch.Tensor,
        made: _Made,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None,
        attend: BoundAttention | None,
    ) -> torch.Tensor:
        """The residual stream after every layer."""
        # ``forward`` directly, not through nn.Module's call (hook checks),
        # and each layer's pools from one unbind: a one-stream decode step
        # is bound by such per-layer overheads (docs/benchmarks.md, "A lean
        # decode step").
        for layer, projections, keys, values in zip(self.layers, made.layers, kv_cache.key, kv_cache.value):
            hidden = layer.forward(hidden, projections, cos, sin, keys, values, slot_mapping, meta, attend)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (a tensor-parallel shard
        overrides this and ``lm_logits``: engine/parallel/tensor_parallel.py)."""
        if self._embedding is not None:
            return self._embedding(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    def lm_logits(self, hidden: torch.Tensor, made: _Made) -> torch.Tensor:
        """Float32 logits of the final-normed ``hidden`` rows."""
        if made.head is not None:
            return made.head(hidden).float()
        if made.packed:
            return onednn.linear(hidden, made.lm_head, None, "none").float()
        return F.linear(hidden, made.lm_head).float()

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
        layers: list[QuantizedProjections],
        head: Callable[[torch.Tensor], torch.Tensor] | None,
        embedding: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Run on compressed projections (one per layer) and, when ``head``
        is given, a compressed LM head; else the LM head is ``F.linear``.
        Where the projections run on the native kernels at few rows, decode
        batches of that many rows run all layers in one native call. With
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
            self._targets = self._weight_targets()
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
                    self._made = None  # packed copies are stale
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
        if self.lm_head is None:
            del targets["lm_head.weight"]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            if layer.qkv_proj is None:  # quantized: the projections load through engine/loading/compressed.py
                targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, None, None)
                targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None, None)
                continue
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
