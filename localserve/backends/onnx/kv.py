"""The ONNX backend's unified KV pool: which slot (cache row) holds which sequence's position, and
the attention mask that follows from it. Pure numpy, no onnxruntime.

Every token decoded takes one free slot; `copy` makes a prefix's slots part of another sequence too
(shared, reference-counted: Capabilities.prefix_sharing "share"), so a slot is free when no
sequence holds it. A token may attend exactly the slots its own sequence holds at positions up to
its own, which is what lets one `session.run` carry any mix of sequences without padding.
"""

from __future__ import annotations

import numpy as np

from ..base import KVFullError

_EMPTY = np.zeros(0, dtype=np.int64)


class SlotTable:
    def __init__(self, n_slots: int, n_seqs: int) -> None:
        self.n_slots = n_slots
        self.refs = np.zeros(n_slots, dtype=np.int32)  # sequences holding each slot
        # Per sequence, parallel arrays sorted by position: positions held and the slot of each.
        self._pos = [_EMPTY] * n_seqs
        self._slot = [_EMPTY] * n_seqs

    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.refs))

    def held(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        return self._pos[seq], self._slot[seq]

    def pos_max(self, seq: int) -> int:
        pos = self._pos[seq]
        return int(pos[-1]) if pos.size else -1

    def plan(self, n_tokens: int) -> np.ndarray:
        """Free slots for a batch's tokens (lowest first, so one sequence's rows stay in position
        order); KVFullError when there are too few. Nothing is taken until `commit`."""
        free = np.flatnonzero(self.refs == 0)
        if free.size < n_tokens:
            raise KVFullError(f"no room in the KV cache for a batch of {n_tokens} tokens "
                              f"({free.size} of {self.n_slots} slots free)")
        return free[:n_tokens].astype(np.int64)

    def snapshot(self) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The whole table's state, for `restore` (the per-sequence arrays are replaced, never
        written in place, so shallow lists suffice)."""
        return self.refs.copy(), list(self._pos), list(self._slot)

    def restore(self, state: tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]) -> None:
        refs, pos, slot = state
        self.refs, self._pos, self._slot = refs.copy(), list(pos), list(slot)

    def _merged(self, seq: int, pos: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's holdings with (pos, slots) written over whatever it held at those positions."""
        old_pos, old_slot = self._pos[seq], self._slot[seq]
        keep = ~np.isin(old_pos, pos)
        all_pos = np.concatenate([old_pos[keep], pos])
        order = np.argsort(all_pos, kind="stable")
        return all_pos[order], np.concatenate([old_slot[keep], slots])[order]

    def bias(self, seqs: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """attn_bias[T, S] for a planned batch: 0 where token t may attend slot j, -inf elsewhere."""
        bias = np.full((seqs.size, self.n_slots), -np.inf, dtype=np.float32)
        for s in np.unique(seqs):
            rows = np.flatnonzero(seqs == s)
            held_pos, held_slot = self._merged(int(s), pos[rows], slots[rows])
            allowed = held_pos[None, :] <= pos[rows][:, None]
            bias[rows[:, None], held_slot[None, :]] = np.where(allowed, 0.0, -np.inf)
        return bias

    def commit(self, seqs: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> None:
        for s in np.unique(seqs):
            rows = np.flatnonzero(seqs == s)
            s = int(s)
            dropped = self._slot[s][np.isin(self._pos[s], pos[rows])]
            np.subtract.at(self.refs, dropped, 1)
            self._pos[s], self._slot[s] = self._merged(s, pos[rows], slots[rows])
            np.add.at(self.refs, slots[rows], 1)

    def _range(self, seq: int, p0: int, p1: int) -> np.ndarray:
        pos = self._pos[seq]
        return (pos >= max(p0, 0)) & ((pos < p1) if p1 >= 0 else True)

    def remove(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        inside = self._range(seq, p0, p1)
        np.subtract.at(self.refs, self._slot[seq][inside], 1)
        self._pos[seq], self._slot[seq] = self._pos[seq][~inside], self._slot[seq][~inside]

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        inside = self._range(src, p0, p1)
        pos, slots = self._pos[src][inside], self._slot[src][inside]
        dropped = self._slot[dst][np.isin(self._pos[dst], pos)]
        np.subtract.at(self.refs, dropped, 1)
        self._pos[dst], self._slot[dst] = self._merged(dst, pos, slots)
        np.add.at(self.refs, slots, 1)


# The packed graph attends over every slot of the pool each step (O(tokens x slots) per layer) and
# keeps the cache in fp32, so the pool is capped: past this, long contexts cost every request.
MAX_SLOTS = 8192
