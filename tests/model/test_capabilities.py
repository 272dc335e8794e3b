"""The Backend contract's Capabilities: a backend must declare them, and the scheduler's chunking,
prefix-cache and id rules come from them (fake backend), and llama.cpp declares its own (real model)."""

from __future__ import annotations

import random

import pytest

from fake_backend import FakeBackend
from localserve.backends.base import Backend, Capabilities, declared_capabilities
from localserve.batching.limits import EngineLimits
from localserve.batching.scheduler import Scheduler
from scheduler_harness import Harness, alone

_CAPS = dict(max_batch_tokens=64, kv_cells=1024, kv_cells_per_seq=1024, max_seqs=8, prefix_sharing="share",
             consecutive_ids=False, micro_batch=64)
_LIMITS = EngineLimits(max_sequences=4, batch_tokens=64, n_ctx=1024, n_ctx_seq=1024)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


def _backend_class(**members) -> type[Backend]:
    """A Backend with the fake's working compute, KV and tokenizer methods and `members` on top."""
    names = ("decode", "new_sampler", "embed", "kv_remove", "kv_copy", "kv_pos_max", "tokenize",
             "token_to_bytes", "is_eog")
    return type("Partial", (Backend,), {**{n: getattr(FakeBackend, n) for n in names}, **members})


def test_a_backend_that_declares_no_capabilities_cannot_be_constructed():
    with pytest.raises(TypeError, match="capabilities"):
        _backend_class()()


def test_the_scheduler_refuses_capabilities_that_are_not_a_capabilities_object():
    # llama.cpp-shaped members in a dict are not a declaration the scheduler plans by.
    backend = _backend_class(capabilities={"n_batch": 64, "n_ubatch": 64, "kv_unified": True})()
    with pytest.raises(TypeError, match="Partial.capabilities must be a Capabilities, not dict"):
        Scheduler(declared_capabilities(backend), _LIMITS)
    with pytest.raises(TypeError, match="the scheduler plans by a Capabilities, not dict"):
        Scheduler(backend.capabilities, _LIMITS)


@pytest.mark.parametrize("bad, message", [
    (dict(min_recompute=0), "min_recompute must be at least 1"),
    (dict(max_seqs=0), "max_seqs must be at least 1"),
    (dict(prefix_sharing="sometimes"), "prefix_sharing must be one of"),
    (dict(kv_cells_per_seq=2048), "kv_cells_per_seq exceeds kv_cells"),
    (dict(min_chunk=8, micro_batch=4), "min_chunk <= micro_batch <= max_batch_tokens"),
    (dict(micro_batch=128), "min_chunk <= micro_batch <= max_batch_tokens"),
])
def test_inconsistent_capabilities_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        Capabilities(**{**_CAPS, **bad})


def test_chunk_rule_never_leaves_fewer_than_min_chunk_tokens_behind_or_alone():
    llama = Capabilities(**{**_CAPS, "micro_batch": 16, "min_chunk": 2})
    assert llama.chunk(10, 9) == 8  # 9 would leave one token for a later step
    assert llama.chunk(3, 2) == 0  # 2 leaves one, 1 is alone: nothing fits this step
    assert llama.chunk(18, 17) == 16  # 17 would put one token alone in the second micro-batch
    assert llama.chunk(17, 17) == 15  # whole, its last micro-batch would be one row; 16 leaves one
    assert llama.chunk(18, 40) == 18
    anything = Capabilities(**_CAPS)  # min_chunk 1: any cut goes
    assert anything.chunk(10, 9) == 9 and anything.chunk(3, 2) == 2 and anything.chunk(18, 17) == 17
    wide = Capabilities(**{**_CAPS, "micro_batch": 16, "min_chunk": 4})
    assert wide.chunk(41, 34) == 32  # 34 and 33 leave 2 and 1 rows in the last micro-batch
    assert wide.chunk(3, 40) == 3  # a prompt shorter than min_chunk goes whole
    assert wide.chunk(3, 2) == 0


@pytest.mark.parametrize("rule, expected", [
    (dict(), [34, 7, 1]),  # the fake's default: one pass per decode, two-token rule
    (dict(micro_batch=16, min_chunk=4), [32, 9, 1]),
])
def test_prompt_chunks_are_cut_by_the_backends_declared_rule(rule, expected):
    prompt = _prompt(1, 41)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, **rule), batch_tokens=34)
    r = h.submit(prompt, max_tokens=2)
    h.run()
    assert [len(batch) for batch in h.backend.batches] == expected  # the request runs alone
    assert r.tokens == alone(prompt, 2)  # another cut, the same answer
    h.assert_drained()


@pytest.mark.parametrize("min_recompute", [1, 2, 5])
def test_a_prefix_hit_recomputes_the_declared_number_of_prompt_tokens(min_recompute):
    prompt = _prompt(2, 40)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, min_recompute=min_recompute))
    first = h.submit(prompt, max_tokens=4)
    h.run()
    second = h.submit(prompt, max_tokens=4)
    h.run()
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 40 - min_recompute
    assert second.tokens == first.tokens
    h.assert_drained()


@pytest.mark.parametrize("min_recompute, adopted", [(2, False), (5, True)])
def test_a_hit_adopts_a_parked_entry_when_what_it_leaves_unused_is_within_min_recompute(min_recompute, adopted):
    prompt = _prompt(3, 40)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, min_recompute=min_recompute))
    first = h.submit(prompt, max_tokens=1)
    h.run()
    (entry_id,) = h.sched.cache.parked  # the 40 prompt tokens, parked where they ran
    # Shares 36 tokens with the entry: 4 of its tokens stay unused.
    follow_up = prompt[:36] + [t % 63 + 1 for t in prompt[36:]] + [7, 7]
    second = h.submit(follow_up, max_tokens=6)
    h.step()
    entries = [e.tokens for e in h.sched.cache.parked.values()]
    # Adopted, the entry is gone into the request; otherwise it stays whole for a request that
    # extends it (on an id of its own, copied aside: Scheduler._start).
    assert entries == ([] if adopted else [prompt])
    assert (second.seq.seq_id == entry_id) is (adopted or h.sched.caps.consecutive_ids)
    h.run()
    assert second.usage.cached_tokens == 36
    assert second.tokens == alone(follow_up, 6)
    assert first.tokens == alone(prompt, 1)
    h.assert_drained()


@pytest.mark.parametrize("consecutive", [True, False])
def test_running_ids_are_moved_together_only_for_a_backend_that_needs_it(consecutive):
    prompts = [_prompt(10 + i, 12) for i in range(3)]
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, consecutive_ids=consecutive), max_sequences=4)
    results = [h.submit(p, max_tokens=n) for p, n in zip(prompts, (20, 2, 20))]
    h.run()  # the middle request finishes first, leaving a hole between the other two
    assert (h.sched.pool.moves > 0) is consecutive
    for p, r, n in zip(prompts, results, (20, 2, 20)):
        assert r.tokens == alone(p, n)
    h.assert_drained()


@pytest.mark.model
@pytest.mark.parametrize("kv_unified", [False, True])
def test_llamacpp_declares_its_context_and_rules(smollm2_gguf, kv_unified):
    from llamacpp_helpers import load

    with load(smollm2_gguf, n_ctx=4 * 256, n_seq_max=4, n_batch=256, kv_unified=kv_unified,
              flash_attention=False) as backend:
        caps = backend.capabilities
    assert (caps.max_batch_tokens, caps.kv_cells, caps.max_seqs, caps.micro_batch) == (256, 1024, 4, 256)
    assert (caps.min_chunk, caps.min_recompute) == (2, 2)
    assert caps.constraints == {"gbnf", "json_schema"} and caps.embeddings
    if kv_unified:  # one pool: prefixes shared, any ids batch together
        assert (caps.prefix_sharing, caps.consecutive_ids, caps.kv_cells_per_seq) == ("share", False, 1024)
    else:  # a stream per sequence: prefixes copied, only consecutive ids batch together
        assert (caps.prefix_sharing, caps.consecutive_ids, caps.kv_cells_per_seq) == ("copy", True, 256)
