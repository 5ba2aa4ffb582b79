"""What each sequence needs from the block pool, and what it already has (prefix cache hits)."""

from __future__ import annotations

from engine.block_hash import hash_blocks, salted_seed
from engine.core.block_pool import BlockPool, NoFreeBlocksError, cdiv
from engine.core.sequence import Sequence


class KVCacheManager:
    """Maps sequences onto the block pool.

    Args:
        pool: the worker's :class:`BlockPool`.
        block_size: tokens per block.
        hash_seed: ``engine.block_hash.hash_seed(...)`` of the served model.
        enable_prefix_caching: reuse cached full blocks across sequences.

    A sequence's block table is replaced by a new list whenever one of its entries changes;
    otherwise it only grows in place.

    Copy-on-write: sequences forked for ``n > 1`` share every block, the partially filled last
    one included; the first write into a shared partial block gives the writer a private copy,
    recorded in :attr:`pending_copies` as ``(src, dst)`` for the model runner to copy before
    the step runs (PagedAttention, section 4.4; docs/references.md).
    """

    def __init__(
        self, pool: BlockPool, block_size: int, hash_seed: bytes, enable_prefix_caching: bool = True
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []
        self._deferred: list[tuple[int, list[int]]] = []  # (step id, blocks freed once it completes)
        self._num_registered: dict[tuple[str, int], int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def prefix_hit_rate(self) -> float:
        """Pool-wide fraction of looked-up prompt tokens served from the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The chained hashes of the full blocks of ``token_ids`` under ``cache_salt``, one per
        block (16 bytes each). Reads only the seed and the block size, which never change: any
        thread may call it (a worker's event loop hashes a prompt while the engine thread runs
        a step, and hands the hashes over with the prompt)."""
        return hash_blocks(token_ids, self.block_size, salted_seed(self.hash_seed, cache_salt))

    def _update_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        if len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else salted_seed(self.hash_seed, seq.cache_salt)
            new_tokens = seq.token_ids[len(hashes) * self.block_size : num_full_blocks * self.block_size]
            hashes.extend(hash_blocks(new_tokens, self.block_size, parent))  # the chain goes on from parent

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Return the longest run of cached blocks that prefixes ``seq`` (not yet referenced).

        At least one token is always left to compute, so that the step produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks)
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (from :meth:`find_cached_blocks`, only for a sequence with no blocks)
        are referenced and counted as computed. Returns ``False`` and changes nothing when the
        pool has too few free blocks.
        """
        bs = self.block_size
        num_computed = seq.num_computed_tokens + len(cached_blocks) * bs
        table_len = len(seq.block_table) + len(cached_blocks)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, bs) - table_len)
        cow = (
            num_new_tokens > 0 and num_computed % bs != 0
            and self.pool.ref_counts[seq.block_table[num_computed // bs]] > 1
        )
        if not (num_new_blocks or cow or cached_blocks):
            return True  # (most decode steps: room in the last block, which is the sequence's own)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + cow + revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.acquire(list(cached_blocks))
            seq.block_table.extend(cached_blocks)
            seq.num_computed_tokens = num_computed
            self._num_registered[seq.key] = len(seq.block_table)
        if cow:
            index = num_computed // bs
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((seq.block_table[index], copy))
            self.pool.free([seq.block_table[index]])
            # A new list: a table changes only by growing in place (what the model runner's
            # input buffers rely on to rewrite a row's new blocks only).
            seq.block_table = [*seq.block_table[:index], copy, *seq.block_table[index + 1:]]
        seq.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count a first admission's prompt tokens and hits for the hit-rate statistics."""
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publish ``seq``'s newly completed full blocks to the prefix cache: those within its
        first ``num_computed`` tokens (default: ``seq.num_computed_tokens``), whose KV a
        completed step wrote and whose token ids are on the host."""
        if not self.enable_prefix_caching:
            return
        num_computed = seq.num_computed_tokens if num_computed is None else num_computed
        num_full = min(num_computed, seq.num_tokens) // self.block_size
        done = self._num_registered.get(seq.key, 0)
        if num_full <= done:
            return
        self._update_hashes(seq, num_full)
        for i in range(done, num_full):
            self.pool.cache(seq.block_table[i], seq.block_hashes[i])
        self._num_registered[seq.key] = num_full

    def reserve(self, prompt_token_ids: list[int], headroom_blocks: int = 0, cache_salt: str = "",
                block_hashes: list[bytes] | None = None) -> tuple[list[int], int]:
        """Reserve the blocks of a prompt whose KV another worker will send: the leading full
        blocks the prefix cache holds under ``cache_salt`` are reused (referenced, nothing to
        send), the rest are allocated, while ``headroom_blocks`` stay free. ``block_hashes``:
        the prompt's :meth:`block_hashes`, when the caller has them (``None``: computed here).

        Returns:
            ``(block_ids, num_cached)``: one block per position of the prompt, the first
            ``num_cached`` of them already holding their KV.

        Raises:
            NoFreeBlocksError: the pool cannot hold them now; nothing is taken.
        """
        bs = self.block_size
        needed = cdiv(len(prompt_token_ids), bs)
        cached = []
        if self.enable_prefix_caching:
            if block_hashes is None:
                block_hashes = self.block_hashes(prompt_token_ids, cache_salt)
            for block_hash in block_hashes:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                cached.append(block)
        revived = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        fresh = needed - len(cached)
        if fresh + revived + headroom_blocks > self.pool.num_free_blocks:
            raise NoFreeBlocksError(
                f"{len(prompt_token_ids)} tokens need {fresh + revived} more blocks ({len(cached)} cached) plus "
                f"{headroom_blocks} of headroom for running sequences; {self.pool.num_free_blocks} free")
        self.pool.acquire(cached)
        self.prefix_queries += len(prompt_token_ids)
        self.prefix_hits += len(cached) * bs
        return cached + self.pool.allocate(fresh), len(cached)

    def adopt(self, seqs: list[Sequence], block_ids: list[int], num_computed_tokens: int) -> None:
        """Hand reserved blocks, filled with the first ``num_computed_tokens`` tokens' KV, to the
        samples ``seqs`` of one request: the first takes the reservation's reference, each other
        one more (they share the blocks, copy-on-write on the partial last one). The full blocks
        join the prefix cache, so a later request (the next turn of a chat) reuses them."""
        self.pool.acquire(list(block_ids) * (len(seqs) - 1))
        for seq in seqs:
            seq.block_table = list(block_ids)
            seq.num_computed_tokens = num_computed_tokens
            seq.num_cached_tokens = 0
        self.cache_computed_blocks(seqs[0])
        for seq in seqs[1:]:
            seq.block_hashes = list(seqs[0].block_hashes)
            self._num_registered[seq.key] = self._num_registered.get(seqs[0].key, 0)

    def pin(self, block_ids: list[int]) -> None:
        """Add one reference to each block, so it outlives its sequence (a KV transfer in flight)."""
        self.pool.acquire(list(block_ids))

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block: pins, or a reservation that never became a request."""
        self.pool.free(list(block_ids)[::-1])

    def fork(self, parent: Sequence, child: Sequence, num_computed: int) -> None:
        """Make ``child`` share the blocks of ``parent``'s first ``num_computed`` tokens (one more
        reference each): the parent's table may already hold a block for a token of a step
        still in flight, which is the parent's alone."""
        bs = self.block_size
        shared = parent.block_table[:cdiv(num_computed, bs)]
        self.pool.acquire(shared)
        child.block_table = list(shared)
        child.block_hashes = parent.block_hashes[:num_computed // bs]
        child.num_computed_tokens = num_computed
        self._num_registered[child.key] = min(self._num_registered.get(parent.key, 0), num_computed // bs)

    def free(self, seq: Sequence, until_step: int | None = None) -> None:
        """Release all of ``seq``'s blocks (tail first, so its prefix stays cached longest) and
        reset it to nothing computed; with ``until_step``, once :meth:`release_deferred` says
        that step has completed (it still writes them)."""
        blocks = seq.block_table[::-1]
        if until_step is None:
            self.pool.free(blocks)
        elif blocks:
            self._deferred.append((until_step, blocks))
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.key, None)

    def rewind(self, seq: Sequence, num_computed: int) -> None:
        """Keep only the KV of ``seq``'s first ``num_computed`` tokens (speculative decoding:
        the rejected drafts' KV goes): ``num_computed_tokens`` moves back, and the blocks past
        the last one those tokens touch are freed (a new block table, as whenever an entry
        changes). None of the dropped blocks is in the prefix cache: a block is cached only once
        its tokens are on the host, and drafts are not."""
        keep = cdiv(num_computed, self.block_size)
        if keep < len(seq.block_table):
            self.pool.free(seq.block_table[keep:][::-1])
            seq.block_table = seq.block_table[:keep]
        seq.num_computed_tokens = num_computed

    def release_deferred(self, completed_step: int) -> None:
        """Free the blocks :meth:`free` held back for steps up to ``completed_step``."""
        if not self._deferred:
            return
        keep = []
        for step, blocks in self._deferred:
            if step <= completed_step:
                self.pool.free(blocks)
            else:
                keep.append((step, blocks))
        self._deferred = keep
