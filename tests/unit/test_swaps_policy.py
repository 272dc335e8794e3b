"""The swap policy (runtime/swaps.py) on its own: which loaded model makes room, in which order, and
when the thrash guard holds it. The real models' swaps are tests/model/test_model_swaps.py."""

from __future__ import annotations


import pytest

from localserve.errors import QueueFullError
from localserve.runtime.swaps import LoadQueues, Resident, Room, Waiter, admits, make_room

GUARD = 10.0
NOW = 1000.0
MB = 1 << 20


def resident(name: str, *work: str, age: float = 60.0, used: float = 0.0, mb: int = 100) -> Resident:
    return Resident(name, mb * MB, loaded_at=NOW - age, last_used=NOW - used, work=tuple(work))


def decide(residents: list[Resident], lane: str = "interactive", room: Room | None = None, mb: int = 100):
    return make_room(residents, mb * MB, room or Room(10_000 * MB, max_models=1), lane, min_residency=GUARD, now=NOW)


def test_fits_without_anyone_leaving() -> None:
    assert decide([resident("a", "interactive")], room=Room(10_000 * MB)).ready


def test_an_idle_model_goes_at_once_even_when_just_loaded() -> None:
    out = decide([resident("a", age=0.5)])
    assert out.unload == ["a"] and out.ready and not out.drain


def test_least_recently_used_idle_model_goes_first() -> None:
    room = Room(350 * MB)  # the new one fits beside two of the three
    out = decide([resident("a", used=5), resident("b", used=50), resident("c", used=1)], room=room)
    assert out.unload == ["b"] and out.ready


def test_batch_only_work_is_preempted_for_a_better_lane_without_the_guard() -> None:
    out = decide([resident("a", "batch", "batch", age=0.5)], lane="default")
    assert out.preempt == ["a"] and not out.ready and out.recheck_at is None


def test_batch_work_is_not_preempted_for_another_batch() -> None:
    out = decide([resident("a", "batch", age=0.5)], lane="batch")
    assert out.guarded == ["a"] and out.recheck_at == NOW - 0.5 + GUARD and not out.preempt


def test_busy_model_keeps_its_slot_until_the_guard_ends_then_drains() -> None:
    young = decide([resident("a", "interactive", age=3.0)])
    assert young.guarded == ["a"] and young.recheck_at == NOW - 3.0 + GUARD and not young.drain
    old = decide([resident("a", "interactive", "batch", age=GUARD)])
    assert old.drain == ["a"] and not old.ready and old.recheck_at is None


def test_a_model_still_loading_is_never_a_victim() -> None:
    loading = Resident("a", 100 * MB, NOW, NOW, (), loading=True)
    out = decide([loading])
    assert not out.ready and not (out.unload or out.drain or out.preempt or out.guarded)


def test_models_unloading_count_until_their_memory_is_back() -> None:
    assert not Room(10_000 * MB, max_models=1, freeing=1, freeing_bytes=100 * MB).fits([], 100 * MB)
    assert not Room(150 * MB, freeing=1, freeing_bytes=100 * MB).fits([], 100 * MB)
    assert Room(150 * MB).fits([], 400 * MB)  # alone, a model larger than the budget still loads


def test_a_draining_model_admits_only_better_lanes() -> None:
    assert admits(None, "batch")
    assert admits("default", "interactive") and not admits("default", "default") and not admits("default", "batch")


async def test_load_queue_bound_is_per_model_and_lane() -> None:  # async: a Waiter needs a running loop
    queues = LoadQueues(2, retry_after=lambda model: 7.0)
    for _ in range(2):
        queues.add(Waiter("b", "interactive", None, MB))
    with pytest.raises(QueueFullError) as err:
        queues.add(Waiter("b", "interactive", None, MB))
    assert err.value.http_status == 429 and err.value.retry_after == 7.0
    queues.add(Waiter("b", "batch", None, MB))  # another lane
    queues.add(Waiter("c", "interactive", None, MB))  # another model
    [c_row, b_row] = sorted(queues.rows(), key=lambda r: r["name"], reverse=True)
    assert b_row["waiting"] == {"interactive": 2, "default": 0, "batch": 1} and b_row["state"] == "waiting"
    assert [w.model for w in queues.ordered()][:3] == ["b", "b", "c"] and queues.ordered()[-1].lane == "batch"
