"""Block pool invariants under random allocate / acquire / free / fork / cache / evict sequences."""

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_hash import hash_blocks, hash_seed
from engine.core.block_pool import BlockPool, NoFreeBlocksError

NUM_BLOCKS = 12

operations = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "fork", "cache", "hit"]), st.integers(0, 1000)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_random_operations_keep_invariants(ops):
    pool = BlockPool(NUM_BLOCKS)
    owners: list[list[int]] = []  # each owner holds one reference per listed block
    for op, arg in ops:
        if op == "alloc":
            count = arg % 4 + 1
            if count > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(count)
            else:
                blocks = pool.allocate(count)
                assert len(set(blocks)) == count
                assert not any(b in o for o in owners for b in blocks), "block handed out twice"
                owners.append(blocks)
        elif op == "free" and owners:
            pool.free(owners.pop(arg % len(owners))[::-1])
        elif op == "fork" and owners:
            blocks = owners[arg % len(owners)]
            pool.acquire(blocks)
            owners.append(list(blocks))
        elif op == "cache" and owners:
            blocks = owners[arg % len(owners)]
            block = blocks[arg % len(blocks)]
            pool.cache(block, hash_blocks([arg], 1, b"seed")[0])
        elif op == "hit":
            block = pool.lookup(hash_blocks([arg], 1, b"seed")[0])
            if block is not None:
                pool.acquire([block])
                owners.append([block])
        pool.check_invariants()
        refs = [0] * NUM_BLOCKS
        for o in owners:
            for b in o:
                refs[b] += 1
        assert refs == pool.ref_counts
    for o in owners:
        pool.free(o)
    pool.check_invariants()
    assert pool.num_free_blocks == NUM_BLOCKS


def test_lru_eviction_prefers_least_recently_freed():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, tag in ((a, 1), (b, 2), (c, 3)):
        pool.cache(block, hash_blocks([tag], 1, b"s")[0])
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first == b
    assert pool.lookup(hash_blocks([2], 1, b"s")[0]) is None
    assert pool.lookup(hash_blocks([1], 1, b"s")[0]) == a
    events = pool.drain_events()
    assert events.removed == [hash_blocks([2], 1, b"s")[0]]
    assert len(events.stored) == 3


def test_double_free_is_rejected():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])


def test_block_hash_chain_depends_on_whole_prefix():
    seed = hash_seed("m", 4, "float32")
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seed)
    b = hash_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4, seed)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1], "same second block after different first blocks must differ"
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, seed, parent=a[0], start=4) == [a[1]]
    assert hash_seed("m", 8, "float32") != seed
    assert len(a[0]) == 16


def test_block_hash_is_the_documented_blake2b_chain():
    """``h_i = BLAKE2b-128(h_{i-1} || le_uint32(tokens of block i))`` (docs/architecture.md),
    written out here with ``struct``: the Redis index and every process key blocks by it."""
    seed = hash_seed("m", 4, "float32")
    tokens = [7, 2**32 - 1, 0, 65536, 3, 1, 4, 1, 5, 9]
    expected, parent = [], seed
    for begin in (0, 4):
        parent = hashlib.blake2b(parent + struct.pack("<4I", *tokens[begin:begin + 4]), digest_size=16).digest()
        expected.append(parent)
    assert hash_blocks(tokens, 4, seed) == expected


def test_uncached_blocks_come_in_runs_of_consecutive_ids_from_the_lowest():
    pool = BlockPool(32)
    assert pool.allocate(20) == list(range(20))
    pool.free([10, 11, 12, 13, 14, 3])
    assert pool.allocate(0) == []
    assert pool.allocate(7) == [3, 10, 11, 12, 13, 14, 20]
    pool.free([3])
    assert pool.allocate(1) == [3]
    pool.check_invariants()
