"""An idle engine gives parked prefix-cache entries back after `release_after_s` unused (issue 42:
memory back to its resting figure a minute after a load), but only those a later hit gets back
cheaply: written to disk first where long, dropped where short; with no disk, long entries stay."""

from __future__ import annotations

import random
import time

from fake_backend import FakeBackend
from localserve.batching.kv_ops import KVRemove, KVSave
from localserve.batching.prefix_cache import CHEAP_TOKENS
from localserve.engine import step
from scheduler_harness import Harness


class Disk:
    """The disk tier's face to the prefix cache; the ops it would run are checked, not run."""

    min_tokens = CHEAP_TOKENS
    trim_margin = None

    def entries(self):
        return []


def parked_harness(disk=None) -> tuple[Harness, list[int], list[int]]:
    rng = random.Random(3)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64), max_sequences=4, prefix_release_s=5.0)
    h.sched.cache.disk = disk
    long, short = [rng.randrange(1, 64) for _ in range(300)], [rng.randrange(1, 64) for _ in range(20)]
    h.submit(long, max_tokens=4)
    h.submit(short, max_tokens=4)
    h.run()
    assert len(h.sched.cache.parked) == 2
    return h, long, short


def idle_ops(h: Harness, at: float) -> list:
    """What an idle turn at `at` records, applied as the engine applies it."""
    assert h.sched.cache.idle_work(at)
    ops = h.sched.take_output().kv_ops
    step.apply_kv_ops(h.backend, [op for op in ops if not isinstance(op, KVSave)])
    return ops


def test_without_a_disk_only_short_entries_go_back_and_only_once_unused_long_enough():
    h, long, _ = parked_harness()
    cache, now = h.sched.cache, time.monotonic()
    assert 0 < cache.next_idle_work_in(now) <= 5.0
    assert not cache.idle_work(now + 1)  # parked a moment ago: kept for the session's next turn
    ops = idle_ops(h, now + 6)
    assert [type(op) for op in ops] == [KVRemove]
    (entry,) = cache.parked.values()
    assert entry.tokens[:300] == long  # the long one stays: nothing could give it back but a recompute
    assert cache.next_idle_work_in(now + 6) is None  # and nothing wakes an idle engine up any more
    h.assert_drained()


def test_with_a_disk_a_long_entry_is_written_before_its_cells_go():
    h, _, _ = parked_harness(Disk())
    cache, now = h.sched.cache, time.monotonic()
    ops = idle_ops(h, now + 6)
    saves = [op for op in ops if isinstance(op, KVSave)]
    assert len(saves) == 1 and len(saves[0].tokens) >= CHEAP_TOKENS
    assert ops.index(saves[0]) < ops.index(next(op for op in ops if isinstance(op, KVRemove) and op.seq_id == saves[0].seq_id))
    assert not cache.parked and cache.next_idle_work_in(now + 6) is None
    h.assert_drained()


def test_a_hit_keeps_an_entry_for_another_quiet_period():
    h, long, _ = parked_harness(Disk())
    cache = h.sched.cache
    entry = next(e for e in cache.parked.values() if len(e.tokens) > CHEAP_TOKENS)
    for e in cache.parked.values():  # both parked 10 s ago ...
        e.parked_at = e.used_at = time.monotonic() - 10
    cache.touch(entry)  # ... and the long one hit just now
    idle_ops(h, entry.used_at + 1)  # the short entry goes, the touched one waits its 5 s
    assert list(cache.parked.values()) == [entry]
    h.assert_drained()


def test_zero_keeps_every_entry():
    h, _, _ = parked_harness()
    h.sched.cache.release_after_s = 0
    assert h.sched.cache.next_idle_work_in(time.monotonic()) is None
    assert not h.sched.cache.idle_work(time.monotonic() + 3600)
    assert len(h.sched.cache.parked) == 2
    h.assert_drained()
