"""Prefix cache: finished requests keep their KV under a parked sequence id until memory or ids
run short, and a new request starts from the longest token prefix resident anywhere (a parked
entry or a running sequence) instead of recomputing it.

Parking moves the finished sequence's KV out of the running id range (kvpool.py says why);
starting from a prefix copies it with `kv_copy` into the new request's own id: with per-sequence
KV streams (the default) that copies cells, in a unified pool it shares them and costs no memory.
The entry stays, so the next request with the same system prompt hits it too. Matching is exact on
token ids, and at least two prompt tokens are always computed (see `lookup`), so a hit never
changes the output -- only how many prompt tokens have to be computed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence as Seq

from .kvpool import KVHolder, KVPool


# Shorter hits are ignored: a few tokens save nothing worth a copy, and a hit on a parked entry can
# cost that entry its tail when ids run short (a BOS token alone would match every prompt).
MIN_HIT = 4


class CachedPrefix:
    """A parked sequence id: its KV holds `tokens` at positions 0..len-1."""

    __slots__ = ("seq_id", "cells", "tokens")

    def __init__(self, seq_id: int, cells: list[int], tokens: list[int]):
        self.seq_id = seq_id
        self.cells = cells
        self.tokens = tokens

    @property
    def num_computed(self) -> int:
        return len(self.tokens)


def common_prefix(a: Seq[int], b: Seq[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`. Binary search over slice
    comparisons: they run in C, so a 4k-token prompt costs ~12 comparisons, not 4k Python steps."""
    hi = min(len(a), len(b), limit)
    if hi <= 0 or a[0] != b[0]:
        return 0
    if a[:hi] == b[:hi]:
        return hi
    lo = 1  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    def __init__(self, pool: KVPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self.parked: OrderedDict[int, CachedPrefix] = OrderedDict()  # seq_id -> entry, LRU first
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    def park(self, holder: KVHolder, tokens: list[int]) -> bool:
        """Keep a finished sequence's KV as cache. False (nothing kept) when the cache is off or
        the sequence holds nothing."""
        if not self.enabled or holder.seq_id < 0 or not holder.cells:
            return False
        if not self.pool.free_parked_ids:
            self.evict_one()
        if not self.pool.park(holder):  # no parked ids at all (the context has only running ones)
            return False
        entry = CachedPrefix(holder.seq_id, holder.cells, tokens[: len(holder.cells)])
        holder.seq_id, holder.cells = -1, []
        self.parked[entry.seq_id] = entry
        return True

    def evict_one(self, keep: CachedPrefix | None = None) -> bool:
        """Drop the least recently used entry (not `keep`); False when there is none."""
        for seq_id, entry in self.parked.items():
            if entry is not keep:
                del self.parked[seq_id]
                self.pool.release(entry)
                return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass

    def evictable_cells(self) -> int:
        """Upper bound of the cells eviction could free (shared cells may stay held)."""
        return sum(len(e.cells) for e in self.parked.values())

    def lookup(self, tokens: list[int], running: Iterable) -> tuple[object | None, int]:
        """The resident holder with the longest common prefix with `tokens`, and its length.

        At most all but the last two prompt tokens: the last one's logits are needed, and a prompt
        token computed as the only row of its sequence in a micro-batch goes through other matmul
        kernels than a chunk of several (llamacpp_batch.stream_groups), so a one-token rest could
        give another answer than the same prompt computed without the cache."""
        if not self.enabled:
            return None, 0
        limit = len(tokens) - 2
        best, best_n = None, MIN_HIT - 1
        for holder in (*self.parked.values(), *running):
            if holder.seq_id < 0 or not holder.num_computed:
                continue
            n = common_prefix(tokens, holder.tokens, min(limit, holder.num_computed))
            if n > best_n:
                best, best_n = holder, n
        return (best, best_n) if best is not None else (None, 0)

    def touch(self, entry: CachedPrefix) -> None:
        """Mark an entry as just used: eviction goes least recently used first."""
        self.parked.move_to_end(entry.seq_id)

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens
