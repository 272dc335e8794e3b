"""Accounting of the backend's KV cache: sequence ids and cells, shared cells counted once.

The product's default (llama.cpp with kv_unified=False) gives each sequence its own stream of
`n_ctx_seq` cells, so outputs do not depend on what else is in the cache. There a prefix copy
really copies: it is counted as new cells, and no sequence may outgrow its stream.

With one unified pool (kv_unified=True, and backends without streams) all sequences share n_ctx
cells; `kv_copy` makes a prefix of one sequence part of another without duplicating cells, and a
cell is free again only when no sequence holds it. We mirror that exactly with a reference count
per cell id, so admission decisions match what llama.cpp will accept (counting a shared system
prompt once per request would refuse requests that fit, and counting it once but freeing it with
its first owner would over-admit).
"""

from __future__ import annotations

import itertools
from typing import Protocol

from ..backends.base import Backend


class KVHolder(Protocol):
    seq_id: int
    cells: list[int]


class KVPool:
    def __init__(self, backend: Backend, n_cells: int, n_seq_ids: int):
        self.backend = backend
        self.n_cells = n_cells
        self.shared = getattr(backend, "kv_unified", True)  # kv_copy shares cells (one pool)
        # Cells one sequence may hold: the whole pool, or its own stream.
        self.n_cells_seq = n_cells if self.shared else min(n_cells, getattr(backend, "n_ctx_seq", n_cells))
        self._free_ids = list(range(n_seq_ids - 1, -1, -1))  # pop() hands out 0 first
        self._refs: dict[int, int] = {}
        self._cell_ids = itertools.count()

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def free(self) -> int:
        return self.n_cells - len(self._refs)

    @property
    def free_ids(self) -> int:
        return len(self._free_ids)

    def acquire(self, holder: KVHolder) -> bool:
        """Give the holder a sequence id; False when none is free."""
        if not self._free_ids:
            return False
        holder.seq_id = self._free_ids.pop()
        holder.cells = []
        return True

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
        """Drop positions >= keep from the backend and the accounting."""
        if keep < len(holder.cells):
            self.backend.kv_remove(holder.seq_id, keep, -1)
            self.uncount(holder, keep)

    def share_prefix(self, src: KVHolder, dst: KVHolder, n: int) -> None:
        """dst (fresh, empty) gets src's first n positions: shared cells in one pool, a copy (new
        cells) with per-sequence streams."""
        self.backend.kv_copy(src.seq_id, dst.seq_id, 0, n)
        if not self.shared:  # a copy into dst's own stream: new cells
            dst.cells = []
            self.grow(dst, n)
            return
        shared = src.cells[:n]
        refs = self._refs
        for cell in shared:
            refs[cell] += 1
        dst.cells = shared

    def adopt(self, src: KVHolder, dst: KVHolder, n: int) -> None:
        """dst takes over src's sequence id and its first n positions; src is left empty."""
        self.truncate(src, n)
        dst.seq_id, dst.cells = src.seq_id, src.cells
        src.seq_id, src.cells = -1, []

    def release(self, holder: KVHolder) -> None:
        """Drop all of the holder's KV and give its id back."""
        if holder.seq_id < 0:
            return
        self.backend.kv_remove(holder.seq_id, 0, -1)
        self.uncount(holder, 0)
        self._free_ids.append(holder.seq_id)
        holder.seq_id = -1
