"""`localserve add PATH --lora FILE` (issue 45, item 5): the adapters are registered in place with the
tag, in the order given (their ids), the manifest records them, `show` lists them with the setting
model_loras's after them; a file that is not a LoRA adapter, or a missing one, registers nothing."""

from __future__ import annotations

import hashlib
import json

from lora_model import ADAPTER_NAMES, write_adapter
from test_pull import run_cli


def test_add_with_lora_stores_the_adapters_and_show_lists_them(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    a, b = (write_adapter(smollm2_gguf, tmp_path / name, seed) for seed, name in enumerate(ADAPTER_NAMES, start=1))
    added = run_cli("add", str(smollm2_gguf), "--name", "tuned", "--lora", str(a), "--lora", str(b), home=home)
    assert added.returncode == 0, added.stderr
    assert f"LoRA adapter 0 -> {a}" in added.stdout and f"LoRA adapter 1 -> {b}" in added.stdout
    manifest = json.loads((home / "models" / "tuned" / "latest" / "manifest.json").read_text())
    assert manifest["loras"] == [{"file": str(p), "in_place": True, "size": p.stat().st_size,
                                  "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in (a, b)]
    extra = tmp_path / "extra.gguf"
    extra.write_bytes(a.read_bytes())
    shown = run_cli("show", "tuned", "--json", home=home, LOCALSERVE_MODEL_LORAS=f"tuned={extra}")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["loras"] == [str(a), str(b), str(extra)]
    table = run_cli("show", "tuned", home=home, COLUMNS="1000")  # paths unwrapped
    assert f"LoRA adapters     0: {a}; 1: {b}" in table.stdout
    # The model itself as an adapter, or a missing file: refused, nothing registered.
    refused = run_cli("add", str(smollm2_gguf), "--name", "odd", "--lora", str(smollm2_gguf), home=home)
    assert refused.returncode != 0 and "not a LoRA adapter" in refused.stderr
    missing = run_cli("add", str(smollm2_gguf), "--name", "gone", "--lora", str(tmp_path / "nope.gguf"), home=home)
    assert missing.returncode != 0 and "nope.gguf" in missing.stderr
    assert not (home / "models" / "odd").exists() and not (home / "models" / "gone").exists()
    bad = run_cli("show", "tuned", home=home, LOCALSERVE_MODEL_LORAS="tuned")
    assert bad.returncode == 2 and "NAME[:TAG]=FILE" in bad.stderr
