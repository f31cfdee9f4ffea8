"""The KV cache's dtypes by their users' names, and the trial of a 16-bit
cache (``kv_cache_<dtype>`` in ``capability.PROBES``): a write into a
paged pool, a gather and an attention over it, checked against float32.
``kv_dtype_choice`` chooses among the dtypes whose trial passes."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trioserve.engine.layers.attention import write_kv
from trioserve.engine.layers.kv_cache import FP8, from_cache, storage_dtype, to_cache

# The dtypes a cache may hold, by the names users give them.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": FP8}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The user's name of a cache dtype (``fp8`` for float8 e4m3)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def kv_path(dtype: torch.dtype) -> str:
    """The name of the capability path of a 16-bit cache of ``dtype``."""
    return f"kv_cache_{kv_dtype_name(dtype)}"


@attrs.frozen
class _PagedTrial:
    """Pools of one dtype and scattered block ids for ``rows`` sequences of
    ``context`` tokens: what a decode layer's attention works on."""

    key_pool: torch.Tensor
    value_pool: torch.Tensor
    blocks: torch.Tensor  # each row's blocks, row-major
    slots: torch.Tensor  # each token's slot

    @classmethod
    def build(cls, dtype: torch.dtype, rows: int, context: int, heads: int, dim: int, block: int) -> _PagedTrial:
        count = rows * (context // block)
        # Every other block, in reverse: the slots are not in order.
        blocks = torch.arange(2 * count - 2, -1, -2)
        slots = (blocks[:, None] * block + torch.arange(block)).flatten()
        shape = (2 * count, block, heads, dim)
        storage = storage_dtype(dtype)
        return cls(torch.zeros(shape, dtype=storage), torch.zeros(shape, dtype=storage), blocks, slots)

    def run(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``keys`` / ``values`` (``[rows, context, heads, dim]``) with
        the engine's ``write_kv``, gather each row's blocks back, widen them
        to ``query``'s dtype and attend ``query`` (``[rows, heads, 1, dim]``)."""
        rows, context, heads, dim = keys.shape
        write_kv(keys.reshape(-1, heads, dim), values.reshape(-1, heads, dim), self.key_pool, self.value_pool, self.slots)
        k = torch.index_select(self.key_pool, 0, self.blocks).view(rows, context, heads, dim).transpose(1, 2)
        v = torch.index_select(self.value_pool, 0, self.blocks).view(rows, context, heads, dim).transpose(1, 2)
        k, v = from_cache(k, query.dtype), from_cache(v, query.dtype)
        return F.scaled_dot_product_attention(query, k, v)


def _inputs(rows: int, context: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, 1, dim, generator=gen)
    keys = torch.randn(rows, context, heads, dim, generator=gen)
    values = torch.randn(rows, context, heads, dim, generator=gen)
    return query, keys, values


def trial(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A cache of ``dtype`` on tiny inputs: what is read back after a write,
    and attention over it, each with its float32 reference."""
    query, keys, values = _inputs(2, 32, 2, 16)
    stored = from_cache(to_cache(keys, storage_dtype(dtype)), torch.float32)
    reference = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2))
    return {
        "round trip": (stored, keys),
        "paged attention": (_PagedTrial.build(dtype, 2, 32, 2, 16, block=4).run(query, keys, values), reference),
    }
