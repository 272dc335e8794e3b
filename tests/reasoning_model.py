"""SmolLM2 as a reasoning model, for tests/model/test_reasoning_budget.py (issue 45, item 3).

No reasoning GGUF small enough ships where these machines can reach it. SmolLM2 copied with a
Qwen3-like chat template makes every dialect treat it as one: the generation prompt opens
`<think>` (as DeepSeek-R1 distills' does), so the model starts inside its thinking, and
`enable_thinking=false` closes the block in the prompt (as Qwen3's does), so it answers at once.
SmolLM2 never writes `</think>` by itself and, greedy, writes on and on: the only end its thinking
gets is the one a budget forces, at exactly that many tokens. `<think>` and `</think>` are not
tokens of its vocabulary; their several tokens each are what the engine matches and forces.

    python tests/reasoning_model.py OUT_DIR    # writes OUT_DIR/smollm2-think.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

from builder_cli import run_builder

THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
FILE_NAME = "smollm2-think.gguf"


def with_think_template(gguf_path: Path, out: Path) -> Path:
    """`out`: the GGUF with THINK_TEMPLATE as its chat template, everything else unchanged."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(gguf_path, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    template = MetadataDetails(gguf.GGUFValueType.STRING, THINK_TEMPLATE)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: template}, [])
    return out


def main(argv: list[str]) -> int:
    return run_builder(argv, __doc__, lambda smollm2, out_dir: [with_think_template(smollm2, out_dir / FILE_NAME)])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
