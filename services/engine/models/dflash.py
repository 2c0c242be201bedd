"""DFlash block-diffusion drafter (z-lab "DFlashDraftModel", DFlash v1).

A small Qwen3-style transformer with no embedding and no lm head of its own: it embeds its block with the
target's token table and projects its output with the target's lm head. What makes it a drafter is how
the target enters it: the outputs of a few target layers (`target_layer_ids`), concatenated per token,
are projected once (`ctx = hidden_norm(fc(features))`) and fed to every draft layer as extra keys and
values in front of the block ("KV injection"; ctx is not a query and not passed through the layer's
input norm). One forward pass over the block `[last_token, MASK * (B-1)]` drafts B-1 tokens at once.

Attention inside the block: full-attention layers are bidirectional (every block query sees all context
and all block keys); `sliding_attention` layers are causal inside the block and see only the context keys
within the window of their own query (SpecForge's per-query window: key k visible iff k >= q - (W-1)).

The context K/V (after k_norm and RoPE at the context positions) are cached per layer in a DraftSession.
The cache only grows by committed tokens, so speculative decoding never needs to roll it back; the block's
own K/V are computed each call and thrown away.

Checkpoints: z-lab safetensors + config.json, and the GGUF layouts `dflash-draft` (beellama/buun
converter, also what `export_drafter_gguf` writes) and `qwen35-dflash-draft` (Lucebox). Internally every
tensor goes by its `dflash-draft` GGUF name. Norm weights are plain multipliers (x_hat * w) in all three.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import NumpyBackend
from ..errors import DrafterMismatchError, ModelFormatError, UnsupportedModelError
from ..formats import KIND_GGUF, RawTensor, open_model_file
from ..gguf_write import OUT_TYPES, pick_type, write_gguf
from ..layers import linear_rows, masked_attention, rms_norm, rope_neox, swiglu_stacked
from .base import TargetModel

GGUF_ARCH = "dflash-draft"
LUCEBOX_ARCH = "qwen35-dflash-draft"
GGUF_ARCHES = (GGUF_ARCH, LUCEBOX_ARCH)
# Every public z-lab drafter ("-b16", Qwen3.5/3.6) uses 16; older configs may omit the key.
DEFAULT_BLOCK_SIZE = 16
# transformers' Qwen3Config default, i.e. what the HF reference runs when a config omits rope_theta.
DEFAULT_ROPE_THETA = 10000.0

SLIDING = "sliding_attention"

_LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
    "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down",
)
_GLOBAL_TENSORS = ("dflash_fc", "dflash_hidden_norm", "output_norm")

# z-lab (HF) name -> dflash-draft GGUF name
_HF_GLOBAL = {
    "fc.weight": "dflash_fc.weight",
    "hidden_norm.weight": "dflash_hidden_norm.weight",
    "norm.weight": "output_norm.weight",
}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# Lucebox qwen35-dflash-draft name -> dflash-draft name (the per-layer rest is shared)
_LUCEBOX_GLOBAL = {
    "dflash.fc.weight": "dflash_fc.weight",
    "dflash.hidden_norm.weight": "dflash_hidden_norm.weight",
}


@dataclass
class DrafterConfig:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    block_size: int                # 16
    mask_token_id: int
    target_layer_ids: list[int]
    # True: sliding_attention layer (causal inside the block, windowed context); False: full, non-causal
    layer_causal: list[bool] = field(default_factory=list)
    # context window of the sliding layers, per query: context key k visible iff k >= q_pos - (W-1)
    sliding_window: int | None = None
    n_vocab: int | None = None     # the drafter's config vocab_size, when the file says

    def __post_init__(self) -> None:
        if not self.layer_causal:
            self.layer_causal = [False] * self.n_layer
        if len(self.layer_causal) != self.n_layer:
            raise ValueError(f"layer_causal has {len(self.layer_causal)} entries for {self.n_layer} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the last token), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")

    @property
    def n_features(self) -> int:
        """Width of one token's concatenated target features (the fc input)."""
        return len(self.target_layer_ids) * self.n_embd


# --------------------------------------------------------------------------------------------------
# target layer ids


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's fallback when a config has no `dflash_config.target_layer_ids` (one id per draft layer).

    Python's round() on purpose: the reference uses it, and it decides the .5 cases.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def lucebox_target_layer_ids(num_target_layers: int, n_features: int) -> list[int]:
    """Lucebox's rule for GGUFs without ids: ids[k] = 1 + k * ((n_target_layers - 2) // (N - 1))."""
    if n_features == 1:
        return [num_target_layers // 2]   # the formula divides by N-1; use the reference's 1-layer choice
    step = (num_target_layers - 2) // (n_features - 1)
    return [1 + k * step for k in range(n_features)]


# --------------------------------------------------------------------------------------------------
# configs


def _need(cfg: Mapping[str, Any], key: str, path: str, where: str = "config key") -> Any:
    value = cfg.get(key)
    if value is None:
        raise ModelFormatError(path, f"{where} '{key}'", "it missing")
    return value


def _make_config(path: str, **kw: Any) -> DrafterConfig:
    try:
        return DrafterConfig(**kw)
    except ValueError as e:   # inconsistent values read from a file: the file is at fault, say which
        raise ModelFormatError(path, "a consistent DFlash drafter config", str(e)) from e


def _resolve_layer_causal(hf: Mapping[str, Any], n_layer: int, path: str) -> list[bool]:
    """vLLM's rule: a top-level `is_causal`, then `dflash_config.causal`, override every layer; else only
    `sliding_attention` layers are causal (every serving engine and SpecForge training agree on that)."""
    dfc = hf.get("dflash_config") or {}
    for override in (hf.get("is_causal"), dfc.get("causal")):
        if override is not None:
            return [bool(override)] * n_layer
    types = hf.get("layer_types")
    if not types:
        return [False] * n_layer
    if len(types) != n_layer:
        raise ModelFormatError(path, f"layer_types with {n_layer} entries (num_hidden_layers)",
                               f"{len(types)} entries")
    return [t == SLIDING for t in types]


def drafter_config_from_hf(cfg: dict, n_target_layer: int | None = None,
                           path: str = "<config.json>") -> DrafterConfig:
    """DrafterConfig from a z-lab drafter config.json.

    n_target_layer (the target's depth) is only used when the config has neither
    `dflash_config.target_layer_ids` nor `num_target_layers` to derive them from.
    """
    dfc = cfg.get("dflash_config") or {}
    n_layer = int(_need(cfg, "num_hidden_layers", path))
    n_embd = int(_need(cfg, "hidden_size", path))
    n_head = int(_need(cfg, "num_attention_heads", path))

    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"
    if rope_type != "default":
        # YaRN (some Qwen3.6 MoE drafters) rescales every frequency; running it as plain RoPE would draft
        # garbage silently, so refuse instead.
        raise UnsupportedModelError(
            f"{path}: drafter uses rope type '{rope_type}'; only plain RoPE is supported")
    theta = cfg.get("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))

    mask = dfc.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ModelFormatError(path, "config key 'dflash_config.mask_token_id'", "it missing")

    ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        n_t = dfc.get("num_target_layers", cfg.get("num_target_layers")) or n_target_layer
        if n_t is None:
            raise ModelFormatError(
                path, "config key 'dflash_config.target_layer_ids' (or 'num_target_layers' to derive them)",
                "neither")
        ids = build_target_layer_ids(int(n_t), n_layer)

    window = cfg.get("sliding_window")
    # transformers' Qwen3Config drops the window when use_sliding_window is false; an absent key keeps it
    # (engines read sliding_window directly).
    if cfg.get("use_sliding_window") is False or not window:
        window = None

    return _make_config(
        path,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(_need(cfg, "intermediate_size", path)),
        n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or n_embd // n_head),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        block_size=int(dfc.get("block_size", cfg.get("block_size", DEFAULT_BLOCK_SIZE))),
        mask_token_id=int(mask),
        target_layer_ids=[int(i) for i in ids],
        layer_causal=_resolve_layer_causal(cfg, n_layer, path),
        sliding_window=int(window) if window is not None else None,
        n_vocab=int(cfg["vocab_size"]) if cfg.get("vocab_size") else None,
    )


def _swa_pattern(pattern: Any, n_layer: int, path: str, key: str) -> list[bool]:
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < n_layer:
            raise ModelFormatError(path, f"'{key}' with one entry per layer ({n_layer})",
                                   f"{len(pattern)} entries")
        return [bool(x) for x in pattern[:n_layer]]
    # llama.cpp's integer form (set_swa_pattern): every n-th layer is dense, 0 means all sliding.
    n = int(pattern)
    return [n == 0 or (i % n < n - 1) for i in range(n_layer)]


def drafter_config_from_gguf(meta: dict, n_target_layer: int | None = None, n_features: int | None = None,
                             path: str = "<gguf>") -> DrafterConfig:
    """DrafterConfig from `dflash-draft` or `qwen35-dflash-draft` GGUF metadata.

    Lucebox files carry no target_layer_ids: they are derived from the target's depth (n_target_layer) and
    the feature count (`dflash.n_target_layers`, else `dflash.n_target_features` or n_features, the fc
    input width, divided by n_embd).
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHES:
        raise ModelFormatError(
            path, f"a DFlash drafter GGUF (general.architecture one of {list(GGUF_ARCHES)})",
            f"architecture {arch!r}")

    def g(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ModelFormatError(path, f"metadata key '{arch}.{key}'", "it missing")
        return value

    n_layer = int(g("block_count", required=True))
    n_embd = int(g("embedding_length", required=True))
    n_head = int(g("attention.head_count", required=True))
    n_head_kv = g("attention.head_count_kv", n_head)
    if isinstance(n_head_kv, (list, tuple)):
        n_head_kv = max(n_head_kv)

    ids = g("dflash.target_layer_ids")
    if ids is None:
        k = g("dflash.n_target_layers")
        width = g("dflash.n_target_features") or n_features
        if k is None and width:
            k = int(width) // n_embd
        if not k or n_target_layer is None:
            raise ModelFormatError(
                path, f"metadata key '{arch}.dflash.target_layer_ids'",
                "it missing (and no feature count plus target depth to derive it from)")
        ids = lucebox_target_layer_ids(int(n_target_layer), int(k))

    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(pattern_key)
    causal = [False] * n_layer if pattern is None else _swa_pattern(pattern, n_layer, path, pattern_key)
    window = g("attention.sliding_window")
    # `attention.causal = false` in these files describes the full layers; the pattern decides per layer.
    return _make_config(
        path,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(g("feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=int(n_head_kv),
        head_dim=int(g("attention.key_length") or n_embd // n_head),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", DEFAULT_ROPE_THETA)),
        block_size=int(g("dflash.block_size", DEFAULT_BLOCK_SIZE)),
        mask_token_id=int(g("dflash.mask_token_id", required=True)),
        target_layer_ids=[int(i) for i in ids],
        layer_causal=causal,
        sliding_window=int(window) if window else None,
        n_vocab=int(g("vocab_size")) if g("vocab_size") else None,
    )


def drafter_gguf_metadata(cfg: DrafterConfig) -> dict[str, Any]:
    """The `dflash-draft` metadata of `cfg`, as the beellama/buun converter writes it."""
    a = GGUF_ARCH
    meta: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.block_count": cfg.n_layer,
        f"{a}.embedding_length": cfg.n_embd,
        f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
        f"{a}.attention.causal": False,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.dimension_count": cfg.head_dim,
        f"{a}.dflash.block_size": cfg.block_size,
        f"{a}.dflash.mask_token_id": cfg.mask_token_id,
        f"{a}.dflash.target_layer_ids": list(cfg.target_layer_ids),
        f"{a}.dflash.n_target_features": cfg.n_features,
    }
    if any(cfg.layer_causal):
        meta[f"{a}.attention.sliding_window_pattern"] = [bool(c) for c in cfg.layer_causal]
    if cfg.sliding_window is not None:
        meta[f"{a}.attention.sliding_window"] = cfg.sliding_window
    if cfg.n_vocab is not None:
        meta[f"{a}.vocab_size"] = cfg.n_vocab
    return meta


# --------------------------------------------------------------------------------------------------
# tensor names


def canonical_tensor_names(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Rename z-lab (optionally `model.`-prefixed) and Lucebox tensor names to the dflash-draft GGUF names.

    Names already canonical pass through; anything unrecognised is kept as is (and ignored later).
    """
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        rest = name[len("model."):] if name.startswith("model.") else name
        new = _HF_GLOBAL.get(rest) or _LUCEBOX_GLOBAL.get(rest)
        m = _HF_LAYER_RE.match(rest)
        if new is None and m and m.group(2) in _HF_LAYER:
            new = f"blk.{m.group(1)}.{_HF_LAYER[m.group(2)]}"
        if new is None and rest.startswith("blk.") and rest.endswith(".ffn_norm.weight"):
            new = rest[: -len("ffn_norm.weight")] + "post_attention_norm.weight"
        out[new or name] = t
    return out


def _both_names(name: str) -> str:
    """'blk.1.ffn_up.weight' (z-lab: 'layers.1.mlp.up_proj.weight'), for messages about either format."""
    for hf, gg in _HF_GLOBAL.items():
        if gg == name:
            return f"'{name}' (z-lab: '{hf}')"
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if m:
        for hf, gg in _HF_LAYER.items():
            if gg == m.group(2):
                return f"'{name}' (z-lab: 'layers.{m.group(1)}.{hf}')"
    return f"'{name}'"


def _expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    E, D = cfg.n_embd, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "dflash_fc.weight": (E, cfg.n_features),
        "dflash_hidden_norm.weight": (E,),
        "output_norm.weight": (E,),
    }
    per_layer = {
        "attn_norm": (E,), "post_attention_norm": (E,),
        "attn_q": (cfg.n_head * D, E), "attn_k": (cfg.n_head_kv * D, E), "attn_v": (cfg.n_head_kv * D, E),
        "attn_output": (E, cfg.n_head * D), "attn_q_norm": (D,), "attn_k_norm": (D,),
        "ffn_gate": (cfg.n_ff, E), "ffn_up": (cfg.n_ff, E), "ffn_down": (E, cfg.n_ff),
    }
    for i in range(cfg.n_layer):
        for n, s in per_layer.items():
            shapes[f"blk.{i}.{n}.weight"] = s
    return shapes


# --------------------------------------------------------------------------------------------------
# the drafter


@dataclass
class DraftSession:
    """One request's draft cache: per layer, K (after k_norm + RoPE) and V of every committed context row.

    Rows [0, n_ctx) are valid (the rows after them are scratch: a block's own K/V while it is drafted); buffers grow
    by doubling so appending a few rows per step stays cheap.
    """

    k: list[np.ndarray]                # per layer (capacity, n_head_kv, head_dim)
    v: list[np.ndarray]
    n_ctx: int = 0
    xp: Any = np                       # array module of the backend (numpy; cupy on the GPU backend)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def _reserve(self, n: int) -> None:
        need = self.n_ctx + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, 64)
        for store in (self.k, self.v):
            for i, a in enumerate(store):
                grown = self.xp.empty((cap,) + a.shape[1:], dtype=a.dtype)
                grown[: self.n_ctx] = a[: self.n_ctx]
                store[i] = grown

    def truncate(self, n_ctx: int) -> None:
        """Forget context rows from n_ctx on (not needed by the normal loop; for error recovery)."""
        if not 0 <= n_ctx <= self.n_ctx:
            raise ValueError(f"cannot truncate a {self.n_ctx}-row draft context to {n_ctx}")
        self.n_ctx = n_ctx


class DFlashDrafter:
    """The drafter bound to its target: shares the target's token table and lm head, checks they fit."""

    def __init__(self, cfg: DrafterConfig, tensors: Mapping[str, RawTensor | np.ndarray], target: TargetModel,
                 backend: NumpyBackend | None = None, source: str = "<drafter>"):
        self.cfg = cfg
        self.target = target
        self.be = backend or target.be
        self.source = source
        self.target_layer_ids: list[int] = list(cfg.target_layer_ids)
        self.block_size: int = cfg.block_size
        self.mask_token_id: int = cfg.mask_token_id
        self._check_target()

        if cfg.n_head % cfg.n_head_kv:
            raise ModelFormatError(source, "attention heads divisible by KV heads",
                                   f"{cfg.n_head} heads, {cfg.n_head_kv} KV heads")
        t = canonical_tensor_names(tensors)
        fc = t.get("dflash_fc.weight")
        if fc is not None and len(fc.shape) == 2 and fc.shape[1] != cfg.n_features:
            # The usual cause is a config whose target_layer_ids do not match the trained fc, which is a
            # drafter/target pairing problem rather than a corrupt file.
            raise DrafterMismatchError(
                f"{source}: fc takes {fc.shape[1]} input features but {len(cfg.target_layer_ids)} target "
                f"layers {cfg.target_layer_ids} x hidden {cfg.n_embd} = {cfg.n_features}")
        for name, shape in _expected_shapes(cfg).items():
            if name not in t:
                raise ModelFormatError(source, f"tensor {_both_names(name)} (DFlash drafter)",
                                       f"it missing ({len(t)} tensors in the file)")
            got = tuple(int(d) for d in t[name].shape)
            if got != shape:
                raise ModelFormatError(source, f"tensor '{name}' of shape {list(shape)} (from the config)",
                                       f"shape {list(got)}")

        w = self.be.weight
        self.fc = w(t["dflash_fc.weight"])
        self.hidden_norm = w(t["dflash_hidden_norm.weight"])
        self.output_norm = w(t["output_norm.weight"])
        self.layers = [{n: w(t[f"blk.{i}.{n}.weight"]) for n in _LAYER_TENSORS} for i in range(cfg.n_layer)]
        for lw in self.layers:   # projections of one input stacked: one product each
            lw["attn_qkv"] = self.be.stack([lw.pop("attn_q"), lw["attn_k"], lw["attn_v"]])
            lw["attn_kv"] = self.be.stack([lw.pop("attn_k"), lw.pop("attn_v")])
            lw["ffn_gate_up"] = self.be.stack([lw.pop("ffn_gate"), lw.pop("ffn_up")])

    @property
    def n_vocab(self) -> int:
        return int(self.target.output.shape[0])

    def _check_target(self) -> None:
        c, tc = self.cfg, self.target.cfg
        if c.n_embd != tc.n_embd:
            raise DrafterMismatchError(
                f"{self.source}: drafter hidden size {c.n_embd} != target hidden size {tc.n_embd} "
                "(the drafter reuses the target's embedding and lm head)")
        bad = [i for i in c.target_layer_ids if not 0 <= i < tc.n_layer]
        if bad:
            raise DrafterMismatchError(
                f"{self.source}: drafter reads target layers {c.target_layer_ids} but the target has "
                f"{tc.n_layer} layers (0..{tc.n_layer - 1}); {bad} out of range")
        rows = int(self.target.tok_embd.shape[0])
        if not 0 <= c.mask_token_id < rows:
            raise DrafterMismatchError(
                f"{self.source}: drafter mask_token_id {c.mask_token_id} is outside the target's "
                f"{rows}-row embedding table")
        if c.n_vocab is not None and c.n_vocab != rows:
            raise DrafterMismatchError(
                f"{self.source}: drafter vocab_size {c.n_vocab} != target vocabulary {rows} rows "
                "(drafter trained for another model family?)")

    def _lin(self, x: np.ndarray, w):
        """The backend's product, small token batches padded to a width BLAS runs fast (layers.padded_rows)."""
        return linear_rows(self.be.linear, x, w)

    # -- context -------------------------------------------------------------------------------------
    def new_session(self) -> DraftSession:
        c = self.cfg
        xp = getattr(self.be, "xp", np)
        empty = [xp.zeros((0, c.n_head_kv, c.head_dim), np.float32) for _ in range(c.n_layer)]
        return DraftSession(k=empty, v=[a.copy() for a in empty], xp=xp)

    def append_context(self, session: DraftSession, features: np.ndarray | None, start: int) -> None:
        """Append the target features of committed tokens at session.n_ctx.. so that n_ctx becomes start.

        features: (n, K * n_embd), or (n, K, n_embd) as TargetModel.forward captures them, layers in
        target_layer_ids order.
        """
        c = self.cfg
        if features is None:
            feats = np.zeros((0, c.n_features), np.float32)
        else:
            feats = np.asarray(features, dtype=np.float32)
            if feats.ndim == 3:
                feats = feats.reshape(feats.shape[0], -1)
            if feats.ndim != 2 or feats.shape[1] != c.n_features:
                raise ValueError(
                    f"features must be (n, {c.n_features}) = (n, {len(c.target_layer_ids)} layers "
                    f"x {c.n_embd}), got shape {tuple(np.shape(features))}")
        n = feats.shape[0]
        if session.n_ctx + n != start:
            raise ValueError(f"draft context holds {session.n_ctx} tokens, {n} new feature rows would make "
                             f"{session.n_ctx + n}, but the block starts at position {start}")
        if n == 0:
            return
        session._reserve(n)
        lin, eps = self._lin, c.rms_eps
        pos = np.arange(session.n_ctx, start)
        ctx = rms_norm(lin(feats, self.fc), self.hidden_norm, eps)
        kd = c.n_head_kv * c.head_dim
        for i, w in enumerate(self.layers):
            kv = lin(ctx, w["attn_kv"])
            k = kv[:, :kd].reshape(n, c.n_head_kv, c.head_dim)
            k = rope_neox(rms_norm(k, w["attn_k_norm"], eps), pos, c.head_dim, c.rope_theta)
            session.k[i][session.n_ctx:start] = k
            session.v[i][session.n_ctx:start] = kv[:, kd:].reshape(n, c.n_head_kv, c.head_dim)
        session.n_ctx = start

    # -- block ---------------------------------------------------------------------------------------
    def _visible(self, causal: bool, T: int, start: int, lo: int) -> np.ndarray:
        """(T, (start - lo) + T) visibility of block queries over [context rows lo..start-1 ; block]."""
        n_ctx = start - lo
        if not causal:
            return np.ones((T, n_ctx + T), dtype=bool)
        q_pos = start + np.arange(T)
        ctx_ok = np.ones((T, n_ctx), dtype=bool)
        if self.cfg.sliding_window is not None:
            ctx_ok = np.arange(lo, start)[None, :] >= (q_pos - (self.cfg.sliding_window - 1))[:, None]
        return np.concatenate([ctx_ok, np.tril(np.ones((T, T), dtype=bool))], axis=1)

    def _block_hidden(self, session: DraftSession, ids: np.ndarray, start: int) -> np.ndarray:
        c, eps = self.cfg, self.cfg.rms_eps
        lin = self._lin
        if session.n_ctx != start:
            raise ValueError(f"the block must start right after the draft context ({session.n_ctx} tokens), "
                             f"not at position {start}")
        T = len(ids)
        H, Hkv, D = c.n_head, c.n_head_kv, c.head_dim
        pos = start + np.arange(T)
        # the block's own K/V go into the cache rows after the context (scratch: the next append overwrites them),
        # so attention reads one slice instead of a copy of the whole context per layer
        session._reserve(T)
        x = self.be.embed(self.target.tok_embd, ids)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], eps)
            qkv = lin(h, w["attn_qkv"])
            q = rope_neox(rms_norm(qkv[:, :H * D].reshape(T, H, D), w["attn_q_norm"], eps), pos, D, c.rope_theta)
            k = rope_neox(rms_norm(qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), w["attn_k_norm"], eps), pos, D,
                          c.rope_theta)
            v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
            causal = c.layer_causal[i]
            # A sliding layer's earliest query (slot 0) sees nothing before start-(W-1): skip older rows.
            lo = max(0, start - (c.sliding_window - 1)) if causal and c.sliding_window is not None else 0
            session.k[i][start:start + T] = k
            session.v[i][start:start + T] = v
            keys, vals = session.k[i][lo:start + T], session.v[i][lo:start + T]
            o = masked_attention(q, keys, vals, self._visible(causal, T, start, lo) if causal else None)
            x = x + lin(o.reshape(T, H * D), w["attn_output"])
            h = rms_norm(x, w["post_attention_norm"], eps)
            x = x + swiglu_stacked(h, w["ffn_gate_up"], w["ffn_down"], lin)
        return x

    def _logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return np.asarray(self.be.to_host(self._lin(h, self.target.output)), dtype=np.float32)

    def block_logits(self, session: DraftSession, ids: np.ndarray, start: int) -> np.ndarray:
        """Logits (len(ids), n_vocab) of every slot of any block at positions start.. (tests, tools)."""
        ids = self._check_ids(ids)
        return self._logits(self._block_hidden(session, ids, start))

    def _check_ids(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = int(self.target.tok_embd.shape[0])
        if len(ids) == 0 or ids.min() < 0 or ids.max() >= rows:
            raise ValueError(f"block token ids must be in [0, {rows}) and non-empty")
        return ids

    def draft(self, session: DraftSession, new_features: np.ndarray | None, last_token: int,
              start: int) -> np.ndarray:
        """Append the newly committed tokens' features, then draft one block in one forward pass.

        new_features: target features of the tokens at session.n_ctx .. start-1 (None when there are
        none); last_token: the token at `start` (the bonus token, not yet in the context).
        Returns float32 logits (block_size - 1, n_vocab) for positions start+1 .. start+block_size-1.
        """
        self.append_context(session, new_features, start)
        ids = np.full(self.block_size, self.mask_token_id, dtype=np.int64)
        ids[0] = last_token
        ids = self._check_ids(ids)
        x = self._block_hidden(session, ids, start)
        return self._logits(x[1:])   # slot 0 is the known token; its output is never used


# --------------------------------------------------------------------------------------------------
# loading and export


def load_drafter(path: str, target: TargetModel, backend: NumpyBackend | None = None) -> DFlashDrafter:
    """Load a drafter (z-lab safetensors folder, dflash-draft or qwen35-dflash-draft GGUF) for `target`.

    The format is decided by the file contents, not the name.
    """
    cfg, tensors, source = read_drafter(path, target.cfg.n_layer)
    return DFlashDrafter(cfg, tensors, target, backend, source=source)


def read_drafter(path: str, n_target_layer: int) -> tuple[DrafterConfig, dict[str, Any], str]:
    """(config, tensors by canonical name, resolved path) of a drafter file, for any backend's drafter class."""
    mf = open_model_file(path)
    tensors = canonical_tensor_names(mf.tensors)
    if mf.kind == KIND_GGUF:
        fc = tensors.get("dflash_fc.weight")
        cfg = drafter_config_from_gguf(mf.metadata, n_target_layer=n_target_layer,
                                       n_features=fc.shape[1] if fc is not None else None, path=mf.path)
    else:
        meta = mf.metadata
        is_drafter = "dflash_fc.weight" in tensors or "dflash_config" in meta or \
            "DFlashDraftModel" in (meta.get("architectures") or [])
        if not is_drafter:
            found = (f"model_type {meta.get('model_type')!r} with no 'fc.weight' tensor (a target model?)"
                     if meta else "safetensors with no 'fc.weight' tensor and no config.json")
            raise ModelFormatError(
                mf.path, "a DFlash drafter (config.json with dflash_config, tensor 'fc.weight')", found)
        if not meta:
            raise ModelFormatError(mf.path, "a config.json beside the drafter's safetensors", "none")
        cfg = drafter_config_from_hf(meta, n_target_layer=n_target_layer, path=mf.path)
    return cfg, tensors, mf.path


def export_drafter_gguf(cfg: DrafterConfig, tensors_hf: Mapping[str, np.ndarray | RawTensor],
                        out_path: str | os.PathLike[str], out_type: str = "f32") -> None:
    """Write a `dflash-draft` GGUF (beellama/buun layout) from z-lab tensors (any accepted naming).

    Norms stay F32; matrices take out_type ("f32", "f16", "bf16", "q8_0", "q4_0"), falling back to F16
    where a row length does not fit the quant block.
    """
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {sorted(OUT_TYPES)}, got {out_type!r}")
    qtype = OUT_TYPES[out_type]
    t = canonical_tensor_names(tensors_hf)
    out: dict[str, tuple[np.ndarray, int]] = {}
    for name, shape in _expected_shapes(cfg).items():
        if name not in t:
            raise ModelFormatError(str(out_path), f"tensor {_both_names(name)} to export", "it missing")
        src = t[name]
        arr = np.asarray(src.dequantize() if isinstance(src, RawTensor) else src, dtype=np.float32)
        if arr.shape != shape:
            raise ModelFormatError(str(out_path), f"tensor '{name}' of shape {list(shape)}",
                                   f"shape {list(arr.shape)}")
        out[name] = (arr, pick_type(name, arr, qtype))
    write_gguf(out_path, drafter_gguf_metadata(cfg), out)


def convert_drafter_to_gguf(src: str, out_path: str, out_type: str = "f16",
                            n_target_layer: int | None = None) -> DrafterConfig:
    """z-lab safetensors folder -> dflash-draft GGUF; returns the config written."""
    mf = open_model_file(src)
    if mf.kind == KIND_GGUF:
        raise ModelFormatError(mf.path, "a z-lab safetensors drafter folder",
                               "a GGUF file (already converted)")
    if not mf.metadata:
        raise ModelFormatError(mf.path, "a config.json beside the drafter's safetensors", "none")
    cfg = drafter_config_from_hf(mf.metadata, n_target_layer=n_target_layer, path=mf.path)
    export_drafter_gguf(cfg, mf.tensors, out_path, out_type)
    return cfg
