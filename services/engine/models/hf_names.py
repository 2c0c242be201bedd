"""Renaming Hugging Face checkpoint tensors to llama.cpp's GGUF names (shared by the architecture files)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
}
# Multimodal Qwen3.5/3.6 checkpoints nest the text model under model.language_model.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")


def map_hf_names(hf: Mapping[str, np.ndarray], layer_names: dict[str, str], n_layer: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    layer_re = re.compile(r"^layers\.(\d+)\.(.+)$")
    for name, arr in hf.items():
        if name == "lm_head.weight":
            out["output.weight"] = arr
            continue
        if name.startswith(("mtp.", "model.visual.", "visual.")):
            continue
        rest = None
        for p in _PREFIXES:
            if name.startswith(p):
                rest = name[len(p):]
                break
        if rest in _GLOBAL:
            out[_GLOBAL[rest]] = arr
            continue
        m = layer_re.match(rest or "")
        if m and int(m.group(1)) < n_layer and m.group(2) in layer_names:
            out[f"blk.{m.group(1)}.{layer_names[m.group(2)]}"] = arr
    return out


def hf_text_config(hf_config: dict) -> dict:
    """The text part of a (possibly multimodal) HF config."""
    return hf_config.get("text_config") or hf_config


def dense_hf_fields(hf: dict, rope_theta: float, context_length: int) -> dict:
    """ModelConfig fields every Qwen-style HF config spells the same way (defaults per architecture)."""
    rope = hf.get("rope_parameters") or {}
    return dict(
        n_embd=hf["hidden_size"],
        n_ff=hf["intermediate_size"],
        n_vocab=hf["vocab_size"],
        n_head=hf["num_attention_heads"],
        n_head_kv=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", rope_theta)),
        context_length=hf.get("max_position_embeddings", context_length),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
