"""Native crashes: the llama.cpp probe and its fallback, and a daemon that dies explaining itself.

The probe's trigger (a CPU that claims AMX and a build that compiled it) is faked here, so that the
tests run on any CPU and build; the child process, the model, the load and the signals are real.
Their verdicts go to a folder of the test's own, not the machine's cache (conftest's real probe)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daemon_util import REPO, cli_env, free_port, register_model, serving, stop_quietly, wait_published
from worker_locks import THREADS

pytestmark = pytest.mark.model


@pytest.fixture
def claims_amx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """This machine's real hardware report with AMX among the CPU's features, wherever a report is
    taken (a load's plan, hw, show), and a build that says it compiled AMX; verdicts in tmp_path.
    Returns the CPU."""
    import dataclasses

    from localserve.backends.llamacpp import probe as llamacpp_probe
    from localserve.hardware import detect_hardware
    from localserve.runtime import planning

    real = detect_hardware()
    amx = dataclasses.replace(real, cpu=dataclasses.replace(real.cpu, features=[*real.cpu.features, "AMX"]))
    monkeypatch.setattr(llamacpp_probe, "build_uses_amx", lambda: True)
    monkeypatch.setattr(llamacpp_probe, "VERDICT_DIR", tmp_path / "native-probe")
    monkeypatch.setattr(planning, "hardware_report", lambda: amx)
    monkeypatch.setattr("localserve.hardware.detect_hardware", lambda *a, **k: amx)
    monkeypatch.setattr("localserve.commands.hw.detect_hardware", lambda *a, **k: amx)
    return amx.cpu


def test_the_probe_loads_and_decodes_the_real_model_here(smollm2_gguf: Path, claims_amx) -> None:
    import llama_cpp

    from localserve.backends.llamacpp import probe as llamacpp_probe

    cpu = claims_amx
    allowed = llamacpp_probe.extra_buffers_allowed(smollm2_gguf, cpu.model, cpu.features)
    verdict = llamacpp_probe.read_verdict(llamacpp_probe.build_key(cpu.model, cpu.features))
    assert verdict is not None and verdict.ok is allowed and verdict.seconds > 0
    if verdict.ok:
        assert verdict.signal is None
        assert "probed on this CPU and runs" in llamacpp_probe.condition(cpu.model, cpu.features)
    else:  # only a build that compiled AMX may die, and from a fault: README's wheel on CI's VMs
        assert b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info(), verdict
        assert verdict.signal in ("SIGSEGV", "SIGILL", "SIGBUS"), verdict
        assert f"died with {verdict.signal}" in llamacpp_probe.condition(cpu.model, cpu.features)
    # Never probed where the CPU does not claim AMX, whatever the build.
    plain = [f for f in cpu.features if f != "AMX"]
    assert llamacpp_probe.condition(cpu.model, plain) is None


def dying_probe_child(sig: int) -> str:
    """The real probe child, whose process kills itself with `sig` halfway through its load: after
    llama.cpp has mapped the weights, as the context is created (the AMX path would fault in the
    first decode right after). Deterministic, unlike racing a signal from outside."""
    return textwrap.dedent(f"""
        import os, sys
        import llama_cpp
        real = llama_cpp.llama_init_from_model
        def dying(model, params):
            os.kill(os.getpid(), {int(sig)})
            return real(model, params)
        llama_cpp.llama_init_from_model = dying
        from localserve.backends.llamacpp.probe_child import run_probe
        sys.exit(run_probe(sys.argv[1]))
    """)


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGILL])
def test_a_probe_child_killed_by_a_signal_makes_the_load_take_the_fallback(
    smollm2_gguf: Path, tmp_path: Path, claims_amx, monkeypatch: pytest.MonkeyPatch, sig: int,
) -> None:
    from localserve.backends.llamacpp import probe as llamacpp_probe
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    real_probe = llamacpp_probe.probe
    monkeypatch.setattr(llamacpp_probe, "probe", lambda path, key: real_probe(
        path, key, command=[sys.executable, "-c", dying_probe_child(sig), str(path)]))
    cpu = claims_amx
    result = [llamacpp_probe.extra_buffers_allowed(smollm2_gguf, cpu.model, cpu.features)]
    assert result == [False]
    key = llamacpp_probe.build_key(cpu.model, cpu.features)
    verdict = llamacpp_probe.read_verdict(key)
    assert verdict is not None and not verdict.ok and verdict.signal == signal.Signals(sig).name
    record = json.loads((tmp_path / "native-probe" / f"{key}.json").read_text())
    assert record["key"] == key
    assert f"died with {signal.Signals(sig).name}" in llamacpp_probe.condition(cpu.model, cpu.features)
    assert "localserve setup" in llamacpp_probe.condition(cpu.model, cpu.features)
    # A load that does not say (a tool's, a benchmark's) follows this build's verdict on the machine.
    assert llamacpp_probe.build_died_here()

    # Remembered: the next load asks no child, and goes through the registry without extra buffers.
    monkeypatch.setattr(llamacpp_probe, "probe", lambda *a, **k: pytest.fail("probed twice"))
    from localserve.config.settings import load_settings
    from localserve.runtime.planning import plan_model
    from localserve.store.cache import ModelStore
    from localserve.runtime import registry

    # In process: the spy on LlamaCppBackend.load must see the load (a worker would not).
    settings = load_settings(flags={"home": str(tmp_path), "context_length": 512, "max_sequences": 2,
                                    "engine_workers": False},
                             environ={}, config_path=tmp_path / "no-config.toml")
    installed = ModelStore(settings).register_local(smollm2_gguf, "smol")
    seen: list[bool] = []
    original = LlamaCppBackend.load.__func__

    def spy(cls, path, **kwargs):
        seen.append(kwargs["extra_buffers"])
        return original(cls, path, **kwargs)

    monkeypatch.setattr(LlamaCppBackend, "load", classmethod(spy))
    engine = registry.load(installed, plan_model(installed, settings), settings)
    engine.shutdown()
    assert seen == [False]


def test_the_fallback_load_gives_the_full_builds_greedy_tokens(smollm2_gguf: Path) -> None:
    """What the fallback changes is where weights live, not what the model says."""
    from localserve.backends.base import BatchToken
    from localserve.backends.llamacpp.backend import LlamaCppBackend
    from localserve.backends.llamacpp.probe import build_died_here

    if build_died_here():  # conftest's probe: the full build's first decode would kill pytest
        pytest.skip("this build's extra buffer types die on this machine: there is no full build to compare with")

    def greedy(extra_buffers: bool) -> list[int]:
        import numpy as np

        with LlamaCppBackend.load(smollm2_gguf, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=THREADS,
                                  extra_buffers=extra_buffers, kv_unified=False, flash_attention=False) as b:
            tokens = b.tokenize("The capital of France is")
            out: list[int] = []
            b.decode([BatchToken(t, 0, i, i == len(tokens) - 1) for i, t in enumerate(tokens)])
            row = len(tokens) - 1  # the prompt's last row, then each single row
            for step in range(8):
                nxt = int(np.argmax(b.logits(row)))
                row = 0
                out.append(nxt)
                b.decode([BatchToken(nxt, 0, len(tokens) + step, True)])
            return out

    assert greedy(False) == greedy(True)


def test_faults_record_names_the_signal_and_what_the_crashing_thread_did(smollm2_gguf: Path, tmp_path: Path) -> None:
    """A real SIGSEGV in a thread that is decoding, as a daemon's engine thread would be."""
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        from pathlib import Path
        from localserve.desktop.daemon_crash import enable_fault_record
        from localserve.backends.base import BatchToken
        from localserve.backends.llamacpp.backend import LlamaCppBackend
        enable_fault_record(Path({str(tmp_path)!r}))
        b = LlamaCppBackend.load({str(smollm2_gguf)!r}, n_ctx=512, n_seq_max=1, n_batch=64, n_threads=1)
        started = threading.Event()
        def work():
            started.set()
            while True:
                b.kv_remove(0)
                b.decode([BatchToken(1, 0, i, i == 63) for i in range(64)])
        t = threading.Thread(target=work, daemon=True); t.start(); started.wait(); time.sleep(0.3)
        signal.pthread_kill(t.ident, signal.SIGSEGV)
        time.sleep(10)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGSEGV, err
    from localserve.desktop.daemon_crash import CRASH_NAME, explain, read_death

    assert "Fatal Python error: Segmentation fault" in (tmp_path / CRASH_NAME).read_text()
    death = read_death(tmp_path, proc.pid)
    assert death is not None and death.signal == "SIGSEGV" and death.activity == "decoding"
    line = explain(tmp_path, tmp_path / "localserve.log", proc.pid, "answering with smol")
    assert "SIGSEGV" in line and "while decoding" in line and str(tmp_path / "localserve.log") in line


def test_run_says_how_the_daemon_died_when_it_dies_mid_stream(tmp_path: Path, smollm2_gguf: Path) -> None:
    env = cli_env(tmp_path, free_port())
    register_model(env, smollm2_gguf, "smol")
    with serving(env) as daemon:
        info = wait_published(tmp_path, daemon)
        run = subprocess.Popen([sys.executable, "-m", "localserve", "run", "smol", "Write a long story about a dragon.",
                                "--max-tokens", "3000"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            assert run.stdout is not None and run.stdout.read(8)  # the answer streams
            os.kill(info["pid"], signal.SIGSEGV)
            out, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
        assert daemon.wait(30) == -signal.SIGSEGV
    assert run.returncode != 0
    message = err.strip().splitlines()[-1]
    assert message.startswith("Error: the daemon (pid ") and "died from SIGSEGV" in message, err
    assert str(tmp_path / "logs" / "localserve.log") in message and "answering with smol" in message
    assert "Traceback" not in err
    from localserve.tray.state import read_state

    tray = read_state(None, "http://127.0.0.1:1", False, tmp_path / "logs")  # no daemon answers: stopped
    assert tray.status == "stopped" and "died from SIGSEGV" in (tray.error or "")

    # The next start says it once, on its terminal and in its log.
    with serving(env) as daemon:
        wait_published(tmp_path, daemon)
        stop_quietly(env, daemon)
        daemon.wait(30)
        serve_err = daemon.output()
    assert f"Note: the previous daemon (pid {info['pid']}) died from SIGSEGV" in serve_err


def test_hw_and_show_name_the_condition_and_the_command(smollm2_gguf: Path, tmp_path: Path, claims_amx,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import asdict

    from localserve.backends.llamacpp import probe as llamacpp_probe
    from localserve.cli import main

    env = cli_env(tmp_path, free_port())
    register_model(env, smollm2_gguf, "smol")
    key = llamacpp_probe.build_key(claims_amx.model, claims_amx.features)
    llamacpp_probe.VERDICT_DIR.mkdir(parents=True)
    (llamacpp_probe.VERDICT_DIR / f"{key}.json").write_text(
        json.dumps(asdict(llamacpp_probe.Verdict(key, False, "SIGILL", 0.6, 1.0))))
    config = ["--home", str(tmp_path)]
    assert main(["hw", *config]) == 0
    out = capsys.readouterr().out
    assert "died with SIGILL" in " ".join(out.split()) and "localserve setup" in out
    assert main(["show", "smol", *config]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "llama.cpp here" in shown and "died with SIGILL" in shown


def test_run_names_sigkill_for_the_daemon_it_started(tmp_path: Path, smollm2_gguf: Path) -> None:
    """SIGKILL leaves no fault record; the CLI that autostarted the daemon learns it from the exit status."""
    env = cli_env(tmp_path, free_port())
    register_model(env, smollm2_gguf, "smol")
    run = subprocess.Popen([sys.executable, "-m", "localserve", "run", "smol", "Write a long story about a dragon.",
                            "--max-tokens", "3000"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.read(8)
        info = json.loads((tmp_path / "run" / "daemon.json").read_text())
        os.kill(info["pid"], signal.SIGKILL)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    message = err.strip().splitlines()[-1]
    assert f"the daemon (pid {info['pid']}) died from SIGKILL" in message and "out-of-memory" in message, err
