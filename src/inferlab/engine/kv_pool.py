"""How many KV blocks the pool gets.

`--kv-cache-memory` sets the pool's bytes outright. Without it the pool is what the configuration can use at most,
`--max-num-seqs` sequences each at the full context (`--max-model-len`, default the model's), as llama.cpp's
server sizes its pool (slots x context), capped by the old default, min(1 GiB, 20% of free memory), so that a long
context x many sequences does not claim the machine. A pool beyond that product could never be filled: the
scheduler runs at most max_num_seqs sequences and none grows past max_model_len.

Where the cap binds (SmolLM2-135M in bf16: 64 x 8192 tokens would be 11 GiB; the cap gives 1 GiB, 46,600 tokens),
the pool is shared: blocks go to whoever needs them, and a sequence that finds none is preempted and recomputed
later (engine/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CAP_BYTES = 2**30
DEFAULT_CAP_FREE_SHARE = 0.2


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    reason: str  # for the startup log: which rule set the size


def default_cap_bytes(free_bytes: int) -> int:
    return min(DEFAULT_CAP_BYTES, int(DEFAULT_CAP_FREE_SHARE * free_bytes))


def size_kv_pool(block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 kv_cache_memory: int | None, free_bytes: int) -> KVPoolSize:
    """block_bytes: the pool bytes of one block (all layers, K and V); free_bytes: what the device can still give."""
    if block_bytes < 1 or block_size < 1:
        raise ValueError(f"a KV block needs a positive size, got {block_bytes} bytes for {block_size} tokens")
    if kv_cache_memory is not None:
        if kv_cache_memory < block_bytes:
            raise ValueError(f"--kv-cache-memory {kv_cache_memory} B holds no KV block ({block_bytes} B each "
                             f"for this model); give at least {block_bytes} B")
        return KVPoolSize(kv_cache_memory // block_bytes, "--kv-cache-memory")
    per_seq = -(-max_model_len // block_size)
    wanted = max_num_seqs * per_seq
    cap = max(1, default_cap_bytes(free_bytes) // block_bytes)
    if wanted <= cap:
        return KVPoolSize(wanted, f"{max_num_seqs} sequences x {max_model_len} tokens (--max-num-seqs x context)")
    return KVPoolSize(cap, f"capped at min(1 GiB, {DEFAULT_CAP_FREE_SHARE:.0%} of free memory); "
                           f"{max_num_seqs} x {max_model_len} tokens would need {wanted} blocks")
