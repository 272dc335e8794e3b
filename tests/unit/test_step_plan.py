"""The planner alone: Scheduler built from a Capabilities and nothing else (no backend, no model).

Every change the scheduler makes to its KV books must come out as data on the next StepPlan
(batching/kv_ops.py), since engine/step.py is the only code that touches the backend. These tests
feed postprocess hand-made StepResults (a token, an interrupt, a full cache, a failed decode) and
read the operations the plans carry: a prefix-cache hit is a copy before the batch that relies on
it, an adopted entry a trim of its tail, parking costs nothing, a dropped sequence is a remove,
rollback costs nothing (the backend kept nothing), and moves happen only where ids must be
consecutive.
"""

from __future__ import annotations

from localserve.backends.base import Capabilities, SampledToken
from localserve.batching.kv_ops import KVCopy, KVMove, KVRemove
from localserve.batching.limits import EngineLimits
from localserve.batching.scheduler import Scheduler, StepPlan, StepResult
from localserve.batching.sequence import Sequence, Status
from localserve.protocol.requests import GenerationRequest, SamplingParams

# llama.cpp with a KV stream per sequence (copies copy, ids must be consecutive) and a shared pool
# with no id rule (ONNX Runtime's, llama.cpp's unified one).
STREAMS = Capabilities(max_batch_tokens=64, kv_cells=512, kv_cells_per_seq=64, max_seqs=8, prefix_sharing="copy",
                       consecutive_ids=True, micro_batch=64, min_chunk=2, min_recompute=2)
POOL = Capabilities(max_batch_tokens=64, kv_cells=512, kv_cells_per_seq=512, max_seqs=8, prefix_sharing="share",
                    consecutive_ids=False, micro_batch=64, min_chunk=2, min_recompute=2)
SYSTEM = list(range(10, 30))  # a shared prompt prefix of 20 tokens


def planner(caps: Capabilities, max_sequences: int = 4, prefix_cache: bool = True) -> Scheduler:
    return Scheduler(caps, EngineLimits(max_sequences=max_sequences, batch_tokens=caps.max_batch_tokens,
                                        n_ctx=caps.kv_cells, n_ctx_seq=caps.kv_cells_per_seq,
                                        prefix_cache=prefix_cache))


def submit(sched: Scheduler, prompt: list[int], max_tokens: int = 8, lane: str = "default") -> Sequence:
    request = GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, lane=lane,  # type: ignore[arg-type]
                                sampling=SamplingParams(temperature=0))
    seq = Sequence(request, None, lambda token: b"x", lambda token: False, sched.n_ctx_seq)
    sched.add(seq)
    return seq


def sampled(plan: StepPlan, token: int = 5) -> StepResult:
    """The outcome of a decode that went well: one token for every row the plan samples."""
    return StepResult("done", [SampledToken(token) for _ in plan.outputs])


def step(sched: Scheduler) -> StepPlan:
    plan = sched.schedule()
    sched.postprocess(plan, sampled(plan))
    return plan


def positions(plan: StepPlan, seq: Sequence) -> list[int]:
    return [t.pos for t in plan.batch if t.seq_id == seq.seq_id]


def test_a_prefix_hit_is_a_copy_before_the_batch_that_relies_on_it():
    for caps in (STREAMS, POOL):
        sched = planner(caps)
        a = submit(sched, SYSTEM + [1])
        first = step(sched)
        assert first.kv_ops == []  # a fresh id holds nothing: nothing to do to the cache
        b = submit(sched, SYSTEM + [2, 3])
        plan = step(sched)
        # b's batch starts where the copied prefix ends, and the copy comes with the same plan.
        assert plan.kv_ops == [KVCopy(a.seq_id, b.seq_id, 0, len(SYSTEM))]
        assert positions(plan, b) == [len(SYSTEM), len(SYSTEM) + 1]
        assert b.cached_tokens == len(SYSTEM)
        # With streams the copy is new cells of b's own; in a pool b shares a's.
        extra = len(SYSTEM) if caps.prefix_sharing == "copy" else 0
        assert sched.pool.used == len(a.cells) + 2 + extra


def test_a_follow_up_adopts_the_parked_entry_and_trims_only_its_tail():
    sched = planner(POOL)
    a = submit(sched, SYSTEM, max_tokens=1)
    step(sched)
    assert a.finished and list(sched.cache.parked) == [0]
    parked_plan = sched.schedule()
    assert parked_plan.kv_ops == [] and not parked_plan.batch  # parking costs the cache nothing
    # Shares all but the entry's last token: it takes the entry's id over, minus that one cell.
    b = submit(sched, SYSTEM[:-1] + [7, 8, 9])
    plan = step(sched)
    assert b.seq_id == 0 and not sched.cache.parked
    assert plan.kv_ops == [KVRemove(0, len(SYSTEM) - 1, -1)]
    assert positions(plan, b) == [len(SYSTEM) - 1, len(SYSTEM), len(SYSTEM) + 1]


def _beside_chats(sched: Scheduler, n: int) -> list[Sequence]:
    chats = [submit(sched, [200 + i, 201, 202, 203], max_tokens=40) for i in range(n)]
    step(sched)
    return chats


def test_a_hit_on_a_finished_entry_beside_running_ones_costs_one_stream_copy():
    # With streams a copy copies a whole stream and makes llama.cpp reserve its graph again: the
    # entry is copied aside (above the running range) and the new request runs on its id, where
    # a copy into a new id and two moves back to consecutive ids were three copies.
    sched = planner(STREAMS, max_sequences=6)
    chats = _beside_chats(sched, 3)
    a = submit(sched, SYSTEM + [1, 2], max_tokens=3)
    while not a.finished:
        step(sched)
    (entry,) = sched.cache.parked.values()
    original = entry.seq_id
    assert original == 3 and len(entry.tokens) == len(SYSTEM) + 4
    b = submit(sched, SYSTEM + [7, 8])
    plan = step(sched)
    up = sched.pool.n_running
    assert plan.kv_ops == [KVCopy(original, up, 0, len(SYSTEM) + 4), KVRemove(original, len(SYSTEM), -1)]
    assert b.seq_id == original and sorted(q.seq_id for q in sched.running) == [0, 1, 2, 3]
    # The entry is whole on its new id: the next turn of a's conversation still takes it over.
    assert list(sched.cache.parked) == [up] and sched.cache.parked[up].tokens == entry.tokens
    c = submit(sched, entry.tokens + [9, 10])
    plan = step(sched)
    # Taken over whole, and moved into the running block: no copy of its prefix.
    assert c.cached_tokens == len(entry.tokens) and plan.kv_ops == [KVMove(up, 4)] and c.seq_id == 4
    assert all(not q.finished for q in chats)


def test_what_a_cancelled_request_left_is_taken_over_by_the_next_hit():
    # An editor's completion superseded by the next keystroke: nobody extends its answer, so the
    # next request takes its id and cells over, whatever it shares; no copy in either cache.
    for caps in (STREAMS, POOL):
        sched = planner(caps, max_sequences=6)
        _beside_chats(sched, 3)
        a = submit(sched, SYSTEM + [1, 2], max_tokens=30)
        step(sched)
        step(sched)
        a.cancelled = True
        step(sched)
        (entry,) = sched.cache.parked.values()
        held = entry.seq_id
        assert entry.disposable and len(entry.tokens) > len(SYSTEM) + 2
        b = submit(sched, SYSTEM + [1, 3, 4])
        plan = step(sched)
        assert plan.kv_ops == [KVRemove(held, len(SYSTEM) + 1, -1)]
        assert b.seq_id == held and b.cached_tokens == len(SYSTEM) + 1 and not sched.cache.parked


def test_a_finished_sequence_without_a_cache_is_removed_in_its_steps_output():
    sched = planner(POOL, prefix_cache=False)
    a = submit(sched, [1, 2, 3, 4], max_tokens=1)
    plan = sched.schedule()
    output = sched.postprocess(plan, sampled(plan))
    assert a.finished and sched.pool.used == 0  # the books freed it at once...
    # ...and the step's output tells the cache (the engine applies it before the next plan),
    # whoever gets the id next.
    assert output.kv_ops == [KVRemove(0)] and output.updated == [a]
    b = submit(sched, [5, 6, 7, 8])
    plan = step(sched)
    assert plan.kv_ops == [] and b.seq_id == 0


def test_a_parked_entry_in_the_running_range_moves_out_of_the_way():
    sched = planner(POOL, max_sequences=1)  # one running id (0); parked entries live above it
    a = submit(sched, SYSTEM, max_tokens=1)
    step(sched)
    assert list(sched.cache.parked) == [0]
    submit(sched, [40, 41, 42, 43, 44])  # shares nothing with the entry: it needs id 0 back
    plan = step(sched)
    assert plan.kv_ops == [KVMove(0, 1)] and list(sched.cache.parked) == [1]
    assert a.seq_id == -1 and sched.cache.parked[1].tokens == SYSTEM


def test_a_rolled_back_step_costs_no_kv_operation_and_is_planned_again():
    sched = planner(STREAMS)
    a = submit(sched, SYSTEM)
    plan = sched.schedule()
    used = sched.pool.used
    assert used == len(SYSTEM)
    output = sched.postprocess(plan, StepResult("interrupted", seconds=0.01))
    # The backend kept nothing of an interrupted batch, so undoing it is bookkeeping alone.
    assert sched.pool.used == 0 and a.num_computed == 0 and output.kv_ops == [] and output.updated == []
    assert sched.interrupted_steps == 1
    again = sched.schedule()
    assert again.batch == plan.batch and again.kv_ops == []


def test_a_full_cache_comes_back_as_data_and_evicts_an_entry():
    sched = planner(POOL)
    a = submit(sched, SYSTEM, max_tokens=1)
    step(sched)
    b = submit(sched, [50, 51, 52, 53, 54, 55])
    plan = sched.schedule()
    # Our books were optimistic (the decode found no room): the step is undone and the parked
    # entry goes, a remove the step's output carries (the engine applies it before the retry).
    output = sched.postprocess(plan, StepResult("kv_full"))
    assert not sched.cache.parked and b.num_computed == 0 and b.status is Status.RUNNING
    assert sched.pool.used == 0 and output.kv_ops == [KVRemove(0)]
    retry = step(sched)
    assert retry.kv_ops == [] and positions(retry, b) == list(range(6))
    assert a.finished


def test_a_failed_decode_drops_its_requests_kv_never_parks_it():
    sched = planner(POOL)
    a = submit(sched, SYSTEM)
    plan = sched.schedule()
    seq_id = a.seq_id
    output = sched.postprocess(plan, StepResult("failed"))
    assert a.finish_reason == "error" and not sched.cache.parked and sched.pool.used == 0
    assert output.kv_ops == [KVRemove(seq_id)] and output.updated == [a] and a.seq_id == -1


def test_moves_to_consecutive_ids_happen_only_where_the_backend_needs_them():
    for caps in (STREAMS, POOL):
        sched = planner(caps)
        seqs = [submit(sched, [60 + i] * 6, max_tokens=12) for i in range(3)]
        step(sched)
        ops = []
        middle = seqs[1]
        middle.cancelled = True  # finishes next step: parked on id 1, a hole between 0 and 2
        for _ in range(4):
            ops += step(sched).kv_ops
        ids = sorted(s.seq_id for s in sched.running)
        if caps.consecutive_ids:
            assert any(isinstance(op, KVMove) for op in ops)
            assert ids == list(range(ids[0], ids[0] + len(ids)))
        else:
            assert not any(isinstance(op, KVMove) for op in ops) and ids == [0, 2]


def test_batch_decoders_sit_out_a_better_lanes_prompt_only_under_streams():
    for caps in (STREAMS, POOL):
        sched = planner(caps)
        batch = submit(sched, [1, 2, 3, 4], max_tokens=20, lane="batch")
        step(sched)
        assert batch.pending == 1  # decoding now
        chat = submit(sched, [5, 6, 7, 8, 9], lane="interactive")
        plan = step(sched)
        fed = {id(seq) for seq, _ in plan.scheduled}
        assert id(chat) in fed
        # llama.cpp's per-stream splitter makes riding batch rows cost the prompt's step a
        # micro-batch (Scheduler._sit_out); without that splitter they simply decode.
        assert (id(batch) in fed) is (not caps.consecutive_ids)
