"""Qwen3.5 / Qwen3.6 hybrid decoder (llama.cpp arch `qwen35`).

Three of every four layers are Gated DeltaNet (causal conv + gated delta rule, a recurrent state per
value head); every `full_attention_interval`-th layer is gated full attention (query and output gate
interleaved per head in `attn_q`, q/k RMSNorm, partial NeoX RoPE). Weights follow llama.cpp's GGUF
conventions: norm weights carry the +1, `ssm_a = -exp(A_log)`, value heads in tiled order (value head h
pairs with key head h mod H_k).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import ModelConfig
from ..layers import (
    causal_conv,
    conv_window_ids,
    gated_delta_rule_chunked,
    gated_delta_rule_tree,
    gated_delta_rule_tree_wy,
    l2_norm,
    linear_rows,
    rms_norm,
    rope_neox,
    sigmoid,
    silu,
    softplus,
    swiglu_stacked,
)
from .base import StepContext, TargetModel

ARCH = "qwen35"
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_DELTANET = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_conv1d", "ssm_norm", "ssm_out")
_FFN = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")


class Qwen35Model(TargetModel):
    arch = ARCH

    def _load_layer(self, i: int) -> dict:
        p = f"blk.{i}."
        names = _DELTANET if self.cfg.recurrent_layers[i] else _ATTN
        w = {n: self._w(p + n + ".weight") for n in names + _FFN}
        stack = self.be.stack
        # Projections that read the same input are stacked: one product each instead of two to four.
        w["ffn_gate_up"] = stack([w.pop("ffn_gate"), w.pop("ffn_up")])
        if self.cfg.recurrent_layers[i]:
            w["ssm_a"] = self._w(p + "ssm_a")
            w["ssm_dt"] = self._w(p + "ssm_dt.bias")
            w["ssm_in"] = stack([w.pop(n) for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")])
        else:
            w["attn_qkv"] = stack([w.pop(n) for n in ("attn_q", "attn_k", "attn_v")])
        return w

    def _lin(self, x: np.ndarray, w) -> np.ndarray:
        """The backend's product, small token batches padded to a width BLAS runs fast (layers.padded_rows)."""
        return linear_rows(self.be.linear, x, w)

    def _block(self, i: int, w: dict, x: np.ndarray, ctx: StepContext) -> np.ndarray:
        h = rms_norm(x, w["attn_norm"], self.cfg.rms_eps)
        mixer = self._deltanet if self.cfg.recurrent_layers[i] else self._gated_attention
        x = x + mixer(i, w, h, ctx)
        h = rms_norm(x, w["post_attention_norm"], self.cfg.rms_eps)
        return x + swiglu_stacked(h, w["ffn_gate_up"], w["ffn_down"], self._lin)

    def _gated_attention(self, i: int, w: dict, h: np.ndarray, ctx: StepContext) -> np.ndarray:
        c, lin = self.cfg, self._lin
        T, H, D = h.shape[0], c.n_head, c.head_dim
        Hkv = c.n_head_kv
        qkv = lin(h, w["attn_qkv"])
        qg = qkv[:, :2 * H * D].reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = qkv[:, 2 * H * D:(2 * H + Hkv) * D].reshape(T, Hkv, D)
        v = qkv[:, (2 * H + Hkv) * D:].reshape(T, Hkv, D)
        q = rope_neox(rms_norm(q, w["attn_q_norm"], c.rms_eps), ctx.positions, c.n_rot, c.rope_theta)
        k = rope_neox(rms_norm(k, w["attn_k_norm"], c.rms_eps), ctx.positions, c.n_rot, c.rope_theta)
        o = self._kv_attention(i, q, k, v, ctx).reshape(T, H * D) * sigmoid(gate)
        return lin(o, w["attn_output"])

    def _deltanet(self, i: int, w: dict, h: np.ndarray, ctx: StepContext) -> np.ndarray:
        c, lin, st = self.cfg, self._lin, ctx.state
        T = h.shape[0]
        Hk, Hv, dk, dv = c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_head_k_dim, c.ssm_head_v_dim
        proj = lin(h, w["ssm_in"])                                # [qkv | z | beta | alpha]
        cd = c.ssm_conv_dim
        raw = np.ascontiguousarray(proj[:, :cd])                  # pre-conv rows: what the conv window keeps
        z = proj[:, cd:cd + Hv * dv].reshape(T, Hv, dv)
        beta = sigmoid(proj[:, cd + Hv * dv:cd + Hv * dv + Hv])
        g = w["ssm_a"] * softplus(proj[:, cd + Hv * dv + Hv:] + w["ssm_dt"])   # log-decay, <= 0

        ids = conv_window_ids(ctx.parents, c.ssm_conv_kernel)
        mixed = causal_conv(st.conv[i], raw, w["ssm_conv1d"], ids)
        kd = c.ssm_key_dim
        q = l2_norm(mixed[:, :kd].reshape(T, Hk, dk), 1e-6) * np.float32(dk ** -0.5)
        k = l2_norm(mixed[:, kd:2 * kd].reshape(T, Hk, dk), 1e-6)
        v = mixed[:, 2 * kd:].reshape(T, Hv, dv)
        tiled = np.arange(Hv) % Hk                                # value head h reads key head h mod H_k
        q, k = q[:, tiled], k[:, tiled]

        if T == 1:      # plain decode: one recurrent step
            o, states = gated_delta_rule_tree(q, k, v, g, beta, st.ssm[i], ctx.parents)
            states = states if ctx.checkpoints else states[-1]
        elif T <= 64 and (ctx.checkpoints or T <= 16):
            # a verify tree (or a short chain): one WY pass over ancestor masks, checkpoints on demand
            o, states = gated_delta_rule_tree_wy(q, k, v, g, beta, st.ssm[i], ctx.parents,
                                                 anc=ctx.visible[:, st.n_past:])
            states = states if ctx.checkpoints else states[T - 1]
        elif ctx.checkpoints:
            o, states = gated_delta_rule_tree(q, k, v, g, beta, st.ssm[i], ctx.parents)
        else:
            o, states = gated_delta_rule_chunked(q, k, v, g, beta, st.ssm[i])
        ctx.pending.ssm_states[i] = states
        ctx.pending.raw_rows[i] = raw

        o = rms_norm(o, w["ssm_norm"], c.rms_eps) * silu(z)
        return lin(o.reshape(T, Hv * dv), w["ssm_out"])


# -- Hugging Face checkpoints ---------------------------------------------------------------------

def config_from_hf(hf: dict) -> ModelConfig:
    from .hf_names import dense_hf_fields

    f = dense_hf_fields(hf, rope_theta=1e7, context_length=262144)
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    n_layer = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
    return ModelConfig(
        arch=ARCH,
        n_layer=n_layer,
        n_rot=int(f["head_dim"] * partial),
        recurrent_layers=[t == "linear_attention" for t in types],
        full_attention_interval=interval,
        ssm_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        ssm_head_k_dim=hf["linear_key_head_dim"],
        ssm_n_k_heads=hf["linear_num_key_heads"],
        ssm_n_v_heads=hf["linear_num_value_heads"],
        ssm_inner_size=hf["linear_value_head_dim"] * hf["linear_num_value_heads"],
        **f,
    )


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _tile_v_heads(a: np.ndarray, axis: int, n_k: int, n_v: int) -> np.ndarray:
    """Grouped value-head order [G0v0, G0v1, .., G1v0, ..] -> llama.cpp's tiled order [G0v0, G1v0, ..]."""
    a = np.moveaxis(a, axis, 0)
    r = n_v // n_k
    d = a.shape[0] // n_v
    t = a.reshape(n_k, r, d, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(t, 0, axis)


def tensors_from_hf(cfg: ModelConfig, hf: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors -> llama.cpp names and conventions (+1 norms, -exp(A_log), conv squeeze, tiled V heads)."""
    from .hf_names import map_hf_names

    out = map_hf_names(hf, _HF_LAYER_NAMES, cfg.n_layer)
    nk, nv, kd = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_key_dim
    for name in list(out):
        a = np.asarray(out[name], dtype=np.float32)
        if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
            a = a + 1.0                                    # HF norms are x * (1 + w)
        elif name.endswith(".ssm_a"):
            a = -np.exp(a)
        if nk != nv:
            if name.endswith(("attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", ".ssm_a", "ssm_dt.bias")):
                a = _tile_v_heads(a, 0, nk, nv)
            elif name.endswith("attn_qkv.weight"):
                a = np.concatenate([a[:2 * kd], _tile_v_heads(a[2 * kd:], 0, nk, nv)], axis=0)
            elif name.endswith("ssm_out.weight"):
                a = _tile_v_heads(a, 1, nk, nv)
        if name.endswith("ssm_conv1d.weight"):
            a = a.reshape(a.shape[0], a.shape[-1])         # [C, 1, K] -> [C, K]
            if nk != nv:
                a = np.concatenate([a[:2 * kd], _tile_v_heads(a[2 * kd:], 0, nk, nv)], axis=0)
        out[name] = a
    return out


def _untile_v_heads(a: np.ndarray, axis: int, n_k: int, n_v: int) -> np.ndarray:
    """Inverse of `_tile_v_heads`: llama.cpp's tiled value-head order back to HF's grouped order."""
    a = np.moveaxis(a, axis, 0)
    r = n_v // n_k
    d = a.shape[0] // n_v
    t = a.reshape(r, n_k, d, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(t, 0, axis)


def tensors_to_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp names and conventions -> a `Qwen3_5ForCausalLM` state dict (inverse of `tensors_from_hf`).

    Used to rebuild a trainable torch target from a shipped GGUF (e.g. to train a drafter for it).
    """
    to_hf = {v: k for k, v in _HF_LAYER_NAMES.items()}
    nk, nv, kd = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_key_dim
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        a = np.asarray(arr, dtype=np.float32)
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = a
            continue
        if name == "output_norm.weight":
            out["model.norm.weight"] = a - 1.0
            continue
        if name == "output.weight":
            out["lm_head.weight"] = a
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or parts[2] not in to_hf:
            raise ValueError(f"tensor '{name}' has no Hugging Face counterpart in a qwen35 model")
        short = parts[2]
        if short.endswith("norm.weight") and short != "ssm_norm.weight":
            a = a - 1.0
        elif short == "ssm_a":
            a = np.log(-a)
        if nk != nv:
            if short in ("attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
                a = _untile_v_heads(a, 0, nk, nv)
            elif short in ("attn_qkv.weight", "ssm_conv1d.weight"):
                a = np.concatenate([a[:2 * kd], _untile_v_heads(a[2 * kd:], 0, nk, nv)], axis=0)
            elif short == "ssm_out.weight":
                a = _untile_v_heads(a, 1, nk, nv)
        if short == "ssm_conv1d.weight":
            a = a.reshape(a.shape[0], 1, a.shape[-1])
        out[f"model.layers.{parts[1]}.{to_hf[short]}"] = a
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
