"""The GGUF -> ONNX converter: refusals before any work, the graph against a numpy forward pass of
the same weights (llama and qwen2 rope conventions, GQA, biases, tied head), a packed run of two
sequences against their separate runs, and nothing left behind by an interrupted conversion."""

from __future__ import annotations

import numpy as np
import pytest

from localserve.convert import UnsupportedModelError, convert_gguf
from localserve.errors import ContextLengthExceededError, GGUFError
from onnx_helpers import TINY, reference_hidden, reference_logits, tiny_weights, write_tiny_gguf

ort = pytest.importorskip("onnxruntime")


def _session(folder):
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def _run(sess, ids, pos, slots, bias, rows, n_slots, outputs=("logits",)):
    hd = TINY["n_embd"] // TINY["n_head"]
    feeds = {"input_ids": np.array(ids, np.int64), "positions": np.array(pos, np.int64),
             "slots": np.array(slots, np.int64), "attn_bias": bias.astype(np.float32),
             "logits_idx": np.array(rows, np.int64)}
    for i in range(TINY["n_layer"]):
        for kind in ("key", "value"):
            feeds[f"cache.{i}.{kind}"] = np.zeros((TINY["n_head_kv"], n_slots, hd), np.float32)
    got = sess.run(list(outputs), feeds)
    return got[0] if len(outputs) == 1 else got


def _causal(n, n_slots):
    bias = np.full((n, n_slots), -np.inf)
    for t in range(n):
        bias[t, : t + 1] = 0
    return bias


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graph_matches_numpy_reference(tmp_path, arch):
    weights = tiny_weights(arch, seed=1)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch, weights)
    meta = convert_gguf(gguf, tmp_path / "out", weights="fp32")  # int4: test_convert_nbits
    assert meta["architecture"] == arch and meta["flavour"] == "dynamic" and meta["localserve_onnx"] == 1
    ids = [3, 17, 42, 8, 8, 1, 29]
    got = _run(_session(tmp_path / "out"), ids, range(7), range(7), _causal(7, 16), range(7), 16)
    want = reference_logits(weights, ids, arch)
    assert got.shape == (7, TINY["n_vocab"])
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())


def test_embeddings_output_is_every_tokens_final_norm(tmp_path):
    """`embeddings` holds each token's hidden state after the final norm (llama.cpp's per-token
    embeddings); a run asking no logits rows computes no LM head row."""
    weights = tiny_weights("llama", seed=3)
    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", "llama", weights), tmp_path / "out", weights="fp32")
    ids = [4, 9, 33, 2, 17]
    want = reference_hidden(weights, ids)
    logits, embd = _run(_session(tmp_path / "out"), ids, range(5), range(5), _causal(5, 8), [], 8,
                        outputs=("logits", "embeddings"))
    assert logits.shape == (0, TINY["n_vocab"]) and embd.shape == (5, TINY["n_embd"])
    assert np.abs(embd - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_two_sequences_packed_in_one_run_match_separate_runs(tmp_path):
    """Sequence A (4 tokens) and B (3 tokens) side by side, interleaved slots, no padding: each
    row's logits equal the reference of its own sequence alone."""
    weights = tiny_weights("llama", seed=2)
    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", "llama", weights), tmp_path / "out", weights="fp32")
    a, b = [5, 6, 7, 8], [40, 41, 42]
    ids, seq, pos = a + b, [0] * 4 + [1] * 3, [0, 1, 2, 3, 0, 1, 2]
    slots = [0, 2, 4, 6, 1, 3, 5]
    bias = np.full((7, 8), -np.inf)
    for t in range(7):
        for u in range(7):
            if seq[u] == seq[t] and pos[u] <= pos[t]:
                bias[t, slots[u]] = 0
    got = _run(_session(tmp_path / "out"), ids, pos, slots, bias, [3, 6], 8)
    for row, prompt in ((0, a), (1, b)):
        want = reference_logits(weights, prompt)[-1]
        assert np.abs(got[row] - want).max() < 1e-3 * max(1.0, np.abs(want).max())


def _refused(tmp_path, gguf, *needles):
    with pytest.raises(UnsupportedModelError) as e:
        convert_gguf(gguf, tmp_path / "out")
    for needle in needles:
        assert needle in str(e.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no partial folder either
    return str(e.value)


def test_refuses_an_unsupported_architecture(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "f.gguf", "falcon")
    _refused(tmp_path, gguf, "'falcon'", "llama, qwen2")


def test_refuses_an_unsupported_tensor_type_naming_it(tmp_path):
    import gguf as g

    iq = np.zeros(66, dtype=np.uint8)  # one IQ2_XXS block of 256 values
    path = write_tiny_gguf(tmp_path / "q.gguf", raw={"extra.weight": (iq, g.GGMLQuantizationType.IQ2_XXS)})
    message = _refused(tmp_path, path, "IQ2_XXS", "extra.weight", "Q4_1", "Q8_0")
    assert str(tmp_path) not in message


def test_refuses_missing_tensors(tmp_path):
    weights = tiny_weights()
    del weights["blk.1.ffn_up.weight"]
    _refused(tmp_path, write_tiny_gguf(tmp_path / "m.gguf", weights=weights), "blk.1.ffn_up.weight")


def test_not_a_gguf_is_a_gguf_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError) as e:
        convert_gguf(bad, tmp_path / "out")
    assert str(tmp_path) not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_leaves_nothing(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "t.gguf")

    def interrupt(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, tmp_path / "out", progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_cli_convert_adds_the_onnx_variant_and_refuses_cleanly(tmp_path, capsys):
    from localserve.cli import main
    from localserve.config.settings import load_settings
    from localserve.store.cache import ModelStore

    home = tmp_path / "home"
    good = write_tiny_gguf(tmp_path / "good.gguf")
    bad = write_tiny_gguf(tmp_path / "bad.gguf", "falcon")
    assert main(["--home", str(home), "add", str(good), "--name", "tiny:a"]) == 0
    assert main(["--home", str(home), "add", str(bad), "--name", "tiny:b"]) == 0
    assert main(["--home", str(home), "convert", "tiny:a"]) == 0
    assert "converted tiny:a: onnx variant" in capsys.readouterr().out
    assert main(["--home", str(home), "convert", "tiny:b"]) != 0
    err = capsys.readouterr().err
    assert "'falcon'" in err and "supported: llama, qwen2" in err
    store = ModelStore(load_settings(flags={"home": str(home)}, environ={}, config_path=home / "none.toml"))
    assert set(store.find("tiny:a").variants) == {"gguf", "onnx"}
    assert set(store.find("tiny:b").variants) == {"gguf"}
    assert not any((home / "models" / ".tmp").iterdir())


def test_onnx_embedder_pools_the_reference_rows(tmp_path):
    """The ONNX backend's embedder on the tiny graph: each input's mean of its final-norm rows,
    L2-normalised, whether inputs share a decode or one is cut across several (n_batch 3), and
    however the inputs are grouped (n_ctx 8 cells, 2 sequence ids per group)."""
    from localserve.backends.onnx.embed import OnnxEmbedder

    weights = tiny_weights("llama", seed=4)
    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", "llama", weights), tmp_path / "out", weights="fp32")
    inputs = [[3, 8, 1, 30, 7], [12], [5, 5, 6], [40, 2, 9, 9]]
    want = []
    for ids in inputs:
        mean = reference_hidden(weights, ids).mean(axis=0)
        want.append(mean / np.linalg.norm(mean))
    embedder = OnnxEmbedder(_session(tmp_path / "out"), n_layer=TINY["n_layer"], n_head_kv=TINY["n_head_kv"],
                            head_dim=TINY["n_embd"] // TINY["n_head"], n_ctx=8, n_batch=3, n_seq_max=2,
                            n_embd=TINY["n_embd"], n_vocab=TINY["n_vocab"])
    got = np.array(embedder.embed(inputs))
    assert np.abs(got - np.array(want)).max() < 1e-4
    steps = embedder.embed_steps(inputs[:2])
    assert [next(steps), next(steps), next(steps)] == [False, False, True]  # 6 tokens: 2 decodes, then done
    with pytest.raises(ContextLengthExceededError):  # longer than the embedder's cells: refused
        embedder.embed([list(range(9))])
