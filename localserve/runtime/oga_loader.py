"""From an OGA folder (or the store's `oga` variant) to a started OgaEngine.

The folder's genai_config.json is the vendor's: its execution provider and its plain EP flags are
kept, since an NPU build only runs on the EP it was compiled for. Its session options are checked
against the allow-list again before OGA reads the folder (oga_config via model_dirs.check_layout:
a folder stored before that check existed, or changed since, never reaches og.Config with a
library, a profiling prefix or a path in it). What we overlay is what the plan sizes: `search.max_length` (OGA allocates each batch's KV cache at max length up front, so it is
the context we grant, capped at MAX_LENGTH) and the thread count when the user set one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.settings import Settings
from ..protocol.engine import ModelInfo
from ..errors import BackendError, ModelDirError, redact_paths
from ..store.model_dirs import OGA, check_layout
from ..engine.oga.engine import OgaEngine
from ..engine.oga.vocab import OgaVocab

if TYPE_CHECKING:
    from .plan import ModelPlan
    from ..store.cache import InstalledModel, StoredVariant

# 4 requests x 4096 tokens of SmolLM2's fp32 KV cache are 750 MB already; longer contexts on a
# desktop CPU would cost every batch that memory whether a request uses it or not.
MAX_LENGTH = 4096
_TOKENIZER_CONFIG = "tokenizer_config.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path.name} is not valid JSON ({type(e).__name__})") from None
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # Hugging Face's named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _scrub(error: Exception, folder: Path) -> str:
    """OGA's and ORT's error text without host paths: the folder's own becomes <folder>, any other
    (the file an escaping name resolved to, beside or above the folder) its last part."""
    return redact_paths(str(error).replace(str(folder.resolve()), "<folder>").replace(str(folder), "<folder>"))[:300]


def _provider(decoder: dict[str, Any]) -> str:
    """The EP the folder's config asks OGA for (its first provider_options entry), else OGA's CPU."""
    options = (decoder.get("session_options") or {}).get("provider_options") or []
    names = [name for entry in options if isinstance(entry, dict) for name in entry]
    return names[0] if names else "cpu"


def build_oga_engine(folder: Path, name: str = "", *, max_length: int = MAX_LENGTH, threads: int | None = None,
                     queue_size: int = 64) -> OgaEngine:
    """A started OgaEngine for the OGA folder `folder` (what benchmarks/onnx_backends.py calls).
    BackendError when onnxruntime-genai cannot load it, with no host path in the message."""
    import onnxruntime_genai as og

    folder = Path(folder)
    check_layout(folder, OGA)
    genai = _read_json(folder / "genai_config.json")
    model_cfg = genai.get("model") or {}
    tok_config = _read_json(folder / _TOKENIZER_CONFIG)
    n_ctx = max(2, min(max_length, MAX_LENGTH, int(model_cfg.get("context_length") or MAX_LENGTH)))
    overlay: dict[str, Any] = {"search": {"max_length": n_ctx}}
    if threads:
        overlay["model"] = {"decoder": {"session_options": {"intra_op_num_threads": threads}}}
    try:
        config = og.Config(str(folder))
        config.overlay(json.dumps(overlay))
        model = og.Model(config)
        tokenizer = og.Tokenizer(model)
    except Exception as e:  # noqa: BLE001 - OGA raises RuntimeError with its own text
        raise BackendError(f"onnxruntime-genai could not load {folder.name!r}: {_scrub(e, folder)}") from None
    vocab = OgaVocab(folder, tokenizer)
    eos = model_cfg.get("eos_token_id")
    eog = {int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int)}
    bos = model_cfg.get("bos_token_id")
    probe = vocab.encode("a")
    vocab.bos_added = bos if isinstance(bos, int) and len(probe) > 1 and probe[0] == bos else None
    decoder = model_cfg.get("decoder") or {}
    info = ModelInfo(
        name=name or folder.name, architecture=str(model_cfg.get("type") or "unknown"),
        n_ctx_train=int(model_cfg.get("context_length") or n_ctx),
        n_vocab=int(model_cfg.get("vocab_size") or vocab.n_vocab), n_embd=int(decoder.get("hidden_size") or 0),
        n_params=0, chat_template=_chat_template(folder, tok_config),
        bos_token=_token_text(tok_config.get("bos_token")), eos_token=_token_text(tok_config.get("eos_token")),
        metadata={"format": "oga", "runtime": f"onnxruntime-genai {getattr(og, '__version__', '')}".strip(),
                  "model_type": str(model_cfg.get("type") or ""), "execution_provider": _provider(decoder)},
    )
    engine = OgaEngine(og, model, vocab, info, name=name or folder.name, n_ctx_per_seq=n_ctx, eog=eog,
                       queue_size=queue_size, seeds="dynamic_batching" in (genai.get("engine") or {}))
    try:
        engine.start()
    except Exception as e:  # noqa: BLE001 - og.Engine refused the model
        raise BackendError(f"onnxruntime-genai's engine could not start {folder.name!r}: {_scrub(e, folder)}") from None
    return engine


def load_oga_engine(installed: "InstalledModel", variant: "StoredVariant", plan: "ModelPlan",
                    settings: Settings) -> OgaEngine:
    """The registry's loader for a stored `oga` variant (already verified against its manifest)."""
    return build_oga_engine(variant.path, installed.ref, max_length=plan.limits.n_ctx_seq,
                            threads=settings.threads or None, queue_size=plan.limits.queue_size)
