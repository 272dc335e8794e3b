"""Conversion on first use (issue 10): placement picks the onnx backend for a tag that holds only a
GGUF, and the load converts it, stores the onnx variant and serves it; later loads reuse it."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest

from fixtures.hw.loader import fixture_env
from localserve.runtime import manager as models
from localserve.runtime import registry
from localserve.config.settings import load_settings
from localserve.convert.first_use import convert_for_load
from localserve.hardware import detect_hardware
from localserve.store.cache import ModelStore
from onnx_helpers import answer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs onnxruntime")


def gguf_only(tmp_path: Path, smollm2_gguf: Path, **flags: str):
    settings = load_settings(flags={"home": str(tmp_path / "home"), **flags}, environ={},
                             config_path=tmp_path / "none.toml")
    return settings, ModelStore(settings).register_local(smollm2_gguf, "smol")


def test_placement_converts_for_an_npu_but_keeps_llamacpp_on_a_cpu(tmp_path, smollm2_gguf):
    settings, model = gguf_only(tmp_path, smollm2_gguf)
    npu = detect_hardware(fixture_env("linux_strix_halo", onnx=["VitisAIExecutionProvider", "CPUExecutionProvider"]))
    choice = registry.choose(model, settings, npu, None)
    assert (choice.backend, choice.execution_provider, choice.convert) == ("onnx", "VitisAIExecutionProvider", True)
    assert choice.reason.endswith("its GGUF is converted to ONNX on first use")
    # A CPU-only machine: llama.cpp runs the GGUF, nothing is converted.
    cpu = detect_hardware(fixture_env("linux_intel", onnx=["CPUExecutionProvider"]))
    assert (registry.choose(model, settings, cpu, None).backend, registry.choose(model, settings, cpu, None).convert) \
        == ("llamacpp", False)


def test_without_onnxruntime_a_gguf_only_tag_is_not_offered_to_onnx(tmp_path, smollm2_gguf, monkeypatch):
    settings, model = gguf_only(tmp_path, smollm2_gguf, backend="onnx")
    absent = dataclasses.replace(registry.REGISTRY["onnx"], missing=lambda: "onnxruntime is not installed")
    monkeypatch.setitem(registry.REGISTRY, "onnx", absent)
    monkeypatch.setattr(registry, "_onnx_missing", lambda: "onnxruntime is not installed")
    with pytest.raises(Exception, match="has no variant it runs"):
        registry.choose(model, settings, detect_hardware(fixture_env("linux_intel")), None)


def test_first_load_with_backend_onnx_converts_stores_and_serves(tmp_path, smollm2_gguf, caplog):
    settings, model = gguf_only(tmp_path, smollm2_gguf, backend="onnx")
    plan = models.plan_model(model, settings)
    assert (plan.choice.backend, plan.choice.convert) == ("onnx", True)
    caplog.set_level(logging.INFO, logger="localserve.convert.first_use")
    engine = models.load_engine(model, settings)
    try:
        assert engine.backend_name == "OnnxBackend"  # in its engine worker process
        ids = engine.tokenize("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                              add_special=False)
        assert "Paris" in engine.detokenize(asyncio.run(answer(engine, ids, 12)))
    finally:
        engine.shutdown()
    progress = [r.getMessage() for r in caplog.records if "tensors" in r.getMessage()]
    assert 2 <= len(progress) <= 12  # logged by tenths, not per tensor
    done, total = progress[-1].rsplit(" ", 2)[-2].split("/")
    assert done == total
    stored = ModelStore(settings).find("smol")
    assert sorted(stored.variants) == ["gguf", "onnx"]
    assert stored.variants["onnx"].meta.get("weights") in ("int8", "int4", "fp32")
    # The next load reuses the variant: no conversion planned.
    assert models.plan_model(stored, settings).choice.convert is False


def test_a_load_planned_before_another_process_converted_takes_its_variant(tmp_path, smollm2_gguf, caplog):
    settings, stale = gguf_only(tmp_path, smollm2_gguf)
    winner = convert_for_load(stale, settings, None)
    # `stale` still says "no onnx variant" (planned before): the store's variant is taken, not redone.
    caplog.set_level(logging.INFO, logger="localserve.convert.first_use")
    again = convert_for_load(stale, settings, None)
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert again.variants["onnx"].path == winner.variants["onnx"].path
    assert sorted(ModelStore(settings).find("smol").variants) == ["gguf", "onnx"]
