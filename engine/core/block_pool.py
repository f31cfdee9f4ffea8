"""One group's blocks: reference counts, the free queue, the cached-content index.

``BlockManager`` (block_manager.py) keeps one ``BlockPool`` for the layers
that attend to the whole context and, for a model with sliding-window
layers, a second one for those (the window group). Each pool's block ids
address that group's own KV tensors (engine/layers/kv_cache.py).

The free queue orders the blocks no request holds: blocks without cached
content first (reusing them loses nothing), then cached ones from least to
most recently released (LRU). A block in use is never in the queue, so never
evicted. The blocks never handed out are in id order, behind those freed
without content: taken lowest id first, so the blocks ever used are always
ids ``0 .. num_written - 1``.

``reuse_written_first`` (a CPU pool, whose memory is committed as a block
is first written): a written block is taken, evicting the least recently
used cached one, before a block never written, so resident memory grows
only with the most blocks held at once.

``num_reserved`` leading ids are never handed out: the window group's id 0
is the null block that stands, in a block table, for a block released
because it fell out of the window (never written, always masked).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import attrs


@attrs.define
class Block:
    """A block's state in its pool."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block's content is in the cache


@attrs.define
class BlockPool:
    """``num_blocks`` blocks, ``num_reserved`` of them never handed out."""

    num_blocks: int
    reuse_written_first: bool = attrs.field(default=False, kw_only=True)
    num_reserved: int = attrs.field(default=0, kw_only=True)
    blocks: list[Block] = attrs.field(init=False)
    # Insertion order is eviction order: the front is reused first.
    free: collections.OrderedDict[int, None] = attrs.field(init=False)
    # The free queue's cached blocks, in the same (LRU) order.
    evictable: collections.OrderedDict[int, None] = attrs.field(init=False, factory=collections.OrderedDict)
    num_written: int = attrs.field(init=False)  # ids below it were handed out (or are reserved)
    cached: dict[int, int] = attrs.field(init=False, factory=dict)  # block hash -> block id
    num_evictions: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.num_reserved < self.num_blocks:
            raise ValueError(f"num_reserved must be in [0, num_blocks), got {self.num_reserved}")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = collections.OrderedDict.fromkeys(range(self.num_reserved, self.num_blocks))
        self.num_written = self.num_reserved

    @property
    def num_usable(self) -> int:
        """Blocks that can be handed out (all but the reserved)."""
        return self.num_blocks - self.num_reserved

    def take(self) -> int:
        """A free block for new content, held once: the queue's front, or,
        with ``reuse_written_first``, the least recently used cached block
        before one never written. Its cached content, if any, is evicted."""
        block_id = next(iter(self.free))
        if self.reuse_written_first and block_id >= self.num_written and self.evictable:
            block_id = next(iter(self.evictable))
        del self.free[block_id]
        self.num_written = max(self.num_written, block_id + 1)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        if block.block_hash is not None:
            del self.evictable[block_id]
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def hit_cost(self, block_id: int) -> int:
        """Free blocks that holding this cached block costs: 1 when no one
        holds it (it leaves the free queue), else 0."""
        return 1 if self.blocks[block_id].ref_count == 0 else 0

    def acquire(self, block_id: int) -> None:
        """Hold a cached block once more (a prefix-cache hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            del self.evictable[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one hold of a block; at none it joins the free queue, at the
        front without content, at the back (most recently used) with."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed with ref_count {block.ref_count}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:
                self.free.move_to_end(block_id, last=False)
            else:
                self.evictable[block_id] = None

    def cache(self, block_id: int, block_hash: int) -> None:
        """Index a held block's content under ``block_hash``, unless another
        block has that content already (the index maps a hash to one block)."""
        if block_hash in self.cached:
            return
        block = self.blocks[block_id]
        assert block.block_hash is None, f"block {block_id} committed twice"
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def forget(self) -> None:
        """Drop every block's cached content; the free queue goes back to id
        order, lowest first, as on a fresh pool (its tensors are replaced by
        a fresh pool, none of its pages written)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.evictable.clear()
        self.free = collections.OrderedDict.fromkeys(sorted(self.free))

    def check(self, tables: Mapping[str, list[int]], what: str) -> None:
        """Raise ``AssertionError`` if the reference counts differ from
        ``tables`` (request id -> the ids it holds in this pool), a block is
        leaked or freed twice, or the cache index is inconsistent; ``what``
        prefixes "block" in the message ("" or "window ")."""
        for rid, table in tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} holds a {what}block twice: {table}")
            if any(b < self.num_reserved for b in table):
                raise AssertionError(f"request {rid!r} holds a reserved {what}block: {table}")
        counts = collections.Counter(b for table in tables.values() for b in table)
        for block in self.blocks[self.num_reserved :]:
            held = counts.get(block.block_id, 0)
            if block.ref_count != held:
                raise AssertionError(f"{what}block {block.block_id} has ref_count {block.ref_count} but {held} holder(s)")
            in_free = block.block_id in self.free
            if held == 0 and not in_free:
                raise AssertionError(f"{what}block {block.block_id} is leaked: no holder and not in the free queue")
            if held > 0 and in_free:
                raise AssertionError(f"{what}block {block.block_id} is in the free queue but held {held} time(s)")
            if block.block_hash is not None and self.cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"{what}block {block.block_id} has a hash the cache index does not map to it")
        if any(b < self.num_reserved for b in self.free):
            raise AssertionError(f"a reserved {what}block is in the free queue")
        evictable = [b for b in self.free if self.blocks[b].block_hash is not None]
        if list(self.evictable) != evictable:
            raise AssertionError(
                f"the evictable {what}blocks {list(self.evictable)} differ from the free queue's cached ones {evictable}"
            )
        for block_hash, block_id in self.cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cache index maps a hash to {what}block {block_id}, which holds other content")
        if len(self.free) + sum(1 for b in self.blocks if b.ref_count > 0) != self.num_usable:
            raise AssertionError(f"free and held {what}blocks do not add up to {self.num_usable}")
