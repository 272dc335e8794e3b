"""The rerank body as each client family sends it, and the pair layout, without a model: parse_rerank
(every check before a load) and rerank_pairs over a tokenizer that maps each character to its code."""

from __future__ import annotations

import pytest

from localserve.api.openai import ApiEnv
from localserve.api.rerank import parse_rerank, rerank_pairs
from localserve.api.validation import Body
from localserve.config.settings import Settings, replace
from localserve.errors import InvalidRequestError
from localserve.protocol.engine import RerankFormat

ENV = ApiEnv(replace(Settings(), max_rerank_documents=4), manager=None)  # type: ignore[arg-type]


def parse(body: dict, env: ApiEnv = ENV):
    return parse_rerank(Body(body), env)


class CharTokens:
    """Each character is its code point: token counts and layouts are plain to read."""

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(map(chr, tokens))


def test_documents_as_strings_objects_and_rank_fields():
    call = parse({"query": "q", "documents": ["a", {"text": "b", "id": 7}]})
    assert call.texts == ["a", "b"] and call.documents[1] == {"text": "b", "id": 7}
    assert call.top_n == 2 and not call.return_documents and not call.tei
    call = parse({"query": "q", "documents": [{"title": "T", "body": "B", "text": "x"}], "rank_fields": ["title", "body"]})
    assert call.texts == ["title: T\nbody: B"]


def test_tei_texts_and_cohere_v2_priority():
    call = parse({"query": "q", "texts": ["a"], "return_text": True})
    assert call.tei and call.return_documents
    assert parse({"query": "q", "documents": ["a"], "priority": 0}).lane == "default"  # Cohere's number
    assert parse({"query": "q", "documents": ["a"], "priority": "batch"}).lane == "batch"  # our lanes


@pytest.mark.parametrize("body, param", [
    ({"documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["a"] * 5}, "documents"),  # max_rerank_documents
    ({"query": "q", "documents": [3]}, "documents[0]"),
    ({"query": "q", "documents": [{"image": "i.png"}]}, "documents[0].text"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "rank_fields": [1]}, "rank_fields"),
])
def test_bad_bodies_name_their_field(body, param):
    with pytest.raises(InvalidRequestError) as e:
        parse(body)
    assert e.value.param == param


def test_layout_with_a_template_fills_both_fields_in_one_pass():
    layout = RerankFormat(template="<{query}|{document}>")
    (pair,) = rerank_pairs(CharTokens(), layout, "{document}", ["d"], 1000)  # type: ignore[arg-type]
    assert CharTokens().detokenize(pair) == "<{document}|d>"


def test_layout_without_a_template_and_the_bounds():
    layout = RerankFormat(prefix=(1,), middle=(2, 3), suffix=(2,))
    pairs = rerank_pairs(CharTokens(), layout, "q", ["ab", "c"], 1000)  # type: ignore[arg-type]
    assert pairs == [[1, ord("q"), 2, 3, ord("a"), ord("b"), 2], [1, ord("q"), 2, 3, ord("c"), 2]]
    cut = rerank_pairs(CharTokens(), layout, "q", ["abcdef"], 1000, max_tokens_per_doc=2)  # type: ignore[arg-type]
    assert cut == [[1, ord("q"), 2, 3, ord("a"), ord("b"), 2]]
    with pytest.raises(InvalidRequestError, match="max_rerank_tokens"):
        rerank_pairs(CharTokens(), layout, "q", ["ab", "c"], 12)  # type: ignore[arg-type]  # 7 + 6 tokens
