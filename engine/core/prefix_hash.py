"""The chained hashes of a prompt's first full KV blocks, as the prefix cache
keys them (``block_manager.hash_block`` from the same root), for routing a
request to the replica that holds its prefix."""

from __future__ import annotations

from collections.abc import Sequence

from trioserve.engine.core.block_manager import _ROOT_HASH, hash_block


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int, root: int = _ROOT_HASH
) -> list[int]:
    """The hashes of the first ``max_blocks`` full blocks of ``token_ids``
    that a prefix-cache lookup could hit: like the block manager's lookup,
    never the block holding the last token (it is always computed).
    ``root``: the chain's start, ``KVAllocation.root_hash`` (a LoRA
    request's adapter's, ``LoraRef.root_hash``)."""
    num_full = min(max_blocks, max(0, len(token_ids) - 1) // block_size)
    hashes, parent = [], root
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
