"""Accounting of the backend's KV cache: sequence ids and cells, shared cells counted once.

How the cache behaves comes from the backend's declared Capabilities. With prefix_sharing "copy"
(the product's default: llama.cpp with a stream of `kv_cells_per_seq` cells per sequence, so
outputs do not depend on what else is in the cache) a prefix copy really copies: it is counted as
new cells, and no sequence may outgrow its stream.

With "share" (llama.cpp's unified pool) all sequences share the cells; `kv_copy` makes a prefix of
one sequence part of another without duplicating cells, and a cell is free again only when no
sequence holds it. We mirror that exactly with a reference count per cell id, so admission
decisions match what the backend will accept (counting a shared system prompt once per request
would refuse requests that fit, and counting it once but freeing it with its first owner would
over-admit).

Sequence ids come in two ranges: [0, n_running) for running sequences and the ids above for
parked prefix-cache entries. A backend that declares `consecutive_ids` computes sequences in one
pass only on consecutive ids: llama.cpp with per-sequence streams puts only those into one
micro-batch (its splitter requires it), so eight decoding sequences on ids 0..7 cost one pass over
the weights per step and on ids 0, 2, .., 14 eight (measured on SmolLM2, 2 threads: 40 vs 79 ms
per step). For such a backend the scheduler keeps the running sequences on consecutive ids: `block`
picks where, `gather` moves the stragglers in. A finished sequence is
parked where it is, so a follow-up request (the next chat turn) can take its id over without
copying anything; it is moved above the running range only when its id is needed
(`move_to_parked`).

The pool only keeps books: every change to the backend's cache it implies (a prefix copied, a
tail or a whole sequence removed, a sequence moved) is appended to `ops` as data (kv_ops.py), and
the scheduler hands them to the engine with the next plan (engine/step.py applies them in order).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

from ..backends.base import Capabilities
from .kv_ops import KVCopy, KVMove, KVOp, KVRemove


class KVHolder(Protocol):
    seq_id: int
    cells: list[int]


class KVPool:
    def __init__(self, caps: Capabilities, n_cells: int, n_seq_ids: int, n_running: int | None = None):
        self.n_cells = n_cells
        self.shared = caps.prefix_sharing == "share"  # kv_copy shares cells (one pool)
        # Cells one sequence may hold: the whole pool, or its own stream.
        self.n_cells_seq = min(n_cells, caps.kv_cells_per_seq)
        self.n_running = min(n_running or n_seq_ids, n_seq_ids)
        # Min-heaps: the lowest free id is handed out first.
        self._free_running = list(range(self.n_running))
        self._free_parked = list(range(self.n_running, n_seq_ids))
        self._refs: dict[int, int] = {}
        self._cell_ids = itertools.count()
        self.moves = 0  # KV moves to keep running ids consecutive (each a copy across streams with streams)
        self.ops: list[KVOp] = []  # what the backend's cache must do to match these books, in order

    def take_ops(self) -> list[KVOp]:
        """The operations recorded since the last call, oldest first (for the next plan)."""
        ops, self.ops = self.ops, []
        return ops

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def free(self) -> int:
        return self.n_cells - len(self._refs)

    @property
    def free_ids(self) -> int:
        return len(self._free_running) + len(self._free_parked)

    @property
    def free_parked_ids(self) -> int:
        return len(self._free_parked)

    @property
    def free_running_ids(self) -> int:
        return len(self._free_running)

    def acquire(self, holder: KVHolder, near: list[int] = ()) -> bool:
        """Give the holder a free running id: next to the `near` ids (the running block) when one
        is free there, else the lowest; False when none is free."""
        if not self._free_running:
            return False
        seq_id = self._free_running[0]
        if near:
            for candidate in (max(near) + 1, min(near) - 1):
                if candidate in self._free_running:
                    seq_id = candidate
                    break
        self._take(seq_id)
        holder.seq_id = seq_id
        holder.cells = []
        return True

    def move_to_parked(self, holder: KVHolder) -> bool:
        """Move the holder's KV to the lowest free parked id; False when none is free."""
        if not self._free_parked or holder.seq_id < 0:
            return False
        self._move(holder, heapq.heappop(self._free_parked))
        return True

    def copy_to_parked(self, src: KVHolder, dst: KVHolder) -> bool:
        """Copy all of src's KV into dst (fresh) on the lowest free parked id; False when none is
        free."""
        if not self._free_parked or src.seq_id < 0:
            return False
        dst.seq_id = heapq.heappop(self._free_parked)
        self.share_prefix(src, dst, len(src.cells))
        return True

    def block(self, running_ids: list[int], parked_ids: list[int]) -> range:
        """Where the running sequences should sit: the window of consecutive running-range ids
        that needs the fewest moves (running ones outside it move in, parked ones inside move out)."""
        n = len(running_ids)
        if n and max(running_ids) - min(running_ids) == n - 1 and max(running_ids) < self.n_running:
            return range(min(running_ids), min(running_ids) + n)  # already there: the usual step
        inside = set(running_ids)
        parked = set(parked_ids)
        best, best_cost = 0, None
        for start in range(0, self.n_running - n + 1):
            window = range(start, start + n)
            cost = sum(i not in inside for i in window) + sum(i in parked for i in window)
            if best_cost is None or cost < best_cost:
                best, best_cost = start, cost
                if cost == 0:
                    break
        return range(best, best + n)

    def gather(self, running: list, block: range) -> int:
        """Move running holders outside `block` onto its free ids (parked entries must be out of
        it already); returns the moves."""
        moves = 0
        for holder in running:
            if holder.seq_id not in block:
                dst = min(i for i in self._free_running if i in block)
                self._take(dst)
                self._move(holder, dst)
                moves += 1
        return moves

    def _take(self, seq_id: int) -> None:
        self._free_running.remove(seq_id)
        heapq.heapify(self._free_running)

    def adopt(self, src: KVHolder, dst: KVHolder, n: int) -> None:
        """dst takes over src's sequence id and its first n positions (no copy); src is left empty."""
        if n < len(src.cells):
            self.ops.append(KVRemove(src.seq_id, n, -1))
            self.uncount(src, n)
        dst.seq_id, dst.cells = src.seq_id, src.cells
        src.seq_id, src.cells = -1, []

    def _move(self, holder: KVHolder, dst: int) -> None:
        """Move the holder to `dst`, an id the caller has already taken off the free lists."""
        src = holder.seq_id
        self.ops.append(KVMove(src, dst))  # cells and their counts go along unchanged
        self.moves += 1
        holder.seq_id = dst
        self._give_back(src)

    def _give_back(self, seq_id: int) -> None:
        heapq.heappush(self._free_running if seq_id < self.n_running else self._free_parked, seq_id)

    def grow(self, holder: KVHolder, n: int) -> None:
        """Count n new cells for tokens about to be decoded."""
        new = list(itertools.islice(self._cell_ids, n))
        self._refs.update(dict.fromkeys(new, 1))
        holder.cells.extend(new)

    def uncount(self, holder: KVHolder, keep: int) -> None:
        """Forget cells past `keep` in the accounting only (the backend never stored them: a
        failed decode keeps nothing)."""
        refs = self._refs
        for cell in holder.cells[keep:]:
            if refs[cell] == 1:
                del refs[cell]
            else:
                refs[cell] -= 1
        del holder.cells[keep:]

    def truncate(self, holder: KVHolder, keep: int) -> None:
        """Drop the holder's positions from `keep` on, in the cache too (rejected draft rows)."""
        if len(holder.cells) > keep:
            self.ops.append(KVRemove(holder.seq_id, keep, -1))
            self.uncount(holder, keep)

    def share_prefix(self, src: KVHolder, dst: KVHolder, n: int) -> None:
        """dst (fresh, empty) gets src's first n positions: shared cells in one pool, a copy (new
        cells) with per-sequence streams."""
        self.ops.append(KVCopy(src.seq_id, dst.seq_id, 0, n))
        if not self.shared:  # a copy into dst's own stream: new cells
            dst.cells = []
            self.grow(dst, n)
            return
        shared = src.cells[:n]
        refs = self._refs
        for cell in shared:
            refs[cell] += 1
        dst.cells = shared

    def release(self, holder: KVHolder) -> None:
        """Drop all of the holder's KV and give its id back."""
        if holder.seq_id < 0:
            return
        self.ops.append(KVRemove(holder.seq_id))
        self.uncount(holder, 0)
        self._give_back(holder.seq_id)
        holder.seq_id = -1
