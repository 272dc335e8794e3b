"""Hostile GGUFs against the converter (issue 25, security review 3 A.5): a tiny file whose
metadata claims a huge context, more layers than it holds, or a head layout its tensors do not
have is refused or bounded before anything is allocated, with peak memory flat and the folder the
size of the weights; and the daemon, converting on first use, answers such a file with a 400.

Each conversion runs in a child process under a 2 GiB address-space limit (the review's setup:
before the bounds, the 2^26 claim asked for 4 GiB of float64 angles and died with MemoryError),
measuring its peak with tracemalloc, which sees numpy's buffers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon_util import REPO, cli, cli_env, free_port, register_model, serving, stop_quietly, wait_published
from onnx_helpers import TINY, tiny_weights, write_tiny_gguf

ort = pytest.importorskip("onnxruntime")

ADDRESS_SPACE = 2 * 2**30
# An honest tiny model's conversion peaks near 20 MiB here (imports aside); the bounded tables
# add 1.5 MiB. Before the bounds the 2^20 claim peaked at 210 MiB and the 2^26 one at 4.6 GiB.
FLAT_PEAK = 48 * 2**20
_CHILD = """
import json, resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from localserve.convert import convert_gguf
tracemalloc.start()
try:
    meta, error = convert_gguf(sys.argv[1], sys.argv[2], weights="fp32"), None
except Exception as e:
    meta, error = None, {{"type": type(e).__name__, "message": str(e)}}
print(json.dumps({{"meta": meta, "error": error, "peak": tracemalloc.get_traced_memory()[1]}}))
"""


def convert_bounded(gguf: Path, out: Path) -> dict:
    """convert_gguf in a child under ADDRESS_SPACE: its meta or error, and its tracemalloc peak."""
    done = subprocess.run([sys.executable, "-c", _CHILD.format(limit=ADDRESS_SPACE), str(gguf), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def _logits(folder: Path, ids: list[int]) -> np.ndarray:
    """Causal logits of one sequence through the converted graph."""
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    n, slots, hd = len(ids), 8, TINY["n_embd"] // TINY["n_head"]
    bias = np.where(np.arange(slots)[None, :] <= np.arange(n)[:, None], 0, -np.inf).astype(np.float32)
    feeds = {"input_ids": np.array(ids, np.int64), "positions": np.arange(n), "slots": np.arange(n),
             "attn_bias": bias, "logits_idx": np.arange(n)}
    feeds.update({f"cache.{i}.{kind}": np.zeros((TINY["n_head_kv"], slots, hd), np.float32)
                  for i in range(TINY["n_layer"]) for kind in ("key", "value")})
    return sess.run(["logits"], feeds)[0]


def test_a_context_past_any_trained_model_is_refused_with_memory_flat(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "claims-2-26.gguf", context_length=1 << 26)
    got = convert_bounded(gguf, tmp_path / "out")
    assert got["error"]["type"] == "GGUFError", got
    assert "67,108,864 tokens" in got["error"]["message"] and str(tmp_path) not in got["error"]["message"]
    assert got["peak"] < FLAT_PEAK
    assert not (tmp_path / "out").exists()


def test_a_huge_but_plausible_context_is_bounded_to_what_serving_reaches(tmp_path: Path) -> None:
    weights = tiny_weights(seed=5)
    honest = convert_bounded(write_tiny_gguf(tmp_path / "honest.gguf", weights=weights), tmp_path / "honest")
    claims = convert_bounded(write_tiny_gguf(tmp_path / "claims-2-20.gguf", weights=weights, context_length=1 << 20),
                             tmp_path / "bounded")
    assert claims["error"] is None and claims["peak"] < FLAT_PEAK
    assert claims["meta"]["context_length"] == 8192 and claims["meta"]["trained_context_length"] == 1 << 20
    # The weights plus 8,192 rope rows (0.5 MiB), not 2^20 of them (64 MiB before the bound).
    assert _size(tmp_path / "bounded") < _size(tmp_path / "honest") + 2**20
    ids = [3, 17, 42, 8, 1]
    np.testing.assert_allclose(_logits(tmp_path / "bounded", ids), _logits(tmp_path / "honest", ids), atol=1e-5)
    assert honest["meta"]["context_length"] == TINY["n_ctx"] and "trained_context_length" not in honest["meta"]


@pytest.mark.parametrize("claims, names", [
    # Heads x head size = width holds, but attn_k's tensor has 2 kv heads of 16, not 2 of 32.
    (dict(head_count=2, head_count_kv=2, key_length=32), ["blk.0.attn_k.weight is 64x32", "needs 64x64"]),
    # 2^31 layers would be 19 billion tensor names to look for before any check.
    (dict(block_count=1 << 31), ["2147483648 layers", "holds only"]),
    (dict(rope_base=float("nan")), ["rope.freq_base must be a finite number"]),
    (dict(context_length=0), ["context_length must be a positive integer"]),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_before_any_work(tmp_path: Path, claims: dict,
                                                                            names: list[str]) -> None:
    got = convert_bounded(write_tiny_gguf(tmp_path / "hostile.gguf", **claims), tmp_path / "out")
    assert got["error"] is not None and got["error"]["type"] == "GGUFError", got
    assert all(n in got["error"]["message"] for n in names), got["error"]["message"]
    assert str(tmp_path) not in got["error"]["message"] and got["peak"] < FLAT_PEAK
    assert not (tmp_path / "out").exists()


def test_conversion_too_big_for_the_memory_available_is_refused() -> None:
    from localserve.convert.bounds import ConversionMemoryError, check_memory
    from localserve.convert.spec import ModelSpec

    # An 8B llama's shape: its 128,256 x 4,096 embedding table is prepared as float32 copies.
    spec = ModelSpec(arch="llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128,
                     n_vocab=128256, n_ctx_train=131072, n_positions=8192, rope_base=5e5, rms_eps=1e-5,
                     rope_interleaved=True, qkv_bias=False, tied_embeddings=False, rope_freqs=True)
    check_memory(spec, available=16 * 2**30)
    with pytest.raises(ConversionMemoryError, match=r"needs about 7\.8 GiB of memory at once; 4\.0 GiB is available"):
        check_memory(spec, available=4 * 2**30)


def test_the_daemon_answers_a_hostile_gguf_on_first_use_with_a_400(tmp_path: Path) -> None:
    """backend=onnx: the daemon converts a GGUF-only tag on its first chat; the hostile claim is
    refused there, as a 400 without a host path, before any variant is written, and the daemon lives."""
    import urllib.error
    import urllib.request

    home = tmp_path / "home"
    env = cli_env(home, free_port(), LOCALSERVE_BACKEND="onnx")
    register_model(env, write_tiny_gguf(tmp_path / "claims-2-26.gguf", context_length=1 << 26), "hostile")
    with serving(env) as proc:
        info = wait_published(home, proc)
        body = json.dumps({"model": "hostile", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(info["url"] + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        answer = refused.value.read().decode()
        assert refused.value.code == 400 and "67,108,864 tokens" in answer and str(tmp_path) not in answer
        assert proc.poll() is None
        assert not list((home / "models" / "hostile").glob("*/onnx-*"))
        stop_quietly(env, proc)
    assert cli(env, "convert", "hostile").returncode == 1
