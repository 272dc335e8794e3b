"""A seeded LoRA adapter for SmolLM2-135M's attention matrices, for tests/model/test_lora.py (issue 45,
item 5).

No LoRA adapter GGUF can be fetched on these machines. This writes what llama.cpp's
convert_lora_to_gguf.py writes for a PEFT adapter: `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha`, and for each adapted weight `NAME.lora_a` (rank x in) and `NAME.lora_b`
(out x rank) in F32, here for every block's attn_q/k/v/output with seeded random values, shaped from
the base GGUF's own sizes. The values are large enough that greedy answers change (a trained
adapter's delta is smaller; what it says is beside the point, only that it is deterministic and
differs from the base model and from another seed's).

    python tests/lora_model.py OUT_DIR    # OUT_DIR/smollm2-lora-a.gguf, smollm2-lora-b.gguf (seeds 1, 2)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from builder_cli import run_builder

ADAPTER_NAMES = ("smollm2-lora-a.gguf", "smollm2-lora-b.gguf")
RANK = 8
ALPHA = 16.0  # llama.cpp scales the delta B @ A by alpha / rank (and the request's scale)
STD = 0.1


def attention_shapes(base: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """(the base GGUF's architecture, {tensor name: (in, out)} of its attention matrices), from its
    header's sizes: gguf.GGUFReader would parse the whole 49k-token vocabulary first (6 s here)."""
    from localserve.store.gguf_facts import read_gguf_facts

    facts = read_gguf_facts(base)
    head = facts.n_embd // facts.n_heads
    kv = facts.n_kv_heads * head
    widths = {"attn_q": facts.n_embd, "attn_k": kv, "attn_v": kv, "attn_output": facts.n_embd}
    return facts.architecture, {f"blk.{layer}.{name}.weight": (facts.n_embd, out)
                                for layer in range(facts.n_layers) for name, out in widths.items()}


def write_adapter(base: Path, out: Path, seed: int) -> Path:
    """`out`: a LoRA adapter GGUF for the model `base`, from `seed`."""
    import gguf

    arch, shapes = attention_shapes(base)
    writer = gguf.GGUFWriter(out, arch=arch)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    rng = np.random.default_rng(seed)
    for name, (n_in, n_out) in shapes.items():
        writer.add_tensor(f"{name}.lora_a", rng.normal(0, STD, (RANK, n_in)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", rng.normal(0, STD, (n_out, RANK)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str]) -> int:
    return run_builder(argv, __doc__, lambda smollm2, out_dir: [
        write_adapter(smollm2, out_dir / name, seed) for seed, name in enumerate(ADAPTER_NAMES, start=1)])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
