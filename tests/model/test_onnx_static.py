"""The static ONNX flavour (fixed shapes for NPU execution providers) on the CPU EP, on the real
SmolLM2-135M: the same greedy tokens as the dynamic flavour alone and with several sequences
decoding together, prompts longer than the largest bucket fed over several runs, the pool filled to
its last slot (the padding must take none), and clear errors for broken folders."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from localserve.backends.base import BatchToken, KVFullError
from localserve.batching.limits import EngineLimits
from localserve.errors import BackendError
from onnx_helpers import answer, chat, engine_answers, greedy, prefill, smollm2_onnx  # noqa: F401 - smollm2_onnx: session fixture
from worker_locks import THREADS

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.model

BUCKETS = (1, 4, 16)  # small, so chat prompts span several runs and buckets
SLOTS = 256
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three primary colors.",
           "How many legs does a spider have?", "Translate 'good morning' into Spanish.",
           "Give me a synonym for happy."]


@pytest.fixture(scope="module")
def static_dir(smollm2_gguf, tmp_path_factory):
    from localserve.convert import convert_gguf

    out = tmp_path_factory.mktemp("static") / "smol-static"
    # fp32 like the dynamic folder it is compared with (test_convert_nbits compares the int4 pair)
    convert_gguf(smollm2_gguf, out, flavour="static", static_tokens=BUCKETS, static_slots=SLOTS, weights="fp32")
    return out


@pytest.fixture(scope="module")
def static(static_dir, smollm2_gguf):
    from localserve.backends.onnx.load import load_onnx

    # n_ctx is the graphs' to fix: the load ignores the caller's 4096 for the static flavour.
    b = load_onnx(static_dir, smollm2_gguf, n_ctx=4096, n_seq_max=8, n_batch=64, n_threads=THREADS)
    yield b
    b.close()


@pytest.fixture(scope="module")
def dynamic(smollm2_onnx, smollm2_gguf):  # noqa: F811
    from localserve.backends.onnx.load import load_onnx

    b = load_onnx(smollm2_onnx, smollm2_gguf, n_ctx=1024, n_seq_max=8, n_batch=512, n_threads=THREADS)
    yield b
    b.close()


def expected_runs(lengths: list[int]) -> dict[int, int]:
    """Runs per bucket for batches of these lengths: largest-bucket runs, then the smallest bucket
    holding the rest."""
    runs = dict.fromkeys(BUCKETS, 0)
    for n in lengths:
        runs[BUCKETS[-1]] += n // BUCKETS[-1]
        if n % BUCKETS[-1]:
            runs[next(t for t in BUCKETS if t >= n % BUCKETS[-1])] += 1
    return runs


def test_the_folder_has_fixed_shapes_per_bucket(static_dir):
    import onnx

    meta = json.loads((static_dir / "localserve-onnx.json").read_text())
    assert meta["flavour"] == "static"
    assert meta["static"] == {"tokens": list(BUCKETS), "slots": SLOTS, "sink_rows": 1,
                              "graphs": {"1": "model.t1.onnx", "4": "model.t4.onnx", "16": "model.onnx"}}
    assert sorted(p.name for p in static_dir.glob("*.data")) == ["model.onnx.data"]  # one weights file
    for tokens, name in meta["static"]["graphs"].items():
        graph = onnx.load(str(static_dir / name), load_external_data=False).graph
        shapes = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
                  for v in list(graph.input) + list(graph.output)}
        assert all(isinstance(d, int) for dims in shapes.values() for d in dims), shapes
        assert shapes["input_ids"] == [int(tokens)] and shapes["logits"][0] == int(tokens)
        assert shapes["attn_bias"] == [int(tokens), SLOTS + 1]  # the pool plus the padding's sink


def test_capabilities_declare_the_fixed_pool(static):
    caps = static.capabilities
    assert caps.kv_cells == caps.kv_cells_per_seq == SLOTS  # the sink is not a slot
    assert caps.max_batch_tokens == 64 and caps.micro_batch == BUCKETS[-1] and caps.max_seqs == 8
    assert not caps.embeddings


def test_same_greedy_tokens_as_the_dynamic_flavour(static, dynamic, record_property):
    before = dict(static.runs_by_bucket)
    lengths: list[int] = []
    for text in PROMPTS:
        ids = chat(dynamic, text)
        want, got = greedy(dynamic, ids, 12), greedy(static, ids, 12)
        assert got == want, text
        lengths += [len(ids)] + [1] * 12
    record_property("static_equals_dynamic", len(PROMPTS))
    # Each decode of one sequence ran the 1-token graph, each prompt a 16 and the smallest fitting one.
    assert {t: static.runs_by_bucket[t] - before[t] for t in BUCKETS} == expected_runs(lengths)
    assert static.slots.used == 0


def test_prompt_longer_than_the_largest_bucket(static, dynamic):
    ids = chat(dynamic, " ".join(PROMPTS))  # ~60 tokens in one batch: 16-token runs and a remainder
    assert BUCKETS[-1] * 3 < len(ids) <= static.n_batch
    dynamic.kv_remove(0)
    static.kv_remove(0)
    before = dict(static.runs_by_bucket)
    want, got = prefill(dynamic, 0, ids), prefill(static, 0, ids)
    assert {t: static.runs_by_bucket[t] - before[t] for t in BUCKETS} == expected_runs([len(ids)])
    assert np.abs(got - want).max() < 1e-3 and int(got.argmax()) == int(want.argmax())
    # Exactly one slot per token: the padding of the last run took none.
    assert static.slots.used == len(ids) and static.kv_pos_max(0) == len(ids) - 1
    # The same prompt fed in other cuts (the last token alone) ends in the same logits.
    static.kv_remove(0, len(ids) - 1, -1)
    again = prefill(static, 0, ids[-1:], start=len(ids) - 1)
    assert np.abs(again - got).max() < 1e-3
    static.kv_remove(0)
    dynamic.kv_remove(0)


def test_the_last_slot_of_the_pool(static, dynamic):
    """A batch that fills the pool exactly still runs padded (the padding writes the sink, not a
    slot), its logits are the dynamic flavour's, and the next token is a KVFullError that keeps nothing."""
    rng = np.random.default_rng(5)
    ids = rng.integers(100, 20000, SLOTS).tolist()
    static.kv_remove(0)
    dynamic.kv_remove(0)
    prefill(static, 0, ids[:-6], chunk=static.n_batch)
    got = prefill(static, 0, ids[-6:], start=SLOTS - 6)  # 6 tokens in the 16-token graph, 10 padding
    want = prefill(dynamic, 0, ids)
    assert static.slots.used == SLOTS
    assert np.abs(got - want).max() < 1e-3 and int(got.argmax()) == int(want.argmax())
    with pytest.raises(KVFullError):
        static.decode([BatchToken(5, 1, 0, True)])
    assert static.kv_pos_max(1) == -1 and static.slots.used == SLOTS
    static.kv_remove(0)
    dynamic.kv_remove(0)
    assert static.slots.used == 0


class _FailingSecondRun:
    """A real session whose second run raises, as a device error mid-batch would."""

    def __init__(self, session):
        self._s, self.runs = session, 0

    def run_with_iobinding(self, io):
        self.runs += 1
        if self.runs == 2:
            raise RuntimeError("device lost")
        return self._s.run_with_iobinding(io)


def test_a_failed_run_mid_batch_keeps_nothing(static):
    ids = chat(static, PROMPTS[0])
    static.kv_remove(0)
    real = static.sessions[16]
    static.sessions[16] = _FailingSecondRun(real)
    try:
        with pytest.raises(BackendError, match="decode failed"):
            prefill(static, 0, ids + ids)  # two 16-token runs at least: the first one committed
    finally:
        static.sessions[16] = real
    assert static.slots.used == 0 and static.kv_pos_max(0) == -1


def test_sequences_decoding_together_match_the_dynamic_alone(static, dynamic, record_property):
    """Through the Engine and scheduler: 4 requests at once on the static flavour (their decodes share
    a 4-token run, prompts cut into runs beside them) give each one's dynamic answer alone."""
    prompts = [chat(dynamic, t) for t in PROMPTS[:4]]

    def limits(backend) -> EngineLimits:
        return EngineLimits(max_sequences=4, batch_tokens=64, n_ctx=backend.capabilities.kv_cells,
                            n_ctx_seq=128, prefix_cache=False)

    alone = engine_answers(dynamic, limits(dynamic), prompts, False, 12)
    before = static.runs_by_bucket[4]
    together = engine_answers(static, limits(static), prompts, True, 12)
    same = sum(a == t for a, t in zip(alone, together))
    record_property("static_together_equal_dynamic_alone", same)
    assert same == len(prompts), [(a, t) for a, t in zip(alone, together) if a != t]
    assert static.runs_by_bucket[4] > before  # the four decoders shared one 4-token run
    assert static.slots.used == 0


def _broken(static_dir, tmp_path, edit) -> BackendError:
    from localserve.backends.onnx.load import load_onnx

    folder = tmp_path / "broken"
    folder.mkdir()
    meta = json.loads((static_dir / "localserve-onnx.json").read_text())
    for name in meta["static"]["graphs"].values():
        shutil.copy(static_dir / name, folder / name)  # the graphs only, not the weights file
    edit(meta)
    (folder / "localserve-onnx.json").write_text(json.dumps(meta))
    with pytest.raises(BackendError) as e:
        load_onnx(folder, "unused.gguf", n_ctx=64, n_seq_max=2, n_batch=16)
    assert str(folder.parent) not in str(e.value)  # no host paths in the message
    return e.value


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.pop("static"), "lacks a valid 'static' entry"),
    (lambda m: m["static"].update(tokens="many"), "lacks a valid 'static' entry"),
    (lambda m: m["static"].update(slots=8), "inconsistent"),  # fewer slots than the largest bucket
    (lambda m: m["static"]["graphs"].pop("4"), "inconsistent"),
    (lambda m: m["static"]["graphs"].update({"4": "../model.t4.onnx"}), "no graph file"),
    (lambda m: m["static"]["graphs"].update({"4": "gone.onnx"}), "no graph file"),
    (lambda m: m.update(flavour="wobbly"), "flavour: wobbly"),
    (lambda m: None, "weights cannot be read"),  # a sound meta, but the folder lost its weights file
])
def test_a_broken_meta_is_a_clear_backend_error(static_dir, tmp_path, edit, needle):
    assert needle in str(_broken(static_dir, tmp_path, edit))


def test_converter_refuses_bad_buckets_before_any_work(smollm2_gguf, tmp_path):
    from localserve.convert import convert_gguf

    for tokens, slots in (((0, 4), 64), ((), 64), ((16, 64), 32)):
        with pytest.raises(ValueError, match="static_"):
            convert_gguf(smollm2_gguf, tmp_path / "out", flavour="static", static_tokens=tokens, static_slots=slots)
        assert not list(tmp_path.iterdir())


def test_registry_serves_a_static_variant(tmp_path, smollm2_gguf, static_dir, dynamic):
    """A tag holding the GGUF and a static folder, backend=onnx: models.load_engine runs the static
    backend with the engine's KV pool set to the graphs' slot count, and answers as the dynamic one."""
    from pathlib import Path

    from localserve.runtime import manager as models
    from localserve.backends.onnx.static import StaticOnnxBackend
    from localserve.config.settings import load_settings
    from localserve.store.cache import ModelStore

    settings = load_settings(flags={"home": str(tmp_path), "backend": "onnx"}, environ={},
                             config_path=Path(tmp_path) / "none.toml")
    store = ModelStore(settings)
    store.register_local(smollm2_gguf, "smol")
    engine = models.load_engine(store.add_directory(static_dir, "smol"), settings)
    try:
        assert engine.backend_name == StaticOnnxBackend.__name__  # in its engine worker process
        assert engine.stats().kv_total == SLOTS
        ids = chat(dynamic, PROMPTS[1])
        want = greedy(dynamic, ids, 12)
        end = next((i for i, t in enumerate(want) if dynamic.is_eog(t)), len(want))  # EOS not emitted
        assert asyncio.run(answer(engine, ids, 12))[:end] == want[:end]
    finally:
        engine.shutdown()


def test_cli_converts_the_static_flavour(tmp_path, capsys):
    from localserve.cli import main
    from localserve.config.settings import load_settings
    from localserve.store.cache import ModelStore
    from onnx_helpers import write_tiny_gguf

    home = tmp_path / "home"
    assert main(["--home", str(home), "add", str(write_tiny_gguf(tmp_path / "t.gguf")), "--name", "tiny"]) == 0
    assert main(["--home", str(home), "convert", "tiny", "--static", "--static-tokens", "4,1", "--static-slots", "2"]) == 2
    assert "--static-slots" in capsys.readouterr().err  # refused before any work: 2 slots < a 4-token run
    assert main(["--home", str(home), "convert", "tiny", "--static", "--static-tokens", "4,1", "--static-slots", "32"]) == 0
    store = ModelStore(load_settings(flags={"home": str(home)}, environ={}, config_path=home / "none.toml"))
    variant = store.find("tiny").variants["onnx"]
    assert variant.meta["static"]["tokens"] == [1, 4] and variant.meta["static"]["slots"] == 32
    assert (variant.path / "model.t1.onnx").is_file()
