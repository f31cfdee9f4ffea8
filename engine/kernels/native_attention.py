"""Attention natively: one call per layer instead of some 20 ops.

For every token of a batch (decode rows, a speculative step's
verification, a prompt's chunk), ``decode_attention``
(engine/kernels/csrc/decode.cpp) does what ``DecoderLayer.forward`` does
between the q/k/v projection and the o projection: rotary on q and k, the
new key and value written at the token's slot (rounded as the cache's dtype
rounds them), all of a batch's before any attends, and attention of each
token on its own over its context's blocks, read in place from the pool
and widened as read. The torch path gathers each row's blocks into a
scratch buffer and widens a float16 cache into another before attending:
at 32 rows that moves megabytes per layer that attention then reads back.
For a prompt, per-token attention is quadratic work, as SDPA's causal
kernel is, and measured faster than it (with rotary and the cache write
included) at every length tried, 16 to 4,096 tokens (docs/benchmarks.md).

The model runs its own projections either way, so this serves the float
path and the compressed one alike; it needs the native library
(``quant.native``) and a float32 model on CPU, and its variants are
capability paths (``native_attention_<isa>``) like the native linears.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trioserve.engine.layers.forward_batch import ForwardBatch
from trioserve.engine.kernels import native

# The cache dtypes the op reads and writes.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Query tokens of one sequence the fused decode step (engine/kernels/native_decode.py)
# takes in a step outside batch-invariant mode: a decode row, or a
# speculative step's verification (the proposed tokens plus one). There a
# prompt's chunk goes through the model's layers instead, whose linears keep
# wider activations for it where the fused step's are int8
# (engine/kernels/int4_native.py, call_isa); a batch-invariant model (the default)
# runs every token on the fused step.
MAX_QUERY_TOKENS = 16


def token_rows(
    query_lens: Sequence[int], positions: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, its sequence's block table and its context (its position
    plus one): the op attends each token on its own, and a sequence's new
    keys and values are all written before any of them attends, so a run
    of tokens attends causally."""
    if len(query_lens) == positions.shape[0]:  # one token a sequence: its context is the sequence's
        return block_tables, context_lens
    counts = torch.tensor(query_lens, dtype=torch.int64)
    return block_tables.repeat_interleave(counts, dim=0), positions + 1


def path_name(isa: str) -> str:
    return f"native_attention_{isa}"


@attrs.frozen
class NativeAttention:
    """The native decode attention, on the best ISA variant that works here."""

    isa: int
    op: object

    @classmethod
    def choose(
        cls, cpu_paths: object, device: torch.device | str, dtype: torch.dtype, head_dim: int
    ) -> NativeAttention | None:
        """The best variant ``cpu_paths`` found working, for a float32 CPU
        model whose heads rotary can halve; else None."""
        if torch.device(device).type != "cpu" or dtype != torch.float32 or cpu_paths is None or head_dim % 2:
            return None
        for isa in native.ISA_ORDER:
            if cpu_paths.works(path_name(isa)):  # type: ignore[attr-defined]
                return cls(native.ISAS[isa], native.ops().decode_attention)  # type: ignore[attr-defined]
        return None

    def runs(self, hidden: torch.Tensor, pool: torch.Tensor) -> bool:
        """Whether a batch with these activations and pool runs here."""
        return hidden.dtype == torch.float32 and hidden.device.type == "cpu" and pool.dtype in CACHE_DTYPES

    def bind(self, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> BoundAttention:
        """This forward's tokens, for every layer's call: each token's
        rotary row, slot, block table and context (``token_rows``). A
        token's numbers do not depend on what it is batched with."""
        tokens = batch.num_tokens
        tables, lens = token_rows(batch.query_lens_cpu, batch.positions, batch.block_tables, batch.context_lens)
        return BoundAttention(
            self, cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous(), batch.slot_mapping,
            tables, lens,
        )


@attrs.frozen
class BoundAttention:
    """``NativeAttention`` with one forward's tokens: their rotary rows,
    slots, block tables and contexts."""

    attention: NativeAttention
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def __call__(
        self, qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        """One layer: ``qkv`` ``[tokens, (heads + 2 kv_heads) * head_dim]``
        in, ``[tokens, heads * head_dim]`` out."""
        a = self.attention
        return a.op(  # type: ignore[operator]
            qkv, key_cache, value_cache, self.cos, self.sin, self.slots, self.block_tables, self.context_lens,
            num_heads, scale, a.isa,
        )


def trial(isa: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The op against the model's torch attention (rotary, ``write_kv``,
    ``paged_attention``) on two decode rows over scattered blocks (``capability.Probe``)."""
    from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
    from trioserve.engine.layers.forward_batch import SeqChunk
    from trioserve.engine.layers.kv_cache import KVCache
    from trioserve.engine.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(0)
    # 64-wide heads, three to a KV head, and a context past 16 tokens: the
    # AVX-512 variant's own path for such heads runs (csrc/decode.cpp, attend64).
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 4
    batch = ForwardBatch.build(
        [SeqChunk([5], 18, (3, 1, 4, 0, 5)), SeqChunk([7], 2, (2,))], block_size=block_size, device="cpu"
    )
    pools = KVCache(*(torch.randn(1, 6, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)))
    keys, values = pools.key[0], pools.value[0]
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.randn(2, 1, head_dim // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    got_keys, got_values = keys.clone(), values.clone()
    bound = NativeAttention(native.ISAS[isa], native.ops().decode_attention).bind(batch, cos, sin)  # type: ignore[attr-defined]
    got = bound(qkv, got_keys, got_values, heads, head_dim**-0.5)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(2, heads + kv_heads, head_dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(2, kv_heads, head_dim)
    write_kv(qk[:, heads:], v, keys, values, batch.slot_mapping)
    meta = AttentionMetadata.build(batch, pools)
    want = paged_attention(qk[:, :heads], qk[:, heads:], v, keys, values, meta, scale=head_dim**-0.5)
    return {f"decode_attention({isa})": (got, want), f"decode_attention({isa}) cache": (got_keys, keys)}

