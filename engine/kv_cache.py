"""The paged KV cache: per-layer key and value block pools."""

from __future__ import annotations

import attrs
import torch

from .config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


@attrs.define
class KVCache:
    """Key and value pools, each ``[num_layers, num_blocks, block_size, kv_heads, head_dim]``.

    ``key[layer]`` is the ``[num_blocks, block_size, kv_heads, head_dim]`` pool
    of that layer. One allocation for all layers keeps the pool contiguous and
    lets a slot index (``block_id * block_size + offset``) address a token's
    row in a ``[num_blocks * block_size, kv_heads, head_dim]`` view directly.
    """

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(
        cls, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[2])
