"""Qwen3 dense decoder (llama.cpp arch `qwen3`): pre-norm blocks, q/k RMSNorm, full NeoX RoPE, SwiGLU."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import ModelConfig
from ..layers import rms_norm, rope_neox, swiglu
from .base import StepContext, TargetModel

ARCH = "qwen3"
HF_MODEL_TYPES = ("qwen3",)


class Qwen3Model(TargetModel):
    arch = ARCH

    def _load_layer(self, i: int) -> dict:
        p = f"blk.{i}."
        return {name: self._w(p + name + ".weight") for name in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}

    def _block(self, i: int, w: dict, x: np.ndarray, ctx: StepContext) -> np.ndarray:
        c, lin = self.cfg, self.be.linear
        T = x.shape[0]
        h = rms_norm(x, w["attn_norm"], c.rms_eps)
        q = lin(h, w["attn_q"]).reshape(T, c.n_head, c.head_dim)
        k = lin(h, w["attn_k"]).reshape(T, c.n_head_kv, c.head_dim)
        v = lin(h, w["attn_v"]).reshape(T, c.n_head_kv, c.head_dim)
        q = rope_neox(rms_norm(q, w["attn_q_norm"], c.rms_eps), ctx.positions, c.n_rot, c.rope_theta)
        k = rope_neox(rms_norm(k, w["attn_k_norm"], c.rms_eps), ctx.positions, c.n_rot, c.rope_theta)
        o = self._kv_attention(i, q, k, v, ctx).reshape(T, -1)
        x = x + lin(o, w["attn_output"])
        h = rms_norm(x, w["ffn_norm"], c.rms_eps)
        return x + swiglu(h, w["ffn_gate"], w["ffn_up"], w["ffn_down"], lin)


# -- Hugging Face checkpoints ---------------------------------------------------------------------

def config_from_hf(hf: dict) -> ModelConfig:
    from .hf_names import dense_hf_fields

    f = dense_hf_fields(hf, rope_theta=1e6, context_length=32768)
    return ModelConfig(arch=ARCH, n_layer=hf["num_hidden_layers"], n_rot=f["head_dim"], **f)


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tensors_from_hf(cfg: ModelConfig, hf: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensor names -> llama.cpp names (Qwen3 needs no value transformations)."""
    from .hf_names import map_hf_names

    return map_hf_names(hf, _HF_LAYER_NAMES, cfg.n_layer)
