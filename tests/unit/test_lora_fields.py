"""A request's LoRA adapters before any model (issue 45, item 5): llama-server's `lora` body shape
(api/lora.py), its rule for which adapters run (protocol lora_set), and the setting model_loras
(config/loras.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localserve.api.lora import parse_lora
from localserve.api.validation import Body
from localserve.config.loras import check_model_loras, model_loras
from localserve.config.settings import load_settings
from localserve.errors import ConfigError, InvalidRequestError
from localserve.protocol.requests import lora_set


def test_llama_servers_rule_absent_is_every_adapter_at_one_named_is_only_those():
    assert lora_set(None, 2, "m") == ((0, 1.0), (1, 1.0))
    assert lora_set([(1, 0.5)], 2, "m") == ((1, 0.5),)
    assert lora_set([(1, 0.5), (0, 0.0)], 2, "m") == ((1, 0.5),)  # a zero scale is off: the same set as without it
    assert lora_set([], 2, "m") == () and lora_set(None, 0, "m") == ()


@pytest.mark.parametrize("pairs, n, says", [
    ([(0, 1.0)], 0, "the model m has no LoRA adapters"),
    ([(2, 1.0)], 2, "adapter id 2, but the model m has adapters 0..1"),
    ([(-1, 1.0)], 2, "adapter id -1"),
    ([(0, float("nan"))], 2, "finite number"),
    ([(0, 1e9)], 2, "finite number"),
])
def test_lora_set_refusals_name_the_model_and_the_field(pairs, n, says):
    with pytest.raises(InvalidRequestError) as e:
        lora_set(pairs, n, "m")
    assert says in str(e.value) and e.value.param == "lora"


def test_the_body_shape():
    assert parse_lora(Body({}), "m") is None
    assert parse_lora(Body({"lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": -0.5}]}), "m") == [(0, 1.0), (1, -0.5)]
    for bad in ({"id": 0}, {"id": True, "scale": 1}, {"id": "0", "scale": 1}, {"id": 0, "scale": "1"}, 3):
        with pytest.raises(InvalidRequestError):
            parse_lora(Body({"lora": [bad]}), "m")
    with pytest.raises(InvalidRequestError):
        parse_lora(Body({"lora": {"id": 0, "scale": 1}}), "m")
    with pytest.raises(InvalidRequestError):
        parse_lora(Body({"lora": [{"id": 0, "scale": 1}] * 65}), "m")


def test_model_loras_items_keep_their_paths_and_every_item_naming_the_model_counts(tmp_path):
    items = ("Coder=/Data/Style.gguf", "coder:q4=~/Domain.gguf", "coder:q8=/x.gguf", "other=/y.gguf")
    assert model_loras(items, "coder:Q4") == [(items[0], Path("/Data/Style.gguf")),
                                              (items[1], Path("~/Domain.gguf").expanduser())]
    assert model_loras(items, "coder:latest") == [(items[0], Path("/Data/Style.gguf"))]
    for bad in ("coder", "=/x.gguf", "coder="):
        with pytest.raises(ConfigError, match="NAME\\[:TAG\\]=FILE"):
            check_model_loras([bad])
    with pytest.raises(ConfigError, match="model_loras"):
        load_settings(environ={"LOCALSERVE_HOME": str(tmp_path), "LOCALSERVE_MODEL_LORAS": "coder"})
