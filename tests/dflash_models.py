"""Tiny random DFlash drafters (z-lab safetensors + config.json) and a tiny target to pair them with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from services.engine.config import ModelConfig
from services.engine.models.dflash import build_target_layer_ids
from services.engine.models.qwen3 import Qwen3Model

SLIDING, FULL = "sliding_attention", "full_attention"


def make_tiny_target(n_layer: int = 8, n_embd: int = 64, n_vocab: int = 320, seed: int = 0) -> Qwen3Model:
    """A random dense qwen3 target built in memory (no transformers import: the drafter only borrows its
    embedding table, lm head and config, so this is all the drafter tests need)."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(arch="qwen3", n_layer=n_layer, n_embd=n_embd, n_ff=96, n_vocab=n_vocab, n_head=4,
                      n_head_kv=2, head_dim=16, rope_theta=10000.0, context_length=512)

    def mat(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) * (0.5 / i ** 0.5)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": rng.standard_normal((n_vocab, n_embd)).astype(np.float32),
         "output.weight": mat(n_vocab, n_embd), "output_norm.weight": norm(n_embd)}
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for i in range(n_layer):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": norm(n_embd), p + "ffn_norm.weight": norm(n_embd),
                  p + "attn_q.weight": mat(q, n_embd), p + "attn_k.weight": mat(kv, n_embd),
                  p + "attn_v.weight": mat(kv, n_embd), p + "attn_output.weight": mat(n_embd, q),
                  p + "attn_q_norm.weight": norm(cfg.head_dim), p + "attn_k_norm.weight": norm(cfg.head_dim),
                  p + "ffn_gate.weight": mat(cfg.n_ff, n_embd), p + "ffn_up.weight": mat(cfg.n_ff, n_embd),
                  p + "ffn_down.weight": mat(n_embd, cfg.n_ff)})
    return Qwen3Model(cfg, t, source="<tiny target>")


def make_zlab_drafter(folder: str | Path, target_cfg: ModelConfig, n_layer: int = 2, block_size: int = 16,
                      layer_types: list[str] | None = None, target_layer_ids: list[int] | None = None,
                      seed: int = 0, mask_token_id: int | None = None, sliding_window: int | None = 2048,
                      n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 96,
                      hidden_size: int | None = None, rope_theta: float = 1e6, prefix: str = "",
                      **config_overrides: Any) -> Path:
    """Write a random z-lab-format drafter for `target_cfg` (config.json + model.safetensors); returns folder.

    Defaults follow the Qwen3.6 layout: sliding layers then one full layer last, block in config
    `dflash_config`, ids from z-lab's fallback rule, mask id = the target's last vocabulary row.
    `config_overrides` replace top-level config keys (a value of None deletes the key).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    E = hidden_size or target_cfg.n_embd
    if layer_types is None:
        layer_types = [SLIDING] * (n_layer - 1) + [FULL]
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(target_cfg.n_layer, n_layer)
    if mask_token_id is None:
        mask_token_id = target_cfg.n_vocab - 1
    has_swa = SLIDING in layer_types

    def mat(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) * (0.7 / i ** 0.5)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # Qwen3 RMSNorm weights are plain multipliers around 1; random so a +1 or a missing norm shows.
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    K = len(target_layer_ids)
    t = {"fc.weight": mat(E, K * E), "hidden_norm.weight": norm(E), "norm.weight": norm(E)}
    for i in range(n_layer):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(E), p + "post_attention_layernorm.weight": norm(E),
            p + "self_attn.q_proj.weight": mat(n_head * head_dim, E),
            p + "self_attn.k_proj.weight": mat(n_head_kv * head_dim, E),
            p + "self_attn.v_proj.weight": mat(n_head_kv * head_dim, E),
            p + "self_attn.o_proj.weight": mat(E, n_head * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": mat(n_ff, E), p + "mlp.up_proj.weight": mat(n_ff, E),
            p + "mlp.down_proj.weight": mat(E, n_ff),
        })
    save_file({prefix + k: v for k, v in t.items()}, str(folder / "model.safetensors"))

    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "hidden_size": E, "intermediate_size": n_ff, "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "num_key_value_heads": n_head_kv, "head_dim": head_dim,
        "num_target_layers": target_cfg.n_layer, "layer_types": list(layer_types),
        "sliding_window": sliding_window if has_swa else None, "use_sliding_window": has_swa,
        "max_window_layers": n_layer, "rope_theta": rope_theta, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "vocab_size": target_cfg.n_vocab, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 4096,
    }
    for k, v in config_overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder
