"""OpenAI's /v1/embeddings without HTTP: a body parsed into a call, the call run on the model (or
its upstream), the list object out. Shared by the route (server/openai_routes.py) and the Batch API
as api/openai.py's chat and completions are.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from ..protocol.engine import TextEngine
from ..protocol.requests import Lane
from .generation import embed_texts
from .openai import ApiEnv, parse_text_or_tokens
from .validation import MAX_EMBED_INPUTS, Body, invalid, parse_lane


@dataclass
class EmbeddingsCall:
    model: str
    inputs: list[str | list[int]]
    encoding: str  # "float" or "base64"
    dimensions: int | None
    lane: Lane = "default"


def parse_embeddings(body: Body, env: ApiEnv) -> EmbeddingsCall:
    return EmbeddingsCall(
        model=body.get_str("model", None, max_len=512) or env.settings.default_model,
        inputs=parse_text_or_tokens(body.raw("input"), "input", MAX_EMBED_INPUTS),
        encoding=body.get_str("encoding_format", "float", choices=("float", "base64")) or "float",
        dimensions=body.get_int("dimensions", None, lo=1, hi=1 << 20),
        lane=parse_lane(body, env.priority_header, "default"),
    )


def refuse_foreign_token_ids(inputs: Sequence[str | list[int]], allowed: bool) -> None:
    """Token ids are another tokenizer's unless the user said otherwise: langchain-openai's default
    OpenAIEmbeddings sends OpenAI's cl100k ids, which read as this model's ids are other text (its
    vectors had cosine 0.75 with the same sentence sent as text). An upstream is not asked this: its
    model may well be the one whose tokenizer made them."""
    if allowed or all(isinstance(item, str) for item in inputs):
        return
    raise invalid("'input' holds token ids, which this server cannot tell are this model's tokenizer's: send "
                  "the text instead (langchain-openai: OpenAIEmbeddings(check_embedding_ctx_length=False)), or "
                  "turn on the setting embed_token_ids if the ids come from this model's own tokenizer", "input")


async def embeddings(call: EmbeddingsCall, env: ApiEnv) -> dict[str, Any]:
    """The embeddings list object for a parsed call."""
    async with env.manager.use(call.model, lane=call.lane) as loaded:
        if isinstance(loaded.engine, TextEngine):  # the upstream tokenizes, counts and checks dimensions
            vectors, n_tokens = await loaded.engine.embed_text(call.inputs, call.dimensions)
        else:
            refuse_foreign_token_ids(call.inputs, env.settings.embed_token_ids)
            n_embd = loaded.engine.info.n_embd
            if call.dimensions is not None and call.dimensions != n_embd:
                raise invalid(f"'dimensions' must be {n_embd} for this model (no reduction supported)", "dimensions")
            token_lists, vectors = await embed_texts(loaded.engine, call.inputs, truncate=False, param="input",
                                                     max_tokens=env.settings.max_embed_tokens, lane=call.lane)
            n_tokens = sum(len(t) for t in token_lists)
    data = []
    for i, vector in enumerate(vectors):
        if call.encoding == "base64":
            # What the openai package asks for by default: little-endian float32, base64.
            encoded: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        else:
            encoded = [float(x) for x in vector]
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    return {"object": "list", "data": data, "model": loaded.name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}