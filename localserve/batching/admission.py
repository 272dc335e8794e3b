"""Admission: which waiting sequences start, on which sequence id, with which cached prefix, and
who is preempted to make room (the scheduler's half that moves sequences between the lanes and the
running set; scheduler.py plans the step and keeps the books).

A waiting prompt is admitted in prompt order while its cells fit and the step has budget it could
use. It starts from the longest cached prefix: a parked entry it extends is adopted (no copy), any
other hit is copied aside or shared (kvpool.py, prefix_cache.py), and a longer prefix on disk is
restored into a fresh id (the prompt cache on disk). When the best waiting sequence cannot start, a
running one of a worse lane is preempted: its cells parked as cache, its tokens re-fed later.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from .prefix_cache import CachedPrefix
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from ..backends.base import Capabilities
    from .adapter_turns import AdapterTurns
    from .kvpool import KVPool
    from .lanes import LaneQueues
    from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class Admission:
    """Mixed into Scheduler, whose state it reads and changes (the engine thread only)."""

    caps: "Capabilities"
    pool: "KVPool"
    cache: "PrefixCache"
    lanes: "LaneQueues"
    turns: "AdapterTurns"
    running: list[Sequence]
    max_running: int
    n_ctx_seq: int
    preemptions: int
    _hold_admissions: bool
    _on_dequeue: Callable[[Sequence], None]

    def key(self, seq: Sequence) -> tuple[int, int]: ...

    def prompt_key(self, seq: Sequence) -> tuple[int, int, int]: ...

    def _admit(self, prefillers: list[Sequence], budget: int) -> None:
        """Move waiting sequences into the running set (appending them to `prefillers`), in prompt
        order, while their prompts fit the KV cache and this step has budget they could use: the
        prompts read before them leave some. One that would not be fed waits: admitted later, it
        finds the prefix those before it computed meanwhile (six agents with one system prompt)."""
        if self._hold_admissions and self.running:
            return
        demand = sum(s.pending for s in prefillers)
        while len(self.running) < self.max_running:
            seq = self.lanes.peek(self.prompt_key, self.turns.current)  # only this step's LoRA set
            if seq is None:
                break
            key = self.prompt_key(seq)
            if sum(p.pending for p in prefillers if self.prompt_key(p) < key) >= budget:
                break
            if not self._start(seq, reserved=demand):
                break
            prefillers.append(seq)
            demand += seq.pending

    def _start(self, seq: Sequence, reserved: int) -> bool:
        """Give seq a sequence id and its cached prefix; False if its prompt cannot fit yet."""
        source, n_hit = self.cache.lookup(seq.tokens, self.running, seq.adapters)
        on_disk, n_disk = self.cache.disk_lookup(seq.tokens, n_hit, self.n_ctx_seq, seq.adapters)
        if on_disk is not None:
            started = self._start_from_disk(seq, on_disk, n_disk, reserved)
            if started is not None:
                return started
        entry = source if isinstance(source, CachedPrefix) else None
        # A prompt that extends the whole entry (a chat's next turn, a preempted request coming
        # back: it loses only the last tokens it must compute again anyway, at most min_recompute)
        # takes the entry's id: no copy. So does any hit on what a cancelled request left.
        adopt = entry is not None and (entry.disposable or len(entry.tokens) - n_hit <= self.caps.min_recompute)
        # Any other hit on an entry in the running range: the entry is copied aside and the request
        # takes its id over (prefix_cache.py: one stream copy instead of three).
        aside = not adopt and entry is not None and self.caps.consecutive_ids and entry.seq_id < self.pool.n_running
        if not adopt and not aside:
            if not self._free_running_id(entry):
                return False
            if entry is not None and entry.seq_id < 0:  # it was the one in the way, and is gone
                source = entry = None
                n_hit = 0
        while True:
            # A prefix copied into a stream of its own takes cells there too.
            need = len(seq.tokens) - (n_hit if adopt or self.pool.shared else 0)
            if self.pool.free - reserved >= need:
                break
            if not self.cache.evict_one(keep=entry):
                if entry is not None:  # last resort: give up the hit, use the memory
                    self.cache.evict_one()
                    source = entry = None
                    n_hit, adopt, aside = 0, False, False
                    continue
                return False
        if aside and not self.cache.copy_aside(entry):
            aside = False  # no id above the running range: a new id and a copy, as without it
            if not self._free_running_id(entry):
                return False
            if entry.seq_id < 0:  # it was the one in the way, and is gone
                source, entry, n_hit = None, None, 0
        if adopt or aside:
            if adopt:
                self.cache.take(entry)
            self.pool.adopt(entry, seq, n_hit)
        else:  # copy the prefix; the entry stays whole for the next request like this one
            near = [q.seq_id for q in self.running] if self.caps.consecutive_ids else []
            if not self.pool.acquire(seq, near=near):
                return False
            if entry is not None:
                self.cache.touch(entry)
            if n_hit:
                self.pool.share_prefix(source, seq, n_hit)
        self._run_from(seq, n_hit)
        return True

    def _start_from_disk(self, seq: Sequence, on_disk, n_hit: int, reserved: int) -> bool | None:
        """Start seq on a fresh id with the first n_hit positions of a prompt cache file (after
        an unload, a restart, a crash); None when the file was gone or bad: start without it."""
        if not self._free_running_id(None):
            return False
        while self.pool.free - reserved < len(seq.tokens):
            if not self.cache.evict_one():
                return False
        state = self.cache.disk.read(on_disk)  # checked against its digest; a bad file is removed
        if state is None:
            return None
        near = [q.seq_id for q in self.running] if self.caps.consecutive_ids else []
        if not self.pool.acquire(seq, near=near):
            return False
        self.cache.restore(seq, state, n_hit)
        self._run_from(seq, n_hit)
        return True

    def _run_from(self, seq: Sequence, n_hit: int) -> None:
        """seq runs from here, its first n_hit prompt tokens already in its KV."""
        seq.num_computed = n_hit
        if seq.queued:  # the first admission is the one the client sees in usage
            seq.cached_tokens = n_hit
            self.cache.record(seq.num_prompt, n_hit)
            self._dequeued(seq)
        self.lanes.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _free_running_id(self, keep: CachedPrefix | None) -> bool:
        """A running-range id for a new sequence: when none is free, a parked entry on one moves
        above the range or is dropped (`keep` last: it may be the one that goes, seq_id -1)."""
        return bool(self.pool.free_running_ids) or self.cache.vacate_one(keep=keep)

    def _make_room(self) -> None:
        """Preempt running sequences of a worse lane when the best waiting one cannot start."""
        seq = self.lanes.peek(self.prompt_key)
        while seq is not None and self.running:
            victim = max(self.running, key=self.key)
            if self.key(victim)[0] <= self.key(seq)[0]:
                return
            fits_slot = len(self.running) < self.max_running
            fits_cells = self.pool.free + self.cache.evictable_cells() >= len(seq.tokens)
            if fits_slot and fits_cells:
                return
            self._preempt(victim, park=True)

    def _preempt(self, seq: Sequence, park: bool) -> None:
        """Back to the front of its lane; its KV is parked as cache (re-admission adopts it and
        recomputes only the last min_recompute tokens) or dropped (recomputed: prompt and generated tokens
        are re-fed)."""
        self.running.remove(seq)
        self._park_or_release(seq, park)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.lanes.push_front(seq)
        self.preemptions += 1
        log.debug("preempted %s (lane %s, %d tokens)", seq.request_id, seq.request.lane, len(seq.tokens))

    def _park_or_release(self, seq: Sequence, park: bool = True, disposable: bool = False) -> None:
        if not (park and self.cache.park(seq, seq.tokens, disposable)):
            self.pool.release(seq)

    def _dequeued(self, seq: Sequence) -> None:
        if seq.queued:
            seq.queued = False
            self._on_dequeue(seq)
