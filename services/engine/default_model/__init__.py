"""The embedded default model: a small qwen35 code model and its DFlash drafter, trained by tools/train.

Files live beside this module: target.gguf, drafter/ (z-lab layout), drafter.gguf, MODEL_CARD.md,
SHA256SUMS and heldout_prompts.jsonl (held-out code prompts for benchmarks).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import SpecsplitError

HERE = Path(__file__).resolve().parent


def default_model_paths() -> tuple[str, str]:
    """(target GGUF, drafter folder) of the shipped pair; a clear error if this install lacks them."""
    target, drafter = HERE / "target.gguf", HERE / "drafter"
    if not target.exists() or not (drafter / "model.safetensors").exists():
        raise SpecsplitError(f"no embedded default model in {HERE}; pass --model (and --draft) explicitly")
    return str(target), str(drafter)


def heldout_prompts() -> list[str]:
    path = HERE / "heldout_prompts.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def verify_checksums() -> dict[str, bool]:
    """Recompute the SHA-256 of every file listed in SHA256SUMS."""
    out = {}
    for line in (HERE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        name = name.lstrip("*")
        h = hashlib.sha256((HERE / name).read_bytes()).hexdigest()
        out[name] = h == digest
    return out
