"""Rerank without HTTP: `/v1/rerank` (and `/rerank`, `/v1/reranking`, `/v2/rerank`) as the clients of
llama-server, vLLM, Jina and Cohere send it.

Every shape is one request: `query`, `documents` (strings, or objects with `text`, as Jina and
Cohere's v1 take them; `rank_fields` picks an object's fields as Cohere's v1 does), `top_n`,
`return_documents`; Cohere's v2 `max_tokens_per_doc` cuts each document; TEI's `texts` (with
`return_text`) is answered with TEI's bare list, as llama-server does. The answer is llama-server's
and Jina's `results` (`index`, `relevance_score`, `document` when asked), best first, with `usage`,
which Cohere's SDK reads as well (it takes `id` and ignores the rest).

A pair is laid out as llama-server's format_prompt_rerank lays it out (ModelInfo.rerank: the
GGUF's rerank template, else BOS query EOS SEP document EOS as the vocabulary adds them) and scored
by the engine's `rank`, in turns with embeddings between generation steps.
"""

from __future__ import annotations

import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from ..protocol.engine import ModelEngine, RerankFormat
from ..protocol.requests import Lane
from .errors import ClientGone
from .generation import off_loop_stoppable
from .openai import ApiEnv
from .validation import Body, invalid, parse_lane

_FIELDS = re.compile(r"\{(query|document)\}")


@dataclass
class RerankCall:
    model: str
    query: str
    documents: list[Any]  # as sent: strings or objects, for `document` in the answer
    texts: list[str]  # what is ranked of each
    top_n: int
    return_documents: bool
    max_tokens_per_doc: int | None
    tei: bool  # TEI's body (`texts`): answered with TEI's bare list
    lane: Lane = "default"


def parse_rerank(body: Body, env: ApiEnv) -> RerankCall:
    """Every field checked before any model is loaded."""
    tei = body.has("texts") and not body.has("documents")
    name = "texts" if tei else "documents"
    query = body.get_str("query", None)
    if query is None:
        raise invalid("'query' must be provided, a string", "query")
    documents = body.get_list(name, max_items=1 << 31)
    most = env.settings.max_rerank_documents
    if not documents or len(documents) > most:
        raise body.error(name, "must be a non-empty array of strings or of objects with 'text', "
                               f"at most {most} (setting max_rerank_documents)")
    rank_fields = body.get_list("rank_fields", max_items=64) or []
    if not all(isinstance(f, str) for f in rank_fields):
        raise invalid("'rank_fields' must be an array of strings", "rank_fields")
    texts = [_document_text(doc, i, name, rank_fields) for i, doc in enumerate(documents)]
    if isinstance(body.data.get("priority"), int):  # Cohere's v2: a number, lower sooner; ours are lanes
        body = Body({k: v for k, v in body.data.items() if k != "priority"})
    return RerankCall(
        model=body.get_str("model", None, max_len=512) or env.settings.default_model,
        query=query,
        documents=documents,
        texts=texts,
        top_n=body.get_int("top_n", len(documents), lo=1, hi=1 << 31) or len(documents),
        return_documents=body.get_bool("return_text" if tei else "return_documents", False),
        max_tokens_per_doc=body.get_int("max_tokens_per_doc", None, lo=1, hi=1 << 31),
        tei=tei,
        lane=parse_lane(body, env.priority_header, "default"),
    )


def _document_text(doc: Any, i: int, name: str, rank_fields: list[str]) -> str:
    if isinstance(doc, str):
        return doc
    param = f"{name}[{i}]"
    if not isinstance(doc, dict):
        raise invalid(f"'{param}' must be a string or an object with 'text'", param)
    if rank_fields:  # Cohere v1: these fields, in this order
        return "\n".join(f"{f}: {_field(doc, f, param)}" for f in rank_fields if f in doc)
    return _field(doc, "text", param)


def _field(doc: dict, key: str, param: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise invalid(f"'{param}.{key}' must be a string (only text documents can be ranked)", f"{param}.{key}")
    return value


async def rerank(call: RerankCall, env: ApiEnv) -> Any:
    """The answer to a parsed call: the results object, or TEI's bare list."""
    async with env.manager.use(call.model, lane=call.lane) as loaded:
        engine = loaded.engine
        layout = engine.info.rerank
        if layout is None:
            raise invalid(f"model {loaded.name} is not a reranker: /v1/rerank needs a GGUF with a rank "
                          "classification head (bge-reranker, Qwen3-Reranker)", "model")
        n_chars = len(call.query) * len(call.texts) + sum(map(len, call.texts))
        pairs = await off_loop_stoppable(n_chars, rerank_pairs, engine, layout, call.query, call.texts,
                                         env.settings.max_rerank_tokens, call.max_tokens_per_doc)
        scores = await engine.rank(pairs, lane=call.lane)
    n_tokens = sum(map(len, pairs))
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:call.top_n]
    if call.tei:
        return [{"index": i, "score": scores[i], **({"text": call.texts[i]} if call.return_documents else {})}
                for i in order]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if call.return_documents:
            doc = call.documents[i]
            result["document"] = doc if isinstance(doc, dict) else {"text": doc}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": loaded.name, "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def rerank_pairs(engine: ModelEngine, layout: RerankFormat, query: str, texts: list[str], max_tokens: int,
                 max_tokens_per_doc: int | None = None, stop: threading.Event | None = None) -> list[list[int]]:
    """One token list per document, laid out as llama-server's format_prompt_rerank does, refused
    (400) as soon as their running total passes `max_tokens` (setting max_rerank_tokens): the
    documents after that point are never tokenized."""
    query_tokens = None if layout.template else engine.tokenize(query, add_special=False)
    pairs: list[list[int]] = []
    total = 0
    for i, text in enumerate(texts):
        if stop is not None and stop.is_set():
            raise ClientGone()
        if max_tokens_per_doc is not None:
            doc_tokens = engine.tokenize(text, add_special=False)
            if len(doc_tokens) > max_tokens_per_doc:
                text = engine.detokenize(doc_tokens[:max_tokens_per_doc])
        if layout.template:
            # One pass, so a `{document}` inside the query stays text (llama-server replaces in turn).
            filled = _FIELDS.sub(lambda m: query if m.group(1) == "query" else text, layout.template)
            tokens = engine.tokenize(filled, add_special=False)
        else:
            tokens = [*layout.prefix, *query_tokens, *layout.middle,  # type: ignore[misc]
                      *engine.tokenize(text, add_special=False), *layout.suffix]
        total += len(tokens)
        if total > max_tokens:
            raise invalid(f"the query and documents make more than {max_tokens} tokens in all (document {i} "
                          "passes it); at most that many per request (setting max_rerank_tokens)", "documents")
        pairs.append(tokens)
    return pairs

