"""The block pool: reference counts, the free list, and cached blocks by hash.

The only code that changes a block's reference count. A block with no references stays in
the prefix cache (if it has a hash) until the pool needs it: the free list is kept in LRU
order (vLLM v1's ``BlockPool`` design). :meth:`BlockPool.allocate` hands out free blocks that
cache nothing first, so a cached prefix is evicted only when no such block is left, and
several blocks at once as runs of consecutive ids where it can (lowest free id first, each run
extended while the next id is free): a block-major pool makes a run one span of bytes, one
descriptor of a KV transfer instead of one per block. Only then does it take cached blocks from
the head of the LRU list, evicting their hashes. Every operation costs O(blocks touched · log
num_blocks), never a pass over the pool: the decode loop allocates for every sequence each step.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: blocks needed for ``a`` tokens of ``b`` per block."""
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass
class BlockEvents:
    """Hashes of blocks that entered or left the prefix cache since the last drain."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class BlockPool:
    """``num_blocks`` physical KV blocks: allocation, sharing, prefix caching and LRU eviction.

    Args:
        num_blocks: blocks in the pool (>= 1).

    Invariants (checked by ``check_invariants`` in tests): a block is in the free list iff its
    reference count is 0; a hash maps to exactly one block and that block carries the hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_uncached: set[int] = set(range(num_blocks))  # free blocks with no hash
        # A min-heap over _free_uncached's ids; it may also hold stale ids (taken since they were
        # pushed), skipped when popped.
        self._uncached_heap: list[int] = list(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._events = BlockEvents()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (evictable cached blocks included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` unreferenced blocks: those caching nothing first (in runs of consecutive
        ids, from the lowest free one), then cached ones least recently freed first, evicting
        their hashes.

        Returns:
            The block ids, each now referenced once.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free; nothing is taken.
        """
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = self._uncached_runs(count)
        while len(blocks) < count:
            block = next(iter(self._free))
            blocks.append(block)
            self._take(block)
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def _uncached_runs(self, count: int) -> list[int]:
        """Take up to ``count`` free uncached blocks: the lowest free id, then the ids after it
        while they are free, then the next lowest, and so on."""
        blocks: list[int] = []
        free, heap = self._free_uncached, self._uncached_heap
        while len(blocks) < count and free:
            block = heapq.heappop(heap)
            while block in free and len(blocks) < count:
                self._take(block)
                blocks.append(block)
                block += 1
        if len(heap) > 2 * len(free) + 1024:  # too many stale ids: rebuild (a sorted list is a heap)
            self._uncached_heap = sorted(free)
        return blocks

    def _take(self, block: int) -> None:
        """Take a free block off the free lists, evicting its hash if it caches one."""
        del self._free[block]
        self._free_uncached.discard(block)
        self._evict(block)

    def acquire(self, blocks: list[int]) -> None:
        """Add one reference to each block (a prefix-cache hit or a fork), taking unreferenced
        ones off the free list."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
                self._free_uncached.discard(block)
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list's tail in
        the given order (pass a sequence's blocks tail first so its prefix is evicted last).

        Raises:
            ValueError: a block is not referenced (a double free).
        """
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free_uncached.add(block)
                    heapq.heappush(self._uncached_heap, block)

    def lookup(self, block_hash: bytes) -> int | None:
        """Return the block caching ``block_hash``, or ``None``."""
        return self._cached.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a referenced, fully computed block under ``block_hash``. If another block
        already caches that hash, the pool keeps the existing one and this block stays private."""
        if self.block_hash[block] is not None or block_hash in self._cached:
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block
        self._events.stored.append(block_hash)

    def drain_events(self) -> BlockEvents:
        """Return and clear the stored/removed hash events (for the Redis prefix index)."""
        events, self._events = self._events, BlockEvents()
        return events

    def cached_hashes(self) -> list[bytes]:
        """Every hash currently in the prefix cache (for a full resync of the index)."""
        return list(self._cached)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            self.block_hash[block] = None
            del self._cached[block_hash]
            self._events.removed.append(block_hash)

    def check_invariants(self) -> None:
        """Assert the pool's invariants (for tests).

        Raises:
            AssertionError: an invariant is broken.
        """
        assert all(count >= 0 for count in self.ref_counts)
        free = set(self._free)
        assert free == {b for b, c in enumerate(self.ref_counts) if c == 0}
        assert self._free_uncached == {b for b in free if self.block_hash[b] is None}
        for block_hash, block in self._cached.items():
            assert self.block_hash[block] == block_hash
        assert sum(h is not None for h in self.block_hash) == len(self._cached)
