"""Which batches may run at the same time: one queue for this machine, one per upstream model.

A batch waits only for older unfinished batches that share a queue with it. Batches on local
models share one queue: they share this machine's cores, memory and loaded-model slots (two at
once would each run slower and pin two models; the Batch API's measured throughput is one batch
at a time). Each model served by upstreams is a queue of its own: its capacity is elsewhere, and a
batch on an upstream that is down -- its lines wait for it, as long as the completion window
lasts -- then holds only later batches on that same model, never those on this machine or on
other upstreams.

Why queues, and not a retry bound answering 503 in the error file: an outage of a few minutes
would fail lines a user must then resubmit by hand, when a 24 h completion window promises they
wait. Why not set a stalled batch aside behind the others: it would be retried only between
batches, so an upstream back after a minute would still wait for hours of local work.

A batch whose lines name both a local and an upstream model is in both queues; one whose models
are unknown (created before they were recorded, or naming too many) is in every queue, so it runs
alone, as every batch did before.
"""

from __future__ import annotations

from typing import Callable, Iterable

ANY = "*"
LOCAL = "local"


def queues_of(models: Iterable[str] | None, is_remote: Callable[[str], bool]) -> frozenset[str]:
    if models is None:
        return frozenset({ANY})
    return frozenset(f"upstream:{m}" if is_remote(m) else LOCAL for m in models)


def overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    if not a or not b:
        return False
    return ANY in a or ANY in b or not a.isdisjoint(b)
