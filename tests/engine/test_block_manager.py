"""Block manager and prefix cache, without a model: exact ids, hits, eviction order, and invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.sequence import Sequence


def seq(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), RequestMetrics(0.0), cache_salt=salt)


def admit(bm: BlockManager, s: Sequence) -> int:
    """What the scheduler does on admission: take the cached prefix, allocate the rest, compute it all."""
    hits = bm.find_cached_prefix(s)
    assert bm.allocate(s, s.num_tokens, hits)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return len(hits) * bm.block_size


def test_allocation_is_exact_and_free_returns_everything():
    bm = BlockManager(10, 4)
    a = seq("a", range(10))  # 10 tokens -> 3 blocks
    assert bm.allocate(a, 10)
    assert bm.table("a") == [0, 1, 2] and bm.num_free_blocks == 7
    assert bm.allocate(a, 13)  # grows by one block
    assert bm.table("a") == [0, 1, 2, 3] and bm.num_free_blocks == 6
    b = seq("b", range(100, 124))
    assert not bm.allocate(b, 28)  # needs 7, only 6 free: refused, nothing changed
    assert bm.num_free_blocks == 6 and bm.table("b") == []
    bm.free(a)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_prefix_hits_are_exact_and_last_token_is_recomputed():
    bm = BlockManager(32, 4)
    shared = list(range(1000, 1012))  # 3 full blocks
    assert admit(bm, seq("a", shared + [1, 2])) == 0
    # Same 12-token prefix: 3 blocks hit.
    assert admit(bm, seq("b", shared + [7, 8, 9])) == 12
    # Identical prompt of exactly 12 tokens: the last token must be computed, so only 2 blocks (8 tokens) hit.
    assert admit(bm, seq("c", shared)) == 8
    # Diverges inside the second block: only the first block hits.
    assert admit(bm, seq("d", shared[:6] + [0] * 6)) == 4
    assert bm.prefix_hits == 0  # counters are the scheduler's job (record_lookup), not find's
    assert bm.table("b")[:3] == bm.table("a")[:3]


def test_salts_isolate_tenants():
    bm = BlockManager(32, 4)
    prefix = list(range(50, 70))
    admit(bm, seq("t1", prefix + [1], salt="tenant-1"))
    assert admit(bm, seq("t2", prefix + [1], salt="tenant-2")) == 0
    assert admit(bm, seq("t1b", prefix + [2], salt="tenant-1")) == 20
    assert admit(bm, seq("nosalt", prefix + [3])) == 0


def test_freed_cached_blocks_survive_until_needed_then_lru_goes_first():
    bm = BlockManager(8, 4)
    old, new = seq("old", list(range(0, 8)) + [99]), seq("new", list(range(20, 28)) + [99])
    admit(bm, old)  # blocks 0,1 cached (+ block 2 partial)
    admit(bm, new)  # blocks 3,4 cached (+ block 5 partial)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 8  # cached-but-free counts as free
    # 3 fresh blocks: first the two never-cached partial blocks and one untouched block, no cached block evicted.
    filler = seq("fill", list(range(500, 512)))
    assert bm.allocate(filler, 12)
    assert set(bm.table("fill")) == {2, 5, 6}
    # Two more blocks: block 7, then the least recently freed cached block. "old" was freed first, and within it
    # the tail block goes first, so block 1 is evicted while old's first block (0) and all of "new" survive.
    assert bm.allocate(filler, 20)
    assert bm.table("fill")[3:] == [7, 1]
    assert bm.find_cached_prefix(seq("old-again", list(range(0, 8)) + [5])) == [0]
    assert admit(bm, seq("new-again", list(range(20, 28)) + [5])) == 8


def test_referenced_cached_blocks_are_never_evicted():
    bm = BlockManager(4, 4)
    a = seq("a", list(range(9)))
    admit(bm, a)  # holds 3 blocks, 2 of them cached
    b = seq("b", list(range(100, 108)))
    assert not bm.allocate(b, 8)  # 1 free block, a's cached blocks are referenced
    assert bm.allocate(b, 4)
    assert set(bm.table("b")).isdisjoint(bm.table("a"))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7), st.integers(1, 40),
                          st.integers(0, 2)), max_size=60))
def test_property_no_leak_no_double_allocation(ops):
    bm = BlockManager(24, 4)
    live: dict[str, Sequence] = {}
    prefixes = [list(range(1000, 1040)), list(range(2000, 2040)), list(range(3000, 3040))]
    for op, key, n, pfx in ops:
        rid = f"r{key}"
        if op == "add" and rid not in live:
            s = seq(rid, prefixes[pfx][:n] + [key])
            hits = bm.find_cached_prefix(s)
            if bm.allocate(s, s.num_tokens, hits):
                s.num_computed_tokens = s.num_tokens
                bm.cache_computed_blocks(s)
                live[rid] = s
        elif op == "grow" and rid in live:
            s = live[rid]
            s.token_ids.extend(range(n))
            if bm.allocate(s, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
                bm.cache_computed_blocks(s)
            else:
                del s.token_ids[-n:]
        elif op == "free" and rid in live:
            bm.free(live.pop(rid))
        # Invariants after every operation.
        held = [b for s in live.values() for b in bm.table(s.request_id)]
        refs: dict[int, int] = {}
        for b in held:
            refs[b] = refs.get(b, 0) + 1
        for blk in bm.blocks:
            assert blk.ref_cnt == refs.get(blk.block_id, 0)  # exact reference counts
            assert (blk.block_id in bm.free_queue) == (blk.ref_cnt == 0)  # free iff unreferenced: no leak
        for s in live.values():  # no block is shared unless it is a cached (hashed) block
            for b in bm.table(s.request_id):
                assert refs[b] == 1 or bm.blocks[b].block_hash is not None
        for h, b in bm.cached.items():
            assert bm.blocks[b].block_hash == h
    for s in list(live.values()):
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
