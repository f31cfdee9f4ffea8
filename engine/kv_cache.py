"""The paged KV cache: per-layer key and value block pools.

The pools may store a narrower dtype than the model computes in (a 16-bit
cache under a float32 model, fp8 under a bfloat16 one: engine/kv_dtype.py).
``to_cache`` rounds keys and values as they are written, ``from_cache``
widens what attention reads back; both are no-ops when the dtypes agree.
An fp8 pool is held as raw bytes (``torch.uint8``) and only viewed as
``float8_e4m3fn`` to convert, because torch's indexing ops (``index_copy_``,
``index_select``) do not all accept float8 tensors on every device, while
bytes go everywhere.
"""

from __future__ import annotations

import attrs
import torch

from .config import ModelConfig

FP8 = torch.float8_e4m3fn
# How a cache dtype is held, where that differs from the dtype itself.
_STORAGE = {FP8: torch.uint8}
# Narrow dtypes saturate at their largest finite value: float16 would turn
# a larger key into inf and e4m3 into NaN, either of which poisons attention.
_SATURATE = {torch.float16: torch.finfo(torch.float16).max, FP8: torch.finfo(FP8).max}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pool of ``dtype`` is allocated in."""
    return _STORAGE.get(dtype, dtype)


def cache_dtype(storage: torch.dtype) -> torch.dtype:
    """The dtype a pool allocated in ``storage`` holds (the inverse of ``storage_dtype``)."""
    return FP8 if storage == torch.uint8 else storage


def to_cache(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x`` rounded into a pool allocated in ``storage`` (saturating)."""
    if x.dtype == storage:
        return x
    dtype = cache_dtype(storage)
    limit = _SATURATE.get(dtype)
    if limit is not None:
        x = x.clamp(-limit, limit)
    x = x.to(dtype)
    return x if dtype == storage else x.view(storage)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What was read from a pool (``x``, in its storage dtype) as ``dtype``."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.uint8:
        x = x.view(FP8)
    return x.to(dtype)


def as_stored(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x`` as a pool allocated in ``storage`` gives it back: rounded, in ``x``'s dtype."""
    return x if x.dtype == storage else from_cache(to_cache(x, storage), x.dtype)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values, in a cache of ``dtype``."""
    elem = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


@attrs.define
class KVCache:
    """Key and value pools, each ``[num_layers, num_blocks, block_size, kv_heads, head_dim]``.

    ``key[layer]`` is the ``[num_blocks, block_size, kv_heads, head_dim]`` pool
    of that layer. One allocation for all layers keeps the pool contiguous and
    lets a slot index (``block_id * block_size + offset``) address a token's
    row in a ``[num_blocks * block_size, kv_heads, head_dim]`` view directly.
    The pools are in ``storage_dtype(dtype)``; ``dtype`` is what they hold.
    """

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(
        cls, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, not empty: decode reads padding blocks under a mask, and
        # garbage there could be NaN, which a zero attention weight keeps (0 * NaN).
        storage = storage_dtype(dtype)
        return cls(
            key=torch.zeros(shape, dtype=storage, device=device),
            value=torch.zeros(shape, dtype=storage, device=device),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the pools hold (float8 for an fp8 pool held as bytes)."""
        return cache_dtype(self.key.dtype)

    @property
    def nbytes(self) -> int:
        """The pools' bytes, keys and values."""
        return self.key.nbytes + self.value.nbytes

    @property
    def token_bytes(self) -> int:
        """Bytes one token's keys and values take in one layer's pools."""
        return 2 * self.key[0, 0, 0].numel() * self.key.element_size()

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[2])
