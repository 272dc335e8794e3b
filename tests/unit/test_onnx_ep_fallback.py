"""An execution provider that is installed but fails to initialise falls back to the CPU EP with
the reason logged. No such EP exists on this machine (DirectML needs Windows, the NPU EPs their
devices), so the session constructor is made to fail for it the way onnxruntime-directml does on a
machine whose adapter the driver rejects; the model, the CPU session and the log are real."""

from __future__ import annotations

import importlib.util
import logging

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs onnxruntime")

# What onnxruntime-directml raises when DirectML cannot create its device (recorded message form).
DML_FAILURE = ("[ONNXRuntimeError] : 1 : FAIL : D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\dml\\"
               "dml_provider_factory.cc(511)\\onnxruntime_pybind11_state.pyd!00007FFB: 887A0004 "
               "The specified device interface or feature level is not supported on this system.")


def test_a_failing_ep_falls_back_to_the_cpu_with_the_reason_logged(tmp_path, monkeypatch, caplog):
    import onnxruntime as ort

    from localserve.backends.onnx.session import CPU_EP, open_session
    from localserve.convert import convert_gguf
    from onnx_helpers import write_tiny_gguf

    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf"), tmp_path / "m")
    real = ort.InferenceSession
    asked = []

    def session(path, opts, providers):
        asked.append(list(providers))
        if providers[0] == "DmlExecutionProvider":
            raise RuntimeError(DML_FAILURE)
        return real(path, opts, providers=providers)

    monkeypatch.setattr(ort, "InferenceSession", session)
    caplog.set_level(logging.WARNING, logger="localserve.backends.onnx")
    s = open_session(tmp_path / "m" / "model.onnx", 1, ["DmlExecutionProvider", CPU_EP])
    assert s.get_providers() == [CPU_EP]
    assert asked == [["DmlExecutionProvider", CPU_EP], [CPU_EP]]
    (record,) = [r for r in caplog.records if "failed to initialise" in r.getMessage()]
    assert "DmlExecutionProvider failed to initialise for model.onnx" in record.getMessage()
    assert "running on the CPU EP" in record.getMessage()


def test_the_cpu_ep_failing_is_an_error_without_a_path(tmp_path):
    from localserve.backends.onnx.session import CPU_EP, open_session
    from localserve.errors import BackendError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(BackendError) as e:
        open_session(tmp_path / "m" / "model.onnx", 1, ["DmlExecutionProvider", CPU_EP])
    assert str(tmp_path) not in str(e.value)
