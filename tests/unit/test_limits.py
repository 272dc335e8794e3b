"""EngineLimits: settings win, zeros are derived from the machine and the model."""

from __future__ import annotations

import pytest

from localserve.backends.llamacpp.sizing import plan_kv
from localserve.batching.limits import EngineLimits
from localserve.config.settings import Settings
from localserve.errors import ConfigError
from localserve.store.gguf_facts import GGUFFacts
from localserve.runtime.memory import KV_BYTES, kv_cache_bytes

GIB = 1024**3


UNIFIED = Settings(kv_layout="unified")


def test_zero_settings_are_derived_from_cores_ram_and_model():
    small = EngineLimits.from_settings(UNIFIED, n_ctx_train=8192, model_bytes=100 * 2**20,
                                       kv_bytes_per_token=23_040, cores=2, ram_bytes=16 * GIB, plan_kv=plan_kv)
    big = EngineLimits.from_settings(UNIFIED, n_ctx_train=32768, model_bytes=4 * GIB,
                                     kv_bytes_per_token=131_072, cores=16, ram_bytes=64 * GIB, plan_kv=plan_kv)
    assert small.n_ctx_seq == 8192 and big.n_ctx_seq == 8192  # capped for automatic sizing
    assert small.max_sequences < big.max_sequences and small.batch_tokens < big.batch_tokens
    assert small.batch_tokens >= small.max_sequences
    assert small.n_ctx >= small.n_ctx_seq and small.n_ctx % 256 == 0
    assert small.n_seq_max == 2 * small.max_sequences  # parked prefix-cache entries need ids too


def test_kv_cells_shrink_to_the_ram_left_after_the_weights():
    tight = EngineLimits.from_settings(UNIFIED, n_ctx_train=4096, model_bytes=7 * GIB,
                                       kv_bytes_per_token=512 * 1024, cores=8, ram_bytes=8 * GIB, plan_kv=plan_kv)
    # A quarter of the 1 GiB left is 512 cells: less than one full context, so one full context.
    assert tight.n_ctx == 4096 and tight.n_ctx_seq == 4096


def test_settings_win_and_are_kept_consistent():
    settings = Settings(context_length=2048, max_sequences=64, batch_tokens=32, queue_size=5,
                        queue_timeout=9.0, prefix_cache=False)
    limits = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, cores=2, ram_bytes=8 * GIB, plan_kv=plan_kv)
    assert limits.n_ctx_seq == 2048 and limits.queue_size == 5 and limits.queue_timeout == 9.0
    assert limits.max_sequences == 32  # every running sequence needs a token of the step budget
    assert not limits.prefix_cache and limits.n_seq_max == 32
    # A context longer than the model was trained for is cut to what it was trained for.
    assert EngineLimits.from_settings(Settings(context_length=16384), n_ctx_train=8192, model_bytes=0, plan_kv=plan_kv).n_ctx_seq == 8192


def test_nonsense_limits_are_a_config_error():
    with pytest.raises(ConfigError):
        EngineLimits(max_sequences=0)


def test_streams_give_every_sequence_id_a_full_stream():
    # Where they fit, streams: one KV stream per sequence id, parked prefix-cache ids included.
    limits = EngineLimits.from_settings(Settings(), n_ctx_train=8192, model_bytes=100 * 2**20,
                                        kv_bytes_per_token=23_040, cores=2, ram_bytes=16 * GIB, plan_kv=plan_kv)
    assert not limits.kv_unified and limits.kv_type == "f16" and not limits.flash_attention
    assert limits.n_ctx_seq == 8192
    assert limits.n_ctx == limits.n_ctx_seq * limits.n_seq_max


def test_streams_shrink_the_sequence_count_before_the_context():
    # 1 GiB left, a quarter of it is 512 cells of 512 KiB: too little for 32 streams of 2048, so
    # run fewer sequences; never cramp a request below 2048 tokens.
    tight = EngineLimits.from_settings(Settings(kv_layout="streams"), n_ctx_train=4096, model_bytes=7 * GIB,
                                       kv_bytes_per_token=512 * 1024, cores=8, ram_bytes=8 * GIB, plan_kv=plan_kv)
    assert tight.max_sequences == 1 and tight.n_ctx_seq == 2048
    assert tight.n_ctx == tight.n_ctx_seq * tight.n_seq_max
    roomy = EngineLimits.from_settings(Settings(kv_layout="streams", context_length=8192), n_ctx_train=8192, model_bytes=GIB,
                                       kv_bytes_per_token=23_040, cores=4, ram_bytes=64 * GIB, plan_kv=plan_kv)
    assert roomy.n_ctx_seq == 8192 and roomy.max_sequences == 16


def test_streams_are_sized_for_the_sequences_that_can_run():
    # max_sequences above the step budget (or llama.cpp's id limit) is clamped before the streams
    # are sized: one stream per usable id, none allocated for sequences that can never run.
    for settings in (Settings(context_length=2048, max_sequences=64, batch_tokens=32, prefix_cache=False),
                     Settings(kv_layout="streams", max_sequences=200, prefix_cache=False)):
        limits = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, cores=2, ram_bytes=64 * GIB, plan_kv=plan_kv)
        assert limits.max_sequences <= min(limits.batch_tokens, 128)
        assert limits.n_ctx == limits.n_ctx_seq * limits.n_seq_max


# --- the automatic limits on consumer machines ---------------------------------------------------
# Model facts the way tests/unit/test_placement.py builds them: shapes and sizes of the Q4_K_M / Q4_1
# files people run. KV bytes per token come from memory.kv_cache_bytes, as plan_model passes them.
def _facts(**kw) -> GGUFFacts:
    base = dict(architecture="llama", name=None, n_params=0, quant="Q4_K_M", file_type_id=15,
                tokenizer_model="gpt2", chat_template=None, license=None, bos_token_id=1, eos_token_id=2,
                tensor_count=0, gguf_version=3, layer_bytes=0, largest_layer_bytes=0)
    return GGUFFacts(**{**base, **kw})


# Llama-3.1-8B-Instruct Q4_K_M: 32 layers x 8 KV heads x 128, 128 KiB of f16 KV per token.
LLAMA_8B = _facts(n_layers=32, n_heads=32, n_kv_heads=8, n_embd=4096, head_dim=128, head_dim_v=128,
                  context_length=131072, vocab_size=128256, file_size=4_920_739_232,
                  weights_bytes=4_920_000_000, kv_heads_all_layers=256)
# Qwen2.5-1.5B-Instruct Q4_K_M: 28 layers x 2 KV heads x 128, 28 KiB per token.
QWEN_1_5B = _facts(architecture="qwen2", n_layers=28, n_heads=12, n_kv_heads=2, n_embd=1536, head_dim=128,
                   head_dim_v=128, context_length=32768, vocab_size=151936, file_size=1_117_320_736,
                   weights_bytes=1_117_000_000, kv_heads_all_layers=56)
# SmolLM2-135M-Instruct Q4_1 (the test model): 30 layers x 3 KV heads x 64, 22.5 KiB per token.
SMOLLM2 = _facts(n_layers=30, n_heads=9, n_kv_heads=3, n_embd=576, head_dim=64, head_dim_v=64,
                 context_length=8192, vocab_size=49152, file_size=96_991_232, weights_bytes=96_576_768,
                 quant="Q4_1", kv_heads_all_layers=90)


def _auto(facts: GGUFFacts, ram_gib: int, cores: int, settings: Settings = Settings()) -> EngineLimits:
    return EngineLimits.from_settings(settings, n_ctx_train=facts.context_length, model_bytes=facts.weights_bytes,
                                      kv_bytes_per_token=kv_cache_bytes(facts, 1), cores=cores,
                                      ram_bytes=ram_gib * GIB, plan_kv=plan_kv)


def _kv_bytes(facts: GGUFFacts, limits: EngineLimits) -> int:
    return kv_cache_bytes(facts, limits.n_ctx, KV_BYTES[limits.kv_type])


def _kv_budget(facts: GGUFFacts, ram_gib: int) -> float:
    """The KV budget the old limits used: a quarter of the RAM the weights leave."""
    return (ram_gib * GIB - facts.weights_bytes) * 0.25


@pytest.mark.parametrize("facts, ram_gib, cores, ctx, concurrent", [
    (LLAMA_8B, 16, 8, 8192, 4),     # the laptop of issue 8: used to get 4 x 2,816
    (LLAMA_8B, 32, 8, 8192, 4),
    (QWEN_1_5B, 8, 4, 8192, 8),
    (SMOLLM2, 24, 2, 8192, 8),      # this project's CI machine
])
def test_consumer_machines_get_long_contexts_and_concurrency(facts, ram_gib, cores, ctx, concurrent):
    limits = _auto(facts, ram_gib, cores)
    assert limits.n_ctx_seq >= ctx
    assert limits.max_sequences >= concurrent
    # Not just admitted: that many requests hold their whole context at the same time...
    assert limits.full_length_requests >= concurrent
    assert limits.n_ctx >= concurrent * ctx
    # ...within the same KV memory budget as before.
    assert _kv_bytes(facts, limits) <= _kv_budget(facts, ram_gib)


def test_streams_where_they_fit_unified_q8_where_they_do_not():
    # Exact answers (a stream per id, f16, no flash attention) wherever they give every running and
    # parked id a full-length stream; the 8B laptop gets a unified q8_0 pool instead.
    small = _auto(SMOLLM2, 24, 2)
    assert not small.kv_unified and small.kv_type == "f16" and not small.flash_attention
    laptop = _auto(LLAMA_8B, 16, 8)
    assert laptop.kv_unified and laptop.kv_type == "q8_0" and laptop.flash_attention
    assert laptop.n_ctx % 256 == 0


def test_exactness_is_a_setting():
    # kv_layout=streams keeps bit-exact answers at the price of a shorter context on the laptop.
    exact = _auto(LLAMA_8B, 16, 8, Settings(kv_layout="streams"))
    assert not exact.kv_unified and exact.kv_type == "f16" and not exact.flash_attention
    assert exact.n_ctx == exact.n_ctx_seq * exact.n_seq_max
    assert _kv_bytes(LLAMA_8B, exact) <= _kv_budget(LLAMA_8B, 16)
    assert exact.n_ctx_seq < 8192
    # An f16 pool when asked: half the cells of the q8_0 one.
    f16 = _auto(LLAMA_8B, 16, 8, Settings(kv_cache_type="f16"))
    q8 = _auto(LLAMA_8B, 16, 8)
    assert f16.kv_unified and f16.kv_type == "f16" and f16.n_ctx < q8.n_ctx


@pytest.mark.parametrize("name, value", [("kv_layout", "shared"), ("kv_cache_type", "q3_k"), ("kv_cache_type", "q8_0/f16/f16")])
def test_unknown_kv_settings_are_a_config_error(name, value):
    with pytest.raises(ConfigError, match=name):
        _auto(SMOLLM2, 24, 2, Settings(**{name: value}))


# --- each backend sizes its own cache (Backend.plan_kv) --------------------------------------------
def test_llamacpp_rules_are_the_llamacpp_backends_own():
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    # What runtime/planning.py sizes a load by (the sizing module's rules) is the backend's own plan.
    for settings in (Settings(), UNIFIED, Settings(kv_layout="streams"), Settings(kv_cache_type="f16"),
                     Settings(kv_layout="streams", max_sequences=200, prefix_cache=False)):
        for facts, ram_gib, cores in ((LLAMA_8B, 16, 8), (SMOLLM2, 24, 2), (QWEN_1_5B, 8, 4)):
            kw = dict(n_ctx_train=facts.context_length, model_bytes=facts.weights_bytes,
                      kv_bytes_per_token=kv_cache_bytes(facts, 1), cores=cores, ram_bytes=ram_gib * GIB)
            assert (EngineLimits.from_settings(settings, plan_kv=LlamaCppBackend.plan_kv, **kw)
                    == EngineLimits.from_settings(settings, **kw, plan_kv=plan_kv))


def test_a_backend_without_layout_rules_gets_one_unpadded_pool():
    from localserve.backends.base import Backend

    # The base rule: one shared pool for every running request at full length, within the budget;
    # no 256-cell padding, no q8_0 switch, no cap at llama.cpp's 128 running ids.
    settings = Settings(context_length=1000, max_sequences=200, batch_tokens=512)
    plain = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, kv_bytes_per_token=1000,
                                       cores=2, ram_bytes=64 * GIB, plan_kv=Backend.plan_kv)
    assert plain.kv_unified and plain.kv_type == "f16" and not plain.flash_attention
    assert plain.max_sequences == 200 and plain.n_seq_max == 400
    assert plain.n_ctx == 200 * 1000 and plain.n_ctx_seq == 1000
    llama = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, kv_bytes_per_token=1000,
                                       cores=2, ram_bytes=64 * GIB, plan_kv=plan_kv)
    assert llama.max_sequences == 128 and llama.n_seq_max == 256 and llama.n_ctx % 256 == 0
    # Tight memory: the budget's cells exactly, never below one request's context.
    tight = EngineLimits.from_settings(Settings(context_length=1000, max_sequences=4), n_ctx_train=8192,
                                       model_bytes=0, kv_bytes_per_token=1000, cores=2, ram_bytes=10_000_000,
                                       plan_kv=Backend.plan_kv)
    assert tight.n_ctx == 2500 and tight.max_sequences == 4
