"""/v1/rerank on a real reranker GGUF (tests/rerank_model.py: SmolLM2 with a seeded rank head), through
a real server with its engine workers: the documents come back in the order, and with the scores,
that llama.cpp loaded directly gives the same pairs; alone and beside running chats alike; top_n,
return_documents, the other request shapes (Cohere's SDK unchanged, Jina's and TEI's bodies), a
model that is not a reranker, and the bounds."""

from __future__ import annotations

import re
import threading

import llama_cpp
import pytest

from localserve.store.cache import ModelStore
from rerank_model import RERANK_TEMPLATE, with_rank_head
from server_harness import MODEL, LiveServer, install_model, server_settings
from worker_locks import THREADS

RERANKER = "smollm2-rerank"  # with Qwen3-Reranker's rerank template
PLAIN = "smollm2-rerank-plain"  # without: BOS query EOS SEP document EOS, as the vocabulary adds them
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are yellow when they are ripe.",
    "The Eiffel Tower stands in Paris.",
    "Berlin is the capital of Germany.",
]
MAX_DOCUMENTS = 8
MAX_TOKENS = 3_000
CONTEXT = 1024  # server_settings' context_length: the longest pair a sequence holds
BAN_EOS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens: a chat runs to max_tokens


@pytest.fixture(scope="module")
def models(smollm2_gguf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank-models")
    return {RERANKER: with_rank_head(smollm2_gguf, folder / "rerank.gguf"),
            PLAIN: with_rank_head(smollm2_gguf, folder / "plain.gguf", template=False)}


@pytest.fixture(scope="module")
def server(smollm2_gguf, models, tmp_path_factory):
    settings = server_settings(tmp_path_factory.mktemp("home"), max_rerank_documents=MAX_DOCUMENTS,
                               max_rerank_tokens=MAX_TOKENS)
    install_model(settings, smollm2_gguf)
    for name, path in models.items():
        ModelStore(settings).register_local(path, name, "Q4_1")
    with LiveServer(settings) as live:
        yield live


class DirectReranker:
    """The GGUF in llama.cpp through llama-cpp-python's own bindings, no localserve code: a rank
    pooling context as llama-server makes one (flash attention off, as localserve runs it), the
    pairs laid out as its format_prompt_rerank does, each pair decoded whole and alone, the score
    being the first output of its sequence (send_rerank)."""

    def __init__(self, path) -> None:
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = CONTEXT, CONTEXT, CONTEXT, 1
        params.embeddings, params.kv_unified = True, True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_RANK
        params.n_threads = params.n_threads_batch = THREADS
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        template = llama_cpp.llama_model_chat_template(self.model, b"rerank")
        self.template = template.decode() if template else None

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 16))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        return list(buf[:n])

    def pair(self, query: str, document: str) -> list[int]:
        if self.template:
            return self.tokenize(self.template.replace("{query}", query).replace("{document}", document))
        v = self.vocab
        eos = llama_cpp.llama_vocab_eos(v) if llama_cpp.llama_vocab_eos(v) >= 0 else llama_cpp.llama_vocab_sep(v)
        tokens = [llama_cpp.llama_vocab_bos(v)] if llama_cpp.llama_vocab_get_add_bos(v) else []
        tokens += self.tokenize(query)
        tokens += [eos] if llama_cpp.llama_vocab_get_add_eos(v) else []
        tokens += [llama_cpp.llama_vocab_sep(v)] if llama_cpp.llama_vocab_get_add_sep(v) else []
        tokens += self.tokenize(document)
        return tokens + ([eos] if llama_cpp.llama_vocab_get_add_eos(v) else [])

    def scores(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        pairs = [self.pair(query, d) for d in documents]
        return [self.score(tokens) for tokens in pairs], sum(map(len, pairs))

    def score(self, tokens: list[int]) -> float:
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        for pos, token in enumerate(tokens):
            batch.token[pos], batch.pos[pos], batch.n_seq_id[pos], batch.logits[pos] = token, pos, 1, 1
            batch.seq_id[pos][0] = 0
        batch.n_tokens = len(tokens)
        try:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
            assert llama_cpp.llama_decode(self.ctx, batch) == 0
            return float(llama_cpp.llama_get_embeddings_seq(self.ctx, 0)[0])
        finally:
            llama_cpp.llama_batch_free(batch)


@pytest.fixture(scope="module")
def direct(models):
    rerankers = {name: DirectReranker(path) for name, path in models.items()}
    yield rerankers
    for r in rerankers.values():
        r.close()


def _ranked(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)


@pytest.mark.parametrize("name", [RERANKER, PLAIN])
def test_documents_come_back_as_the_model_scores_them(server, direct, name):
    expected, n_tokens = direct[name].scores(QUERY, DOCUMENTS)
    assert len(set(expected)) == len(expected)  # an order to check, not ties
    status, body = server.json("POST", "/v1/rerank", {"model": name, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == _ranked(expected)
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == dict(enumerate(expected))
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    assert body["model"] == f"{name}:Q4_1" and "document" not in body["results"][0]


def test_the_rerank_template_is_the_ggufs(direct):
    """The test model's pairs are Qwen3-Reranker's prompt (so the template path is what ran)."""
    assert direct[RERANKER].template == RERANK_TEMPLATE and direct[PLAIN].template is None


def test_scores_beside_running_chats_are_the_same(server, direct):
    """Two chats stream on the reranker's own engine while it ranks: the pairs take turns with the
    chat steps on the engine thread, on a context of their own, in pieces the running chats size,
    and the scores are unchanged to the last bit."""
    expected, _ = direct[RERANKER].scores(QUERY, DOCUMENTS)
    started = threading.Barrier(3, timeout=120)
    finished: list[bool] = []

    def chat() -> None:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        stream = client.chat.completions.create(model=RERANKER, stream=True, max_tokens=150, temperature=0,
                                                logit_bias=BAN_EOS, messages=[{"role": "user", "content": "Hi"}])
        for i, _ in enumerate(stream):
            if i == 2:
                started.wait()
        finished.append(True)

    chats = [threading.Thread(target=chat) for _ in range(2)]
    for t in chats:
        t.start()
    started.wait()  # both chats are generating
    status, body = server.json("POST", "/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS})
    during = len(finished)
    for t in chats:
        t.join(240)
    assert status == 200, body
    assert during < 2  # the ranking did not wait for the chats to end
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == dict(enumerate(expected))
    assert len(finished) == 2


def test_top_n_and_return_documents(server, direct):
    expected, _ = direct[RERANKER].scores(QUERY, DOCUMENTS)
    docs = [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(DOCUMENTS)]  # Jina's and Cohere v1's objects
    status, body = server.json("POST", "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": docs,
                                                       "top_n": 2, "return_documents": True})
    assert status == 200, body
    best = _ranked(expected)[:2]
    assert [r["index"] for r in body["results"]] == best
    assert [r["document"] for r in body["results"]] == [docs[i] for i in best]  # the objects as sent
    status, body = server.json("POST", "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS,
                                                       "top_n": 1, "return_documents": True})
    assert body["results"] == [{"index": best[0], "relevance_score": expected[best[0]],
                                "document": {"text": DOCUMENTS[best[0]]}}]


def test_a_model_that_is_not_a_reranker_is_a_400_naming_it(server):
    status, body = server.json("POST", "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert status == 400 and body["error"]["param"] == "model"
    assert f"{MODEL}:Q4_1 is not a reranker" in body["error"]["message"]
    # and the other way round: a reranker's embeddings are a 400 pointing at /v1/rerank, not a 500
    status, body = server.json("POST", "/v1/embeddings", {"model": RERANKER, "input": "hello"})
    assert status == 400 and body["error"]["param"] == "model" and "/v1/rerank" in body["error"]["message"]


def test_bounds(server, direct):
    too_many = {"model": RERANKER, "query": QUERY, "documents": ["x"] * (MAX_DOCUMENTS + 1)}
    status, body = server.json("POST", "/v1/rerank", too_many)
    assert status == 400 and "max_rerank_documents" in body["error"]["message"]
    # Each pair is ~90 tokens of template: 8 long documents pass the 3,000-token cap.
    long_docs = ["lorem ipsum dolor sit amet " * 40] * MAX_DOCUMENTS
    status, body = server.json("POST", "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": long_docs})
    assert status == 400 and "max_rerank_tokens" in body["error"]["message"] and str(MAX_TOKENS) in body["error"]["message"]
    status, body = server.json("POST", "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                                       "documents": ["word " * 1200]})
    assert status == 400 and re.search(r"\d+ tokens; this model ranks at most 1024", body["error"]["message"])
    for bad, param in [({"documents": []}, "documents"), ({"documents": [{"image": "x.png"}]}, "documents[0].text"),
                       ({"documents": "one"}, "documents"), ({"query": 3}, "query"), ({"top_n": 0}, "top_n")]:
        status, body = server.json("POST", "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": ["a"], **bad})
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    # Cohere v2's max_tokens_per_doc cuts each document instead
    status, body = server.json("POST", "/v2/rerank", {"model": RERANKER, "query": QUERY, "documents": ["word " * 1200],
                                                       "max_tokens_per_doc": 100})
    assert status == 200 and len(body["results"]) == 1


def test_cohere_sdk_unchanged(server, direct):
    cohere = pytest.importorskip("cohere")
    expected, _ = direct[RERANKER].scores(QUERY, DOCUMENTS)
    best = _ranked(expected)
    v1 = cohere.Client(base_url=server.url, api_key="unused")
    answer = v1.rerank(model=RERANKER, query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True)
    assert [r.index for r in answer.results] == best[:3]
    assert [r.document.text for r in answer.results] == [DOCUMENTS[i] for i in best[:3]]
    assert answer.results[0].relevance_score == expected[best[0]]
    v2 = cohere.ClientV2(base_url=server.url, api_key="unused")
    answer = v2.rerank(model=RERANKER, query=QUERY, documents=DOCUMENTS, top_n=2, max_tokens_per_doc=4096)
    assert [r.index for r in answer.results] == best[:2]


def test_jina_and_tei_bodies(server, direct):
    expected, n_tokens = direct[RERANKER].scores(QUERY, DOCUMENTS)
    best = _ranked(expected)
    # Jina's reranker API body, as its docs give it (documents may be objects with text)
    jina = {"model": RERANKER, "query": QUERY, "top_n": 3, "return_documents": False,
            "documents": [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2], {"text": DOCUMENTS[3]}]}
    status, body = server.json("POST", "/v1/rerank", jina)
    assert status == 200 and [r["index"] for r in body["results"]] == best[:3]
    assert body["usage"]["total_tokens"] == n_tokens
    # Hugging Face TEI's body on llama-server's /rerank: texts in, a bare list out
    status, body = server.json("POST", "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True,
                                                    "model": RERANKER})
    assert status == 200 and [r["index"] for r in body] == best
    assert [r["text"] for r in body] == [DOCUMENTS[i] for i in best] and body[0]["score"] == expected[best[0]]



def test_a_batch_line_ranks_as_the_request_alone(server, direct):
    """/v1/rerank as a Batch API endpoint: each line runs the route's own code on the batch lane."""
    import openai
    from test_batches import by_id, contents, line, submit, wait

    expected, _ = direct[RERANKER].scores(QUERY, DOCUMENTS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bodies = {"ok": {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
              "not-a-reranker": {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}}
    batch = submit(client, [line(cid, "/v1/rerank", body) for cid, body in bodies.items()], "/v1/rerank")
    done = wait(client, batch.id)
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    answer = by_id(contents(client, done.output_file_id))["ok"]["response"]["body"]
    assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == \
        [(i, expected[i]) for i in _ranked(expected)[:2]]
    refused = by_id(contents(client, done.error_file_id))["not-a-reranker"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "model"
