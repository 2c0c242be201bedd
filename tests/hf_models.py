"""Tiny random Hugging Face models (written with transformers on CPU torch) used as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QWEN3_CFG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False,
)

QWEN35_CFG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def make_hf_model(kind: str, folder: Path, seed: int = 0, **overrides):
    """Build a random tiny `qwen3` or `qwen3_5` causal LM, save it (safetensors + config.json), return it."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3":
        cfg = Qwen3Config(**{**QWEN3_CFG, **overrides})
        model = Qwen3ForCausalLM(cfg)
    elif kind == "qwen35":
        cfg = Qwen3_5TextConfig(**{**QWEN35_CFG, **overrides})
        model = Qwen3_5ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random values everywhere, norms and gates included, so a wrong +1 or a swapped head order shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if kind == "qwen3" or "linear_attn.norm" in name else 0.0))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.1))
    model.eval()
    model.float()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_hidden_states(model, ids) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=False, output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


def write_config(folder: Path, **cfg) -> None:
    (folder / "config.json").write_text(json.dumps(cfg))


def make_gguf_model(kind: str, folder: Path, seed: int = 0, **overrides) -> str:
    """A tiny random model (make_hf_model) converted to an f32 GGUF in `folder`; its path."""
    from services.engine.convert import convert_hf_to_gguf

    make_hf_model(kind, folder / "hf", seed=seed, **overrides)
    convert_hf_to_gguf(str(folder / "hf"), str(folder / "t.gguf"), "f32")
    return str(folder / "t.gguf")
