"""Settings, read in one place: defaults < config file < environment (LOCALSERVE_*) < flags.

Every other module receives a `Settings` object; nothing else reads the environment or the config
file. `localserve config` prints each effective value with where it came from, because "why is it
listening on that port?" is the first question a user asks when two sources disagree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from ..errors import ConfigError
from .aliases import parse_alias
from .gpu_split import check_split
from .kv_cache import check_kv_types
from .loras import check_model_loras
from .moe import check_cpu_moe
from .upstreams import UpstreamConfig, parse_upstreams, resolve_keys

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

APP_NAME = "localserve"
# Ollama uses 11434, LM Studio 1234, llama-server 8080: stay clear of all three.
DEFAULT_PORT = 11480
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORS_ORIGINS = ("http://localhost", "http://127.0.0.1", "http://[::1]", "vscode-webview://", "vscode-file://")


@dataclass
class Settings:
    home: Path = field(default_factory=lambda: Path(platformdirs.user_data_dir(APP_NAME)))
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    catalog: Path | None = None  # a user catalog that extends / overrides the built-in models.json
    default_model: str = DEFAULT_MODEL
    api_key: str | None = None
    cors_origins: tuple[str, ...] = DEFAULT_CORS_ORIGINS
    hf_endpoint: str = "https://huggingface.co"  # tests point this at a local server answering like the Hub
    # A Hugging Face access token for gated and private repositories; when unset, the Hub's own
    # HF_TOKEN variable or the token file `huggingface-cli login` writes (see _hf_token_fallback).
    hf_token: str | None = None
    keep_alive: float = 300.0  # seconds a model stays loaded after its last request
    # Models loaded at once: 0 = as many as the memory estimates fit (runtime/swaps.py); a number
    # is an upper bound on top of that.
    max_loaded_models: int = 0
    # Seconds a model just loaded keeps its slot while it has work, before a request for another
    # model may make it drain (the thrash guard, runtime/swaps.py). 10 s is several times a small
    # model's load (0.3-2 s here) and about one load of a 7-8B model from the page cache, so two busy
    # models sharing one slot spend most of their time answering, not loading; an idle model gives its
    # slot up at once, so a lone request never waits for it.
    swap_min_residency: float = 10.0
    # Each loaded local model runs in a worker process of its own (engine/worker/): a native crash,
    # abort or hang in llama.cpp or ONNX Runtime ends that model's requests, never the daemon.
    # Off: models run inside the daemon's process (a little less memory, nothing isolated).
    engine_workers: bool = True
    # Seconds a worker holding work may go without progress before it is killed as hung; the
    # watchdog waits at least 30 s and 20x the longest recent step, whichever is more, up to this.
    engine_hang_timeout: float = 300.0
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish when the daemon stops
    context_length: int = 0  # per request; 0 = min(trained context, 8192)
    # Output tokens a local model's answer may take when the request names no limit (OpenAI chat's
    # max_tokens, Responses' max_output_tokens, Ollama's num_predict, llama.cpp's n_predict): llama-server's
    # -n, Ollama's num_predict in a Modelfile. A small model that loops would otherwise fill the whole
    # context while an agent that sends no limit waits. 0 = up to the context's end.
    default_max_tokens: int = 0
    max_sequences: int = 0  # 0 = sized from memory and the machine
    batch_tokens: int = 0  # per-step token budget; 0 = sized from the machine
    queue_size: int = 64  # per lane
    queue_timeout: float = 600.0
    # Seconds a stream may stay silent before it gets a keepalive, while a slow CPU prefill or a
    # queue holds its first token back: a frame each dialect's SDK reads as progress (server/held.py;
    # an empty OpenAI delta, an Ollama done:false line, Anthropic's ping), or a `: ping` comment on
    # llama.cpp's routes. Clients with an idle guard (Qwen Code's 240 s, Cline's 30 s read timeout)
    # would otherwise give up on work that is progressing. llama-server pings every 30 s. 0 = never.
    sse_ping_interval: float = 15.0
    threads: int = 0  # 0 = physical cores
    # Compute on the cores other processes leave free, re-read every second between steps
    # (engine/threads.py): beside one busy process, 2 threads on 2 cores run 6x slower than 1.
    # `threads` stays the most it uses. Off: always `threads`.
    adaptive_threads: bool = True
    # Milliseconds a step's batch-lane prompt chunks may take, converted to tokens with the costs
    # measured on this machine: bounds what an interactive request arriving meanwhile waits. 0 = off.
    # Ten times that for batch work alone on a backend that interrupts a step for an arrival.
    batch_step_ms: float = 50.0
    # "streams": one KV stream per sequence id, so a request's output does not depend on what else
    # runs (llama.cpp's attention sums over interleaved cells of a shared pool round differently),
    # but every id, parked prefix-cache ones too, holds a full-length stream. "unified": one shared
    # cell pool with flash attention, long contexts for the same memory, outputs may vary with load.
    # "auto": streams where they give every running request its full context within the KV budget
    # (exact answers where that costs nothing), else unified (backends/llamacpp/sizing.py).
    kv_layout: str = "auto"
    # KV cache element type: "f16", "q8_0" (half the memory; needs flash attention, so only where
    # exactness is given up anyway), or "auto" = f16 with streams, q8_0 in a unified pool. Any type
    # llama.cpp offers (kv_cache.py: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl), K and V
    # apart as "K/V" ("q8_0/f16": a quantized K needs no flash attention, a quantized V does).
    # `model_kv_cache_type` sets it per model: "NAME[:TAG]=K/V" items, like model_backends.
    kv_cache_type: str = "auto"
    model_kv_cache_type: tuple[str, ...] = ()
    # Mixture-of-experts weights in RAM while the rest is on the GPU (config/moe.py): "auto" keeps
    # them there exactly when the whole model does not fit the GPU but the rest does; "on" / "off".
    # n_cpu_moe = N: only the first N layers' experts (llama-server's --n-cpu-moe). Per model:
    # model_cpu_moe = ["NAME[:TAG]=auto|on|off|N"].
    cpu_moe: str = "auto"
    n_cpu_moe: int = 0
    model_cpu_moe: tuple[str, ...] = ()
    # Several GPUs (config/gpu_split.py): split_mode layer|row|none; tensor_split "3,1" (the cards'
    # shares; empty: by free memory, and only when one card cannot hold the model). Per model:
    # model_split_mode = ["NAME[:TAG]=row"], model_tensor_split = ["NAME[:TAG]=3/1"].
    split_mode: str = "layer"
    tensor_split: str = ""
    model_split_mode: tuple[str, ...] = ()
    model_tensor_split: tuple[str, ...] = ()
    # LoRA adapters per model, "NAME[:TAG]=FILE" items (a GGUF adapter each; several per model):
    # loaded with it after those `add --lora` stored with the tag (config/loras.py).
    model_loras: tuple[str, ...] = ()
    # llama.cpp's CPU flash-attention kernel rounds differently for chunks of 64+ tokens, so with it
    # on a prompt's output depends on how its prefill was chunked beside other requests.
    flash_attention: bool = False
    prefix_cache: bool = True  # keep finished requests' KV to serve later prompts sharing a prefix
    # Seconds a finished request's KV stays in memory unused while the model idles, before it goes
    # back to the OS -- where a later prompt gets it back cheaply: from the prompt cache on disk, or
    # by computing a short prompt again (batching/prefix_cache.py). 0: kept until memory runs short.
    prefix_cache_idle_release_s: float = 30.0
    # Bytes the prompt cache on disk may hold, all models together (store/prompt_cache.py): what the
    # prefix cache parked, kept across unloads, restarts and crashes. It never leaves less than a
    # tenth of the disk free either; least recently used files go first. 0 = off.
    prompt_cache_disk_bytes: int = 8 * 1024 ** 3
    # Speculative decoding by prompt lookup (batching/speculation.py): "auto" drafts where the
    # step costs measured on this machine say it pays (an edit copying its input, alone: yes; eight
    # chats: no), "ngram" drafts whenever the sequence's own tokens offer a match, "off" never.
    # `model_speculative` overrides it per model, "NAME[:TAG]=MODE" items like model_backends.
    speculative: str = "auto"
    model_speculative: tuple[str, ...] = ()
    # Which backend runs models: auto (placement.py decides from the hardware and the formats a
    # model has), llamacpp or onnx. `model_backends` overrides it per model: "NAME[:TAG]=BACKEND"
    # items (comma-separated in env and flags), e.g. "qwen2.5-7b=onnx"; a bare name covers all tags.
    backend: str = "auto"
    model_backends: tuple[str, ...] = ()
    # Names clients send for models not served here, "PATTERN=MODEL" items with glob patterns
    # (comma-separated in env and flags), e.g. "claude-*=smollm2-135m" for Claude Code (aliases.py).
    model_aliases: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    # Seconds a client has to send a request body once its headers are in (408 after); 0 = no limit.
    body_timeout: float = 30.0
    # Seconds a connection may sit idle (from connect or its last response) before the headers of
    # its next request are complete: keep-alive reuse, and the bound on a client that trickles
    # headers to hold connections open (slowloris).
    idle_timeout: float = 60.0
    # Tokens of all inputs of one embeddings request together, as embedded (after truncation;
    # OpenAI's limit is 300k). Memory is
    # not what bounds it (a request's token lists take ~40 bytes a token, ~12 MB at this cap, and
    # the embeddings context holds one group of inputs at a time); time is: it runs between
    # generation steps, so a big request slows chats a little but for long.
    max_embed_tokens: int = 300_000
    # Images in one generating request (api/images.py), each a 400 naming the field over it, before
    # any model work: how many; their encoded bytes together (base64 is decoded first; a fetched
    # URL stops reading past it); the pixels of one image, read from its header before decoding
    # (a 64 kB PNG can declare 100000x100000: a decompression bomb is refused unopened; 25M takes
    # a 6K screenshot); seconds an image URL has to arrive whole (fetched under /api/pull's link
    # policy: https to public hosts, or the hosts in pull_allow_http_hosts).
    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 25_000_000
    image_fetch_timeout: float = 20.0
    # Seconds of audio in one request's `input_audio` clips together, read from each file's header
    # or frames (api/audio_checks.py). The model hears audio in 30-second windows, each a fixed run
    # of prompt positions (375 on the test projector, ~190 on Ultravox), so this bounds the encoder's
    # work and the prompt a request brings; clips count toward max_images_per_request and
    # max_image_bytes (10 minutes of 16 kHz 16-bit mono WAV is 19 MB).
    max_audio_seconds: float = 600.0
    # Documents of one rerank request (/v1/rerank; Cohere recommends at most 1,000), and the tokens
    # of all its query + document pairs together, as ranked (the query is counted once per pair).
    # As with embeddings, time bounds them: the pairs are scored between generation steps.
    max_rerank_documents: int = 1000
    max_rerank_tokens: int = 300_000
    # /v1/embeddings `input` as token ids: refused unless on. langchain-openai's OpenAIEmbeddings sends
    # ids of OpenAI's cl100k tokenizer by default; read as this model's ids they are other text, and the
    # vectors came back 200 and wrong. On: the ids are taken as the served model's own.
    embed_token_ids: bool = False
    # Seconds a streaming response may stay blocked on a client that reads nothing before the
    # connection is dropped and its sequence freed (server/generation.guard_disconnect); 0 = never.
    stream_write_timeout: float = 30.0
    # Pulls over the HTTP API run on their own thread pool of this size (429 beyond it), so model
    # lookups and listings never wait behind slow downloads.
    max_concurrent_pulls: int = 3
    pull_stall_timeout: float = 60.0  # seconds without a byte before a download fails (resumable)
    pull_lock_timeout: float = 60.0  # seconds a pull waits for another pull of the same model
    # Hosts /api/pull may fetch from over http:// or at loopback/private addresses (a LAN mirror);
    # every other host must be public and https, so clients cannot probe the local network.
    pull_allow_http_hosts: tuple[str, ...] = ()
    # Where `localserve setup` looks for a prebuilt llama-cpp-python before compiling: folders of
    # wheels, find-links pages or package indexes, each `BUILD=SOURCE` (cuda=..., one build's) or
    # `SOURCE` (any; the wheel's flavour is read from its libraries). runtime/wheels.py.
    llama_wheels: tuple[str, ...] = ()
    pull_min_free_disk: int = 64 * 1024 * 1024  # bytes a download always leaves free on the disk
    partial_max_age_days: float = 7.0  # abandoned .partial downloads older than this are deleted
    # Batch API (localserve/batches/): input files of at most this many bytes and lines (OpenAI's
    # own limits); unfinished lines expire this many seconds after the batch was created (OpenAI's
    # completion_window "24h"); lines in flight at once (0 = twice the model's max_sequences, at
    # most queue_size: the continuous batch stays full and the next line is already queued); free
    # disk that batch files must leave (create: 507; finalize: the batch waits, results saved).
    batch_max_file_bytes: int = 200 * 1024 * 1024
    batch_max_lines: int = 50_000
    batch_completion_window: float = 86_400.0
    batch_in_flight: int = 0
    batch_min_free_disk: int = 64 * 1024 * 1024
    # Responses API (api/response_store.py): stored responses (`store`, the default) older than
    # this many days are deleted, lazily on the next write; 0 = keep them until deleted.
    responses_retention_days: float = 30.0
    log_level: str = "info"
    # OpenAI-compatible engines whose models are served here too ([[upstreams]] tables, JSON in the
    # environment; upstream/config.py). Their keys come from the file or api_key_env, never shown.
    upstreams: tuple[UpstreamConfig, ...] = ()
    upstream_health_interval: float = 10.0  # seconds between health checks of an upstream that is up
    # Bytes of one non-streamed upstream answer, and of one streamed event: a broken or hostile
    # upstream cannot make the daemon buffer without bound.
    upstream_max_response_bytes: int = 32 * 1024 * 1024
    upstream_connect_timeout: float = 10.0  # seconds to connect and get response headers
    # Where each value came from, for `localserve config`.
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def responses_dir(self) -> Path:
        """The Responses API's store (api/response_store.py)."""
        return self.home / "responses"

    @property
    def batches_dir(self) -> Path:
        """The Batch API's database and files (batches/)."""
        return self.home / "batches"

    @property
    def prompt_cache_dir(self) -> Path:
        """The prompt cache on disk: parked prompts, so a user's conversations (store/prompt_cache.py,
        whose cache_root names the same folder)."""
        return self.home / "prompt-cache"

    @property
    def run_dir(self) -> Path:
        """Pid/lock files of the daemon; beside the data so two LOCALSERVE_HOMEs never collide."""
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        if "home" in self.sources and self.sources["home"] != "default":
            return self.home / "logs"
        return Path(platformdirs.user_log_dir(APP_NAME))

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


_SETTING_NAMES = [f.name for f in fields(Settings) if f.name != "sources"]
_SECRETS = ("api_key", "hf_token")  # never shown by `localserve config`


def _hf_token_fallback(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(token, source) from where Hugging Face's own tools keep it: HF_TOKEN, else the token file
    (HF_TOKEN_PATH, else HF_HOME/token, else ~/.cache/huggingface/token)."""
    if environ.get("HF_TOKEN", "").strip():
        return environ["HF_TOKEN"].strip(), "env HF_TOKEN"
    if environ.get("HF_TOKEN_PATH"):
        path = Path(environ["HF_TOKEN_PATH"]).expanduser()
    else:
        home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()
        cache = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
        path = Path(environ.get("HF_HOME") or cache / "huggingface").expanduser() / "token"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return (token, "huggingface token file") if token else None


def config_file_path(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("LOCALSERVE_CONFIG"):
        return Path(environ["LOCALSERVE_CONFIG"])
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def _coerce(name: str, value: Any) -> Any:
    """Turn a raw value (TOML value, env string, flag) into the field's type, or raise ConfigError."""
    default = getattr(Settings(), name)
    try:
        if name == "upstreams":
            return parse_upstreams(value)
        if name in ("home", "catalog"):
            return Path(os.path.expanduser(str(value))) if value not in (None, "") else None
        if isinstance(default, tuple):  # comma-separated in env and flags, a list in TOML
            items = value.split(",") if isinstance(value, str) else list(value)
            result = tuple(s.strip() for s in items if s.strip())
            if name == "model_aliases":
                for item in result:
                    parse_alias(item)  # a malformed item stops the daemon at start, not a request
            return result
        if name in _SECRETS:
            return str(value).strip() or None
        if isinstance(default, bool):
            return str(value).lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            result: Any = int(value)
        elif isinstance(default, float):
            result = float(value)
        else:
            result = str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name!r}: {value!r} is not a valid {type(default).__name__}") from None
    if isinstance(result, (int, float)) and result < 0:
        raise ConfigError(f"setting {name!r} must not be negative (got {value!r})")
    return result


def load_settings(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> Settings:
    """Build the effective settings. `flags` holds only options the user actually gave (None = not given)."""
    environ = os.environ if environ is None else environ
    settings = Settings()
    sources = {name: "default" for name in _SETTING_NAMES}

    path = config_path or config_file_path(environ)
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path.name} is not valid TOML: {e}") from None
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in _SETTING_NAMES:
                raise ConfigError(f"config file {path.name}: unknown setting {key!r}")
            setattr(settings, name, _coerce(name, value))
            sources[name] = f"config file ({path})"

    for name in _SETTING_NAMES:
        env_name = f"LOCALSERVE_{name.upper()}"
        if environ.get(env_name, "") != "":
            setattr(settings, name, _coerce(name, environ[env_name]))
            sources[name] = f"env {env_name}"

    for name, value in (flags or {}).items():
        if value is None:
            continue
        if name not in _SETTING_NAMES:
            raise ConfigError(f"unknown setting {name!r}")
        setattr(settings, name, _coerce(name, value))
        sources[name] = f"flag --{name.replace('_', '-')}"

    # Types and combinations llama.cpp refuses stop the start here, naming the entry, not a load.
    check_kv_types(settings.kv_cache_type, settings.model_kv_cache_type, settings.kv_layout, settings.flash_attention)
    check_model_loras(settings.model_loras)
    check_cpu_moe(settings.cpu_moe, settings.model_cpu_moe)
    check_split(settings.split_mode, settings.tensor_split, settings.model_split_mode, settings.model_tensor_split)
    settings.upstreams = resolve_keys(settings.upstreams, environ)
    if settings.hf_token is None and (fallback := _hf_token_fallback(environ)):
        settings.hf_token, sources["hf_token"] = fallback
    settings.sources = sources
    return settings


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """(name, value, source) rows for display; secrets (API key, Hub token) are masked."""
    rows = []
    for name in _SETTING_NAMES:
        value = getattr(settings, name)
        if name in _SECRETS and value:
            shown = "****"
        elif name == "upstreams":
            shown = "; ".join(u.shown() for u in value)  # each key masked
        elif isinstance(value, tuple):
            shown = ",".join(value)
        else:
            shown = "" if value is None else str(value)
        rows.append((name, shown, settings.sources.get(name, "default")))
    return rows


def replace(settings: Settings, **changes: Any) -> Settings:
    """A copy with some values changed (tests and the daemon's child process use this)."""
    new = dataclasses.replace(settings, **changes)
    new.sources = dict(settings.sources, **{k: "override" for k in changes})
    return new
