"""Prefix cache: finished requests keep their KV under their sequence id ("parked") until memory
or ids run short, and a new request starts from the longest token prefix resident anywhere (a
parked entry or a running sequence) instead of recomputing it.

A request that extends a whole entry (the next turn of a chat) takes the entry's id over: nothing
is copied. So does any hit on a *disposable* entry, one a cancelled request left (an editor's
completion that the next keystroke superseded: nobody will extend its answer, and the next request
shares all but its last characters). Any other hit copies, and the entry stays whole for the next
request with the same system prompt: with per-sequence KV streams (the default) a copy copies
the entry's cells into another stream (3-4 ms for a chat template on SmolLM2, 2 cores; for an
entry longer than half a stream, the whole stream and a new worst-case graph, 35-100 ms:
backends/llamacpp/seq_copy.py), so an entry that sits on a running-range id is copied *aside*,
above the running range, and the request takes the original id over -- one copy, where a copy
into a new id and the two moves that kept the running ids consecutive were three. In a unified
pool a copy shares cells and costs nothing. Entries sitting on ids the running sequences need are
moved above them (kvpool.py says why).
With a disk tier (the prompt cache on disk: engine/prompt_disk.py over store/prompt_cache.py) what
is parked also outlives the engine: an entry that stays parked while the engine idles for
`SAVE_AFTER_S` is written to disk (KVSave, applied off the step: the engine's idle turn), and so is
one dropped before it was written (KVSave before its KVRemove, in the step that drops it). A prompt
whose longest prefix is in a file, `DISK_MIN_GAIN` tokens longer than any resident one, gets a
fresh id and the file's state (KVRestore) instead: after an unload, a restart or a crash.
Memory follows use: an entry left unused for `release_after_s` (RELEASE_AFTER_S by default) while
the engine idles is dropped -- written first, where it is worth a file -- so its stream's pages go
back to the OS (backends/llamacpp/kv_pages.py): parked entries on all 16 streams had kept SmolLM2's
worker at 2.3x its resting memory a minute after a load ended (issue 42). Only what a later hit
gets back cheaply goes: an entry on disk (read back on the hit), a short or cancelled one
(computed again in a blink); without a disk tier, and for an image's cells, long entries stay.

Matching is exact on token ids, and at least the backend's `min_recompute` prompt tokens are always
computed (two for llama.cpp, see `lookup`), so a hit never changes the output -- only how many
prompt tokens have to be computed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable, Sequence as Seq

from ..protocol.requests import LoraSet
from .kv_ops import DiskEntryLike, DiskTier, KVRestore, KVSave
from .kvpool import KVHolder, KVPool


# Shorter hits are ignored: a few tokens save nothing worth a copy, and a hit on a parked entry can
# cost that entry its tail when ids run short (a BOS token alone would match every prompt).
MIN_HIT = 4
# Seconds an entry stays parked, the engine idle, before it is written to disk. An agent's next
# turn usually comes sooner (after a tool ran) and takes the entry over, so a conversation is not
# written at every turn; a coffee break, an unload or a crash finds it written.
SAVE_AFTER_S = 3.0
# A file is read instead of a resident prefix only when it holds this many more tokens: reading
# and placing a state costs a few ms, computing 64 tokens about as much on a small model.
DISK_MIN_GAIN = 64
# Seconds an entry stays in memory unused, the engine idle, before its cells go back (when a later
# hit gets them back cheaply, see above). An agent's next turn, or a user's next question after
# reading the answer, usually comes sooner; the time a minute's break finds the memory given back.
RELEASE_AFTER_S = 30.0
# Entries shorter than this are computed again rather than kept when idle: SmolLM2 computes 128
# prompt tokens in ~0.1 s on 2 cores (engine/prompt_disk.py writes no shorter file either).
CHEAP_TOKENS = 128


class CachedPrefix:
    """A parked sequence id: its KV holds `tokens` at positions 0..len-1."""

    __slots__ = ("seq_id", "cells", "tokens", "disposable", "parked_at", "used_at", "saved", "adapters")

    def __init__(self, seq_id: int, cells: list[int], tokens: list[int], disposable: bool = False,
                 adapters: LoraSet = ()):
        self.seq_id = seq_id
        self.cells = cells
        self.tokens = tokens
        self.disposable = disposable  # left by a cancelled request: a hit takes it over
        # The LoRA set its cells were computed under: only a request with the same set may use them.
        self.adapters = adapters
        self.parked_at = self.used_at = time.monotonic()
        # Written to disk, or never to be: a cancelled request's is not worth it, nor one no file holds.
        self.saved = disposable or not self.fits_a_file

    @property
    def fits_a_file(self) -> bool:
        """Whether a prompt cache file can hold its cells: not an image's (their ids are no file's
        int32 tokens, and images are few and short), nor an adapter's (a file's key is the model's,
        not the adapters'). Such entries stay in memory."""
        return not self.adapters and (not self.tokens or min(self.tokens) >= 0)

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
    def __init__(self, pool: KVPool, enabled: bool = True, min_recompute: int = 1,
                 release_after_s: float = RELEASE_AFTER_S):
        self.pool = pool
        self.enabled = enabled
        self.release_after_s = release_after_s  # 0: parked entries stay until evicted
        self.min_recompute = max(1, min_recompute)  # the last prompt token's logits are always needed
        self.parked: OrderedDict[int, CachedPrefix] = OrderedDict()  # seq_id -> entry, LRU first
        self.disk: DiskTier | None = None  # the prompt cache on disk, where the engine has one
        self.hits = 0  # prompt tokens served from the cache
        self.disk_hits = 0  # of them, read from disk
        self.queries = 0  # prompt tokens looked up

    def park(self, holder: KVHolder, tokens: list[int], disposable: bool = False) -> bool:
        """Keep a finished sequence's KV as cache. False (nothing kept) when the cache is off or
        the sequence holds nothing."""
        if not self.enabled or holder.seq_id < 0 or not holder.cells:
            return False
        entry = CachedPrefix(holder.seq_id, holder.cells, tokens[: len(holder.cells)], disposable,
                             getattr(holder, "adapters", ()))
        holder.seq_id, holder.cells = -1, []
        self.parked[entry.seq_id] = entry
        return True

    def vacate(self, ids: range) -> None:
        """Clear `ids` of parked entries: each moves above the running range, or is dropped when
        there is no room there."""
        for entry in [e for e in self.parked.values() if e.seq_id in ids]:
            self._vacate(entry)

    def vacate_one(self, keep: CachedPrefix | None = None) -> bool:
        """Free one running-range id held by a parked entry (least recently used first, `keep`
        last); False when parked entries hold none."""
        in_range = [e for e in self.parked.values() if e.seq_id < self.pool.n_running]
        in_range.sort(key=lambda e: e is keep)  # stable: LRU order otherwise
        if not in_range:
            return False
        self._vacate(in_range[0], keep)
        return True

    def _room_above(self, spare: CachedPrefix | None) -> None:
        """With no parked id free above the running range, the oldest entry up there goes (not
        `spare`)."""
        if not self.pool.free_parked_ids:
            for other in self.parked.values():
                if other.seq_id >= self.pool.n_running and other is not spare:
                    self._drop(other)
                    break

    def _vacate(self, entry: CachedPrefix, keep: CachedPrefix | None = None) -> None:
        self._room_above(keep)
        if self.pool.move_to_parked(entry):  # re-keyed under its new id, in the same LRU place
            self.parked = OrderedDict((e.seq_id, e) for e in self.parked.values())
        else:  # no room above the running range
            self._drop(entry)

    def copy_aside(self, entry: CachedPrefix) -> bool:
        """Copy a parked entry to an id above the running range, where it takes the original's
        place in the LRU order, so a new request can take the original's id over; False when no
        id is free up there even after dropping the oldest entry that holds one."""
        self._room_above(entry)
        copy = CachedPrefix(-1, [], entry.tokens, entry.disposable, entry.adapters)
        copy.saved = entry.saved
        if not self.pool.copy_to_parked(entry, copy):
            return False
        kept = (copy if e is entry else e for e in self.parked.values())
        self.parked = OrderedDict((e.seq_id, e) for e in kept)
        return True

    def _drop(self, entry: CachedPrefix) -> None:
        del self.parked[entry.seq_id]
        self._save(entry)  # before the release's KVRemove, in the same list of operations
        self.pool.release(entry)

    # --- the disk tier -----------------------------------------------------------------------
    def _save(self, entry: CachedPrefix) -> bool:
        """Write `entry` to disk with the next operations, unless written or not worth it."""
        disk = self.disk
        if disk is None or not self._worth_a_file(entry):
            return False
        entry.saved = True
        self.pool.ops.append(KVSave(entry.seq_id, tuple(entry.tokens), disk))
        return True

    def next_idle_work_in(self, now: float) -> float | None:
        """Seconds until a parked entry is due to be written or released (<= 0: now), None when
        none will be: the engine's idle wait is timed only then (an idle daemon stays at 0% CPU)."""
        due = [e.parked_at + SAVE_AFTER_S - now for e in self.parked.values() if self._worth_a_file(e)]
        if self.release_after_s > 0:
            due += [e.used_at + self.release_after_s - now for e in self.parked.values() if self._releasable(e)]
        return min(due, default=None)

    def idle_work(self, now: float) -> bool:
        """Write the entries parked for SAVE_AFTER_S, release those unused for `release_after_s`;
        True when operations were recorded."""
        saved = self.save_parked(now)
        released = False
        if self.release_after_s > 0:
            for entry in [e for e in self.parked.values() if self._releasable(e)]:
                if entry.used_at + self.release_after_s <= now:
                    self._drop(entry)  # written first where worth a file, then its cells go
                    released = True
        return saved or released

    def _worth_a_file(self, entry: CachedPrefix) -> bool:
        return self.disk is not None and not entry.saved and len(entry.tokens) >= self.disk.min_tokens

    def _releasable(self, entry: CachedPrefix) -> bool:
        """Whether a later hit gets the entry back cheaply once it is dropped: it is cancelled
        work, short, or on disk (or written as it is dropped: _drop)."""
        if entry.disposable or len(entry.tokens) < CHEAP_TOKENS:
            return True
        return self.disk is not None and entry.fits_a_file

    def save_parked(self, now: float | None = None) -> bool:
        """Write the entries parked for SAVE_AFTER_S (all of them with `now` None: an unload);
        True when operations were recorded."""
        saved = False
        for entry in self.parked.values():
            if now is None or entry.parked_at + SAVE_AFTER_S <= now:
                saved |= self._save(entry)
        return saved

    def disk_lookup(self, tokens: list[int], resident: int, room: int,
                    adapters: LoraSet = ()) -> tuple[DiskEntryLike | None, int]:
        """The file with the longest prefix of `tokens`, when it beats the `resident` hit by
        DISK_MIN_GAIN tokens, its state fits a sequence's `room` cells, and it may be cut where
        the prefix ends; else (None, 0). Files hold cells computed without adapters only."""
        disk = self.disk
        if disk is None or not self.enabled or adapters:
            return None, 0
        limit = len(tokens) - self.min_recompute
        best, best_n = None, resident + DISK_MIN_GAIN - 1
        for entry in disk.entries():
            n = common_prefix(tokens, entry.tokens, min(limit, len(entry.tokens)))
            cut = len(entry.tokens) - n
            if n > best_n and len(entry.tokens) <= room and (disk.trim_margin is None or cut <= disk.trim_margin):
                best, best_n = entry, n
        return (best, best_n) if best is not None else (None, 0)

    def restore(self, holder: KVHolder, state: bytes, n: int) -> None:
        """Give `holder` (a fresh id, no cells) the first n positions of a file's `state`."""
        assert self.disk is not None
        self.pool.grow(holder, n)
        self.pool.ops.append(KVRestore(holder.seq_id, n, state, self.disk))
        self.disk_hits += n

    def evict_one(self, keep: CachedPrefix | None = None) -> bool:
        """Drop the least recently used entry (not `keep`); False when there is none."""
        for entry in self.parked.values():
            if entry is not keep:
                self._drop(entry)
                return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass

    def evictable_cells(self) -> int:
        """Upper bound of the cells eviction could free (shared cells may stay held)."""
        return sum(len(e.cells) for e in self.parked.values())

    def lookup(self, tokens: list[int], running: Iterable, adapters: LoraSet = ()) -> tuple[object | None, int]:
        """The resident holder computed under the LoRA set `adapters` with the longest common
        prefix with `tokens`, and its length (cells computed under another set are other cells).

        At most all but the last `min_recompute` prompt tokens (Capabilities): the last one's logits
        are needed, and on llama.cpp (2) a prompt token computed as the only row of its sequence in
        a micro-batch goes through other matmul kernels than a chunk of several
        (llamacpp_batch.stream_groups), so a one-token rest could give another answer than the
        same prompt computed without the cache."""
        if not self.enabled:
            return None, 0
        limit = len(tokens) - self.min_recompute
        best, best_n = None, MIN_HIT - 1
        for holder in (*self.parked.values(), *running):
            if holder.seq_id < 0 or not holder.num_computed or holder.adapters != adapters:
                continue
            n = common_prefix(tokens, holder.tokens, min(limit, holder.num_computed))
            if n > best_n:
                best, best_n = holder, n
        return (best, best_n) if best is not None else (None, 0)

    def touch(self, entry: CachedPrefix) -> None:
        """Mark an entry as just used: eviction goes least recently used first, and an idle
        engine keeps it `release_after_s` from now."""
        entry.used_at = time.monotonic()
        self.parked.move_to_end(entry.seq_id)

    def take(self, entry: CachedPrefix) -> None:
        """Remove a parked entry that a new sequence adopts."""
        del self.parked[entry.seq_id]

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens
