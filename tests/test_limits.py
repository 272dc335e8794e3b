"""EngineLimits: settings win, zeros are derived from the machine and the model."""

from __future__ import annotations

import pytest

from localserve.batching.limits import EngineLimits
from localserve.config import Settings
from localserve.errors import ConfigError

GIB = 1024**3


UNIFIED = Settings(kv_unified=True)


def test_zero_settings_are_derived_from_cores_ram_and_model():
    small = EngineLimits.from_settings(UNIFIED, n_ctx_train=8192, model_bytes=100 * 2**20,
                                       kv_bytes_per_token=23_040, cores=2, ram_bytes=16 * GIB)
    big = EngineLimits.from_settings(UNIFIED, n_ctx_train=32768, model_bytes=4 * GIB,
                                     kv_bytes_per_token=131_072, cores=16, ram_bytes=64 * GIB)
    assert small.n_ctx_seq == 8192 and big.n_ctx_seq == 8192  # capped for automatic sizing
    assert small.max_sequences < big.max_sequences and small.batch_tokens < big.batch_tokens
    assert small.batch_tokens >= small.max_sequences
    assert small.n_ctx >= small.n_ctx_seq and small.n_ctx % 256 == 0
    assert small.n_seq_max == 2 * small.max_sequences  # parked prefix-cache entries need ids too


def test_kv_cells_shrink_to_the_ram_left_after_the_weights():
    tight = EngineLimits.from_settings(UNIFIED, n_ctx_train=4096, model_bytes=7 * GIB,
                                       kv_bytes_per_token=512 * 1024, cores=8, ram_bytes=8 * GIB)
    # A quarter of the 1 GiB left is 512 cells: less than one full context, so one full context.
    assert tight.n_ctx == 4096 and tight.n_ctx_seq == 4096


def test_settings_win_and_are_kept_consistent():
    settings = Settings(context_length=2048, max_sequences=64, batch_tokens=32, queue_size=5,
                        queue_timeout=9.0, prefix_cache=False)
    limits = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, cores=2, ram_bytes=8 * GIB)
    assert limits.n_ctx_seq == 2048 and limits.queue_size == 5 and limits.queue_timeout == 9.0
    assert limits.max_sequences == 32  # every running sequence needs a token of the step budget
    assert not limits.prefix_cache and limits.n_seq_max == 32
    # A context longer than the model was trained for is cut to what it was trained for.
    assert EngineLimits.from_settings(Settings(context_length=16384), n_ctx_train=8192, model_bytes=0).n_ctx_seq == 8192


def test_nonsense_limits_are_a_config_error():
    with pytest.raises(ConfigError):
        EngineLimits(max_sequences=0)


def test_streams_give_every_sequence_id_a_full_stream():
    # The default: one KV stream per sequence id, parked prefix-cache ids included.
    limits = EngineLimits.from_settings(Settings(), n_ctx_train=8192, model_bytes=100 * 2**20,
                                        kv_bytes_per_token=23_040, cores=2, ram_bytes=16 * GIB)
    assert not limits.kv_unified
    assert limits.n_ctx_seq == 4096  # the automatic per-request context is smaller with streams
    assert limits.n_ctx == limits.n_ctx_seq * limits.n_seq_max


def test_streams_shrink_the_sequence_count_before_the_context():
    # 1 GiB left, a quarter of it is 512 cells of 512 KiB: too little for 32 streams of 2048, so
    # run fewer sequences; never cramp a request below 2048 tokens.
    tight = EngineLimits.from_settings(Settings(), n_ctx_train=4096, model_bytes=7 * GIB,
                                       kv_bytes_per_token=512 * 1024, cores=8, ram_bytes=8 * GIB)
    assert tight.max_sequences == 1 and tight.n_ctx_seq == 2048
    assert tight.n_ctx == tight.n_ctx_seq * tight.n_seq_max
    roomy = EngineLimits.from_settings(Settings(context_length=8192), n_ctx_train=8192, model_bytes=GIB,
                                       kv_bytes_per_token=23_040, cores=4, ram_bytes=64 * GIB)
    assert roomy.n_ctx_seq == 8192 and roomy.max_sequences == 16


def test_streams_are_sized_for_the_sequences_that_can_run():
    # max_sequences above the step budget (or llama.cpp's id limit) is clamped before the streams
    # are sized: one stream per usable id, none allocated for sequences that can never run.
    for settings in (Settings(context_length=2048, max_sequences=64, batch_tokens=32, prefix_cache=False),
                     Settings(max_sequences=200, prefix_cache=False)):
        limits = EngineLimits.from_settings(settings, n_ctx_train=8192, model_bytes=0, cores=2, ram_bytes=64 * GIB)
        assert limits.max_sequences <= min(limits.batch_tokens, 128)
        assert limits.n_ctx == limits.n_ctx_seq * limits.n_seq_max
