"""KV block accounting with prefix caching.

The pool is `num_blocks` fixed-size blocks. Each running sequence owns a block table. A full block whose tokens are
all computed is identified by a hash chained over its parent's hash, its token ids and the request's cache salt, and
registered in `cached`; a later request whose prompt produces the same chain reuses those blocks instead of
recomputing them. Blocks are reference counted: a block with references is never evicted or written by anyone
else. Unreferenced blocks sit in `free_queue`, front = evicted first: blocks that hold nothing reusable go to the
front, cached blocks to the back in the order they were released (LRU). A cached-but-free block counts as free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from inferlab.engine.sequence import Sequence


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update((salt or "").encode() + b"\x00")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per request: chain hashes of its full blocks so far
        self._num_registered: dict[str, int] = {}  # per request: leading blocks already offered to the cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    # -- accounting -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup ----------------------------------------------------------------------------------
    def _chain(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq's tokens. At least the last token stays uncomputed,
        because its logits are needed to sample. A request that wants prompt logprobs gets no hits: it needs the
        logits of every prompt position, so it computes them all (its blocks still enter the cache for others)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._chain(seq, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_total_tokens: int, cached_blocks: list[int] = ()) -> bool:
        table = self.block_tables.get(seq.request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(table) - len(cached_blocks)
        # Cached blocks nobody references sit in the free queue; taking them removes them from it.
        reclaimed = sum(1 for b in cached_blocks if self.blocks[b].ref_cnt == 0)
        return need <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, num_total_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow seq's table so it holds `num_total_tokens` tokens, first taking `cached_blocks` (a prefix hit).
        Returns False, changing nothing, if the pool cannot supply the blocks."""
        if not self.can_allocate(seq, num_total_tokens, cached_blocks):
            return False
        table = self.block_tables.setdefault(seq.request_id, [])
        for b in cached_blocks:
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self.free_queue[b]
            blk.ref_cnt += 1
            table.append(b)
        if cached_blocks:
            self._num_registered[seq.request_id] = len(table)
        for _ in range(self.blocks_needed(num_total_tokens) - len(table)):
            b, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[b]
            if blk.block_hash is not None:  # evict: its content is about to be overwritten
                if self.cached.get(blk.block_hash) == b:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
            blk.ref_cnt = 1
            table.append(b)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly full, fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        table = self.block_tables[seq.request_id]
        hashes = self._chain(seq, num_full)
        for i in range(start, num_full):
            blk = self.blocks[table[i]]
            if blk.block_hash is None and hashes[i] not in self.cached:
                blk.block_hash = hashes[i]
                self.cached[hashes[i]] = blk.block_id
        self._num_registered[seq.request_id] = num_full

    def trim(self, seq: Sequence, num_total_tokens: int) -> None:
        """Release trailing blocks beyond what `num_total_tokens` needs (rejected speculative tokens)."""
        table = self.block_tables.get(seq.request_id)
        if not table:
            return
        keep = self.blocks_needed(num_total_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq: Sequence) -> None:
        """Release everything seq holds. Tail blocks go first so that they are evicted before shared heads."""
        for b in reversed(self.block_tables.pop(seq.request_id, [])):
            self._release(b)
        self._hashes.pop(seq.request_id, None)
        self._num_registered.pop(seq.request_id, None)

    def reset_request_hashes(self, seq: Sequence) -> None:
        self._hashes.pop(seq.request_id, None)

    def _release(self, b: int) -> None:
        blk = self.blocks[b]
        blk.ref_cnt -= 1
        assert blk.ref_cnt >= 0, f"block {b} released more often than taken"
        if blk.ref_cnt == 0:
            self.free_queue[b] = None
            if blk.block_hash is None:  # nothing reusable in it: first in line for reuse
                self.free_queue.move_to_end(b, last=False)
