"""The scheduler and the KV cache manager without a model: the token budget, the order of
preemption, copy-on-write of a shared partial block, and pins that outlive their sequence."""

from __future__ import annotations

from engine.block_hash import hash_seed
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks: int, budget: int = 64, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, hash_seed("test", BS, "float32"))
    return Scheduler(kv, max_num_seqs, budget, max_model_len=1024)


def seq(arrival: int, prompt_len: int, request_id: str | None = None, n: int = 1) -> Sequence:
    tokens = [100 * arrival + i for i in range(prompt_len)]  # distinct prompts: no prefix hits
    return Sequence(request_id or f"r{arrival}", 0, tokens, prompt_len, SamplingParams(n=n), arrival)


def run(sched: Scheduler, sampled_token: int = 7) -> list[tuple[str, int]]:
    """One step as the engine runs it (minus the model): advance, append a token to sampled ones."""
    step = sched.schedule()
    sampled = [x for s in step.scheduled if s.samples for x in (s.seq, *s.forks)]
    for s in step.scheduled:
        sched.kv.cache_computed_blocks(s.seq, s.num_computed_after)
    sched.complete(step)
    for x in sampled:
        x.num_output_placeholders -= 1
        x.token_ids.append(sampled_token)
    return [(s.seq.request_id, s.num_new_tokens) for s in step.scheduled]


def test_token_budget_splits_prompts_into_chunks_and_puts_decodes_first():
    sched = make(num_blocks=64, budget=10)
    a, b = seq(0, 6), seq(1, 9)
    sched.add(a)
    sched.add(b)
    assert run(sched) == [("r0", 6), ("r1", 4)]  # FCFS; b gets what is left of the budget
    # a decodes (1 token, listed first), b continues its prefill with the rest of its prompt
    assert run(sched) == [("r0", 1), ("r1", 5)]
    assert run(sched) == [("r0", 1), ("r1", 1)]
    assert all(s.start == s.seq.num_tokens - 1 for s in sched.schedule().scheduled)


def test_max_num_seqs_bounds_the_running_batch():
    sched = make(num_blocks=64, budget=100, max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 3))
    assert [rid for rid, _ in run(sched)] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_newest_running_sequence_is_preempted_first_and_recomputed_later():
    sched = make(num_blocks=4, budget=100)
    old, new = seq(0, 8), seq(1, 7)  # 2 blocks each: the pool is full after the prefills
    sched.add(old)
    sched.add(new)
    run(sched)
    assert sched.kv.pool.num_free_blocks == 0
    # old's 9th token needs a third block: the newest sequence gives its blocks up
    assert run(sched) == [("r0", 1)]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    sched.finish(old)
    # recomputed from its tokens (prompt + the sampled one); its first full block is still in
    # the prefix cache, so only the other 4 tokens are computed again
    assert run(sched) == [("r1", 4)]
    sched.kv.pool.check_invariants()


def test_forked_samples_share_blocks_and_copy_the_partial_one_on_write():
    sched = make(num_blocks=16)
    parent = seq(0, 6, n=3)
    parent.forks = [Sequence("r0", i, list(parent.token_ids), 6, parent.params, 0) for i in (1, 2)]
    sched.add(parent)
    run(sched)  # prompt computed: the children join, sharing both blocks
    children = [s for s in sched.running if s is not parent]
    assert len(children) == 2 and all(c.block_table == parent.block_table for c in children)
    pool = sched.kv.pool
    assert [pool.ref_counts[b] for b in parent.block_table] == [3, 3]
    partial = parent.block_table[1]
    step = sched.schedule()  # each sample writes its 7th token into the shared partial block
    # two writers get a private copy of it, the last one keeps the original
    assert [src for src, _ in step.block_copies] == [partial, partial]
    assert len({s.block_table[1] for s in [parent, *children]}) == 3
    assert len({s.block_table[0] for s in [parent, *children]}) == 1  # full block stays shared
    pool.check_invariants()


def test_pinned_blocks_outlive_their_sequence_until_released():
    sched = make(num_blocks=4)
    a = seq(0, 8)
    sched.add(a)
    run(sched)
    blocks = list(a.block_table)
    sched.kv.pin(blocks)
    sched.finish(a)
    pool = sched.kv.pool
    assert pool.num_free_blocks == 2 and all(pool.ref_counts[b] == 1 for b in blocks)
    sched.kv.release_blocks(blocks)
    assert pool.num_free_blocks == 4
    pool.check_invariants()
