"""KV-cache types per model, K and V apart (`model_kv_cache_type = ["NAME[:TAG]=K/V"]`): what the
settings accept and refuse when they load, and what the planner sizes with them."""

from __future__ import annotations

import pytest

from localserve.config.kv_cache import kv_element_bytes, model_kv_type, needs_flash_attention, parse_kv_type
from localserve.config.settings import Settings, load_settings, replace
from localserve.errors import ConfigError
from localserve.runtime.planning import gguf_limits

from test_limits import SMOLLM2

REF = "smollm2-135m:Q4_1"


def settings_from_env(tmp_path, **env: str) -> Settings:
    environ = {f"LOCALSERVE_{k.upper()}": v for k, v in env.items()}
    return load_settings(environ=environ, config_path=tmp_path / "none.toml")


def test_k_and_v_are_named_apart_or_together():
    assert parse_kv_type("q8_0/f16") == "q8_0/f16" and parse_kv_type(" Q8_0 / Q8_0 ") == "q8_0"
    assert parse_kv_type("iq4_nl") == "iq4_nl" and parse_kv_type("bf16/q5_1") == "bf16/q5_1"
    assert kv_element_bytes("q8_0/f16") == (34 / 32 + 2) / 2 and kv_element_bytes("f32") == 4
    assert needs_flash_attention("f16/q4_0") and not needs_flash_attention("q4_0/f16")
    for bad in ("q3_k", "q8_0/", "f16/f16/f16", ""):
        with pytest.raises(ValueError):
            parse_kv_type(bad)


def test_a_tag_entry_wins_over_the_name_and_others_get_the_setting(tmp_path):
    s = settings_from_env(tmp_path, model_kv_cache_type="smollm2-135m=q4_0, smollm2-135m:Q4_1=q8_0/f16, qwen=f16")
    assert s.model_kv_cache_type == ("smollm2-135m=q4_0", "smollm2-135m:Q4_1=q8_0/f16", "qwen=f16")
    assert model_kv_type(s.model_kv_cache_type, REF) == "q8_0/f16"
    assert model_kv_type(s.model_kv_cache_type, "smollm2-135m:Q8_0") == "q4_0"
    assert model_kv_type(s.model_kv_cache_type, "llama3:8b") is None


@pytest.mark.parametrize("entry, says", [
    ("smollm2-135m=q3_k/f16", "'q3_k', not a KV type llama.cpp offers"),
    ("smollm2-135m", "is not NAME[:TAG]=VALUE"),
    ("=q8_0", "is not NAME[:TAG]=VALUE"),
    ("smollm2-135m=q8_0/f16/f16", "is not K/V"),
])
def test_a_bad_entry_names_itself_when_the_settings_load(tmp_path, entry, says):
    with pytest.raises(ConfigError) as e:
        settings_from_env(tmp_path, model_kv_cache_type=f"qwen=f16,{entry}")
    assert "'model_kv_cache_type'" in str(e.value) and repr(entry) in str(e.value) and says in str(e.value)


def test_a_combination_llamacpp_refuses_is_refused_at_config_time(tmp_path):
    # The streams layout with flash attention off (exact answers) cannot hold a quantized V: llama.cpp
    # refuses such a context ("quantized V cache requires flash_attn to be enabled"; any quantized V,
    # probed on this build), so the daemon refuses the setting at start, naming the entry.
    with pytest.raises(ConfigError) as e:
        settings_from_env(tmp_path, kv_layout="streams", model_kv_cache_type="smollm2-135m=f16/q8_0")
    message = str(e.value)
    assert "'smollm2-135m=f16/q8_0'" in message and "requires flash_attn" in message and "kv_layout" in message
    with pytest.raises(ConfigError, match="'kv_cache_type'"):
        settings_from_env(tmp_path, kv_layout="streams", kv_cache_type="q4_0")
    # The same types where flash attention may be on, or with only K quantized, are served.
    settings_from_env(tmp_path, kv_layout="streams", flash_attention="true", model_kv_cache_type="smollm2-135m=q8_0")
    settings_from_env(tmp_path, kv_layout="streams", model_kv_cache_type="smollm2-135m=q8_0/f16")
    settings_from_env(tmp_path, model_kv_cache_type="smollm2-135m=q4_0")


def test_the_planner_sizes_the_kv_cache_by_each_models_types():
    base = Settings(context_length=2048, max_sequences=4, kv_layout="streams")
    f16, f16_memory = gguf_limits(SMOLLM2, base, REF)
    mixed, mixed_memory = gguf_limits(SMOLLM2, replace(base, model_kv_cache_type=(f"{REF}=q8_0/f16",)), REF)
    assert f16.kv_type == "f16" and mixed.kv_type == "q8_0/f16"
    assert mixed.n_ctx == f16.n_ctx and not mixed.kv_unified  # the same cells, a stream per sequence id
    # K in q8_0 (34 bytes per 32 values), V in f16: the KV bytes shrink by that share exactly.
    assert mixed_memory.kv_bytes == pytest.approx(f16_memory.kv_bytes * (34 / 32 + 2) / 4, abs=1)
    assert f16_memory.total_bytes - mixed_memory.total_bytes == f16_memory.kv_bytes - mixed_memory.kv_bytes
    # A quantized K needs no flash attention: the streams stay exact; another model keeps f16.
    assert not mixed.flash_attention
    assert gguf_limits(SMOLLM2, replace(base, model_kv_cache_type=("qwen=q4_0",)), REF)[0].kv_type == "f16"
    # A quantized V turns flash attention on where the layout is the planner's to choose.
    q4 = Settings(context_length=2048, max_sequences=4, model_kv_cache_type=(f"{REF}=q4_0",))
    limits, memory = gguf_limits(SMOLLM2, q4, REF)
    assert limits.kv_type == "q4_0" and limits.flash_attention and memory.kv_bytes < mixed_memory.kv_bytes
