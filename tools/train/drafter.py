"""Train a DFlash block-diffusion drafter for a trained target (dflash.md §5), in plain torch.

Recipe: the target is frozen; the data are the target's own continuations (greedy and sampled) of
prompts cut from the training corpus, so the drafter learns the target's distribution; the features are
the outputs of the target layers `target_layer_ids` (HF `hidden_states[lid + 1]`, captured with forward
hooks), concatenated per token. Per sequence, random anchors `a` in the generated part each define a
block `[x_a, MASK x (B-1)]` at positions a..a+B-1 whose queries see the context features at positions
< a (strictly) and their own block (bidirectional in full-attention layers; causal + windowed in
sliding layers); slot k predicts x_{a+k} with cross-entropy weight exp(-(k-1)/gamma), normalised.
Embeddings and lm head are the target's (frozen); the drafter's hidden size is the target's.

`DFlashDraftModel.forward` computes exactly the function of the engine's `DFlashDrafter`
(services/engine/models/dflash.py): plain RMSNorm weights, per-head q/k norms, NeoX RoPE over the whole
head, context K/V from hidden_norm(fc(features)) through each layer's k_proj/v_proj (k_norm applied, no
input norm), final `norm`, then the target lm head. tests/test_train_smoke.py checks that.

Saved in the z-lab layout (config.json + model.safetensors), which `load_drafter` reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .common import Budget, StepPlanner, cosine_lr, log, sync

FULL, SLIDING = "full_attention", "sliding_attention"


# --------------------------------------------------------------------------------------------------
# config


@dataclass
class DraftSpec:
    """Drafter shape; hidden size and vocabulary come from the target."""

    num_hidden_layers: int = 2
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1152
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    n_features: int = 3                          # how many target layers feed the drafter
    target_layer_ids: list[int] | None = None    # None: dflash rule for n_features target layers
    layer_types: list[str] | None = None         # None: all full attention (non-causal in the block)
    sliding_window: int | None = None


def feature_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """z-lab's build_target_layer_ids rule applied to the feature count (evenly from layer 1 to n-3: [1, 3, 5]
    for 8 layers and 3 features); targets too shallow for it get evenly spaced distinct layers."""
    from services.engine.models.dflash import build_target_layer_ids

    ids = build_target_layer_ids(n_target_layers, n_features)
    if len(set(ids)) == len(ids) and all(0 <= i < n_target_layers for i in ids):
        return ids
    k = min(n_features, n_target_layers)
    return sorted({int(round(x)) for x in np.linspace(0, n_target_layers - 1, k)})


def hf_config(spec: DraftSpec, hidden_size: int, vocab_size: int, n_target_layers: int,
              mask_token_id: int) -> dict:
    """The z-lab config.json of a drafter."""
    types = spec.layer_types or [FULL] * spec.num_hidden_layers
    has_swa = SLIDING in types
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(spec.target_layer_ids)},
        "hidden_size": hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "layer_types": list(types),
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": vocab_size,
        "num_target_layers": n_target_layers,
        "sliding_window": spec.sliding_window if has_swa else None,
        "use_sliding_window": has_swa,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


# --------------------------------------------------------------------------------------------------
# model


class RMSNorm(nn.Module):
    """x / rms(x) * w with a plain weight (the engine's and z-lab's convention), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotary embedding over the whole head. x: (..., T, H, D) float32; pos: (..., T)."""
    D = x.shape[-1]
    half = D // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    ang = pos.float()[..., None] * inv_freq                     # (..., T, half)
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]  # (..., T, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, spec: DraftSpec):
        super().__init__()
        H, Hkv, D = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.k_proj = nn.Linear(hidden, Hkv * D, bias=False)
        self.v_proj = nn.Linear(hidden, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)
        self.q_norm = RMSNorm(D, spec.rms_norm_eps)
        self.k_norm = RMSNorm(D, spec.rms_norm_eps)
        self.theta = spec.rope_theta

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after k_norm + RoPE) and V of the projected context. ctx: (N, L, E)."""
        N, L, _ = ctx.shape
        k = rope_neox(self.k_norm(self.k_proj(ctx).view(N, L, self.Hkv, self.D)), pos, self.theta)
        return k, self.v_proj(ctx).view(N, L, self.Hkv, self.D).float()

    def forward(self, h: torch.Tensor, pos: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """h: (N, Q, E) normed block states; pos: (N, Q); visible: (N, Q, L + Q) bool."""
        N, Q, _ = h.shape
        q = rope_neox(self.q_norm(self.q_proj(h).view(N, Q, self.H, self.D)), pos, self.theta)
        k = rope_neox(self.k_norm(self.k_proj(h).view(N, Q, self.Hkv, self.D)), pos, self.theta)
        v = self.v_proj(h).view(N, Q, self.Hkv, self.D).float()
        keys = torch.cat([k_ctx, k], dim=1)
        vals = torch.cat([v_ctx, v], dim=1)
        g = self.H // self.Hkv
        if g > 1:   # query head h reads KV head h // g, as in the engine
            keys = keys.repeat_interleave(g, dim=2)
            vals = vals.repeat_interleave(g, dim=2)
        dt = torch.bfloat16 if torch.is_autocast_enabled() and h.is_cuda else torch.float32
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), keys.transpose(1, 2).to(dt),
                                           vals.transpose(1, 2).to(dt), attn_mask=visible[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(N, Q, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, spec: DraftSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.self_attn = Attention(hidden, spec)
        self.mlp = MLP(hidden, spec.intermediate_size)


class DFlashDraftModel(nn.Module):
    """Parameters named as z-lab's checkpoints (fc, hidden_norm, norm, layers.{i}.*); the target's token
    table and lm head are passed to forward, never owned."""

    def __init__(self, spec: DraftSpec, hidden: int):
        super().__init__()
        if not spec.target_layer_ids:
            raise ValueError("DraftSpec.target_layer_ids must be set")
        self.spec = spec
        self.hidden = hidden
        self.layer_causal = [t == SLIDING for t in (spec.layer_types or [FULL] * spec.num_hidden_layers)]
        self.fc = nn.Linear(len(spec.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(hidden, spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def visibility(self, anchors: torch.Tensor, L: int, causal: bool) -> torch.Tensor:
        """(N, m*B, L + m*B) bool: block b's slot j sees context p < a_b (within the window for sliding
        layers, per query) and its own block's slots (all of them, or those <= j when causal)."""
        N, m = anchors.shape
        B = self.spec.block_size
        dev = anchors.device
        a = anchors.repeat_interleave(B, dim=1)                             # (N, mB)
        j = torch.arange(B, device=dev).repeat(m)                           # slot of each query
        p = torch.arange(L, device=dev)
        ctx = p[None, None, :] < a[:, :, None]
        blk_id = torch.arange(m, device=dev).repeat_interleave(B)
        blk = blk_id[:, None] == blk_id[None, :]
        if causal:
            blk = blk & (j[None, :] <= j[:, None])
            if self.spec.sliding_window is not None:
                ctx = ctx & (p[None, None, :] >= (a + j[None, :] - (self.spec.sliding_window - 1))[:, :, None])
        return torch.cat([ctx, blk[None].expand(N, -1, -1)], dim=2)

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor,
                embed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states (N, m, B, E) of every block slot.

        features: (N, L, K*E) target features of positions 0..L-1; block_ids: (N, m, B) block tokens;
        anchors: (N, m) block start positions; embed: (V, E) the target's token table.
        """
        N, L, _ = features.shape
        m, B = anchors.shape[1], self.spec.block_size
        ctx = self.hidden_norm(self.fc(features))                           # (N, L, E)
        pos_ctx = torch.arange(L, device=features.device).expand(N, L)
        pos_q = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).reshape(N, m * B)
        x = F.embedding(block_ids.reshape(N, m * B), embed).float()
        vis = {c: self.visibility(anchors, L, c) for c in set(self.layer_causal)}
        for layer, causal in zip(self.layers, self.layer_causal):
            k_ctx, v_ctx = layer.self_attn.context_kv(ctx, pos_ctx)
            x = x + layer.self_attn(layer.input_layernorm(x), pos_q, k_ctx, v_ctx, vis[causal]).float()
            x = x + layer.mlp(layer.post_attention_layernorm(x)).float()
        return self.norm(x).view(N, m, B, self.hidden)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, B: int, mask_id: int):
    """Block ids (N, m, B) = [x_a, MASK...] and labels (N, m, B) = x_{a+k} (-100 past the end, and slot 0)."""
    N, L = tokens.shape
    idx = anchors[:, :, None] + torch.arange(B, device=tokens.device)     # (N, m, B)
    valid = idx < L
    labels = torch.gather(tokens, 1, idx.clamp(max=L - 1).reshape(N, -1)).view(idx.shape)
    labels = torch.where(valid, labels, torch.full_like(labels, -100))
    labels[:, :, 0] = -100
    ids = torch.full_like(labels, mask_id)
    ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    return ids, labels


def slot_weights(B: int, gamma: float, device) -> torch.Tensor:
    k = torch.arange(B, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor,
                gamma: float) -> tuple[torch.Tensor, dict]:
    """Weighted CE over slots 1..B-1 (weights exp(-(k-1)/gamma), normalised by the weights in play).

    Metrics: top-1 over supervised slots, and acc_len = 1 + mean over whole blocks (all slots inside the
    sequence) of the accepted run length: the per-anchor average with anchors uniform over positions.
    Decoding lands its blocks right after misses, so its per-step mean is lower (see `chain_walk`).
    """
    N, m, B, E = hidden.shape
    w = slot_weights(B, gamma, hidden.device)[None, None, :].expand(N, m, B)
    ok = labels >= 0
    wsel = w[ok]
    logits = (hidden[ok].to(lm_head.dtype) @ lm_head.t()).float()
    ce = F.cross_entropy(logits, labels[ok], reduction="none")
    loss = (ce * wsel).sum() / wsel.sum().clamp_min(1e-8)
    with torch.no_grad():
        pred_ok = logits.argmax(-1) == labels[ok]
        hit = torch.zeros(N, m, B, device=hidden.device, dtype=torch.bool)
        hit[ok] = pred_ok
        full = ok[:, :, 1:].all(-1)                                       # blocks entirely inside
        run = torch.cumprod(hit[:, :, 1:].float(), dim=-1).sum(-1)[full]
        acc = float(run.mean()) + 1.0 if run.numel() else float("nan")
        top1 = float(pred_ok.float().mean()) if pred_ok.numel() else float("nan")
    return loss, {"acc_len": acc, "top1": top1}


@torch.no_grad()
def chain_walk(drafter: DFlashDraftModel, tokens: torch.Tensor, feats: torch.Tensor, prompt_len: int,
               embed: torch.Tensor, lm_head: torch.Tensor, mask_id: int, amp: bool) -> list[int]:
    """Greedy chain decoding replayed on a greedy continuation: the drafts accepted at each verify step.

    Every block start in the generated part is drafted at once; then the walk starts at the prompt's end
    and jumps past each accepted run plus its bonus token, as speculative decoding would.
    """
    L = tokens.shape[0]
    B = drafter.spec.block_size
    starts = torch.arange(prompt_len, L - B + 1, device=tokens.device)
    if len(starts) == 0:
        return []
    ids, labels = block_inputs(tokens[None], starts[None], B, mask_id)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        h = drafter(feats[None], ids, starts[None], embed)[0]            # (m, B, E)
    pred = (h[:, 1:].to(lm_head.dtype) @ lm_head.t()).argmax(-1)        # (m, B-1)
    run = torch.cumprod((pred == labels[0, :, 1:]).float(), dim=-1).sum(-1).long().tolist()
    a, accepted = prompt_len, []
    while a - prompt_len < len(run):
        accepted.append(run[a - prompt_len])
        a += accepted[-1] + 1
    return accepted


# --------------------------------------------------------------------------------------------------
# target side: continuations and features


class FeatureHooks:
    """Forward hooks on the target's decoder layers capturing their outputs (= hidden_states[lid + 1])."""

    def __init__(self, model, layer_ids: list[int]):
        self.ids = list(layer_ids)
        self.out: dict[int, torch.Tensor] = {}
        layers = model.model.layers
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.ids]

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self.out[i] = out[0] if isinstance(out, (tuple, list)) else out
        return fn

    def features(self) -> torch.Tensor:
        return torch.cat([self.out[i] for i in self.ids], dim=-1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """(N, L, K*E) concatenated outputs of the target layers layer_ids for token ids (N, L)."""
    hooks = FeatureHooks(model, layer_ids)
    try:
        model.model(input_ids=ids, use_cache=False)
        return hooks.features()
    finally:
        hooks.close()


@torch.no_grad()
def continue_greedy_or_sampled(model, prompts: torch.Tensor, n_new: int, temperature: float,
                               gen: torch.Generator | None) -> torch.Tensor:
    """Extend prompts (N, P) by n_new tokens with the target's KV / recurrent cache (T=0: greedy)."""
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    cache, logits = out.past_key_values, out.logits[:, -1]
    toks = [prompts]
    for i in range(n_new):
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        toks.append(nxt)
        if i + 1 < n_new:
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat(toks, dim=1)


@dataclass
class DataConfig:
    seq_len: int = 512                   # prompt + continuation
    prompt_min: int = 64
    prompt_max: int = 256
    gen_batch: int = 2048               # decoding is latency-bound: wide batches are nearly free
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.8)   # cycled over generation batches
    seconds: float | None = 90.0         # generation budget (whole batches)
    max_seqs: int | None = None          # or a fixed number of sequences
    feature_batch: int = 64
    max_feature_gb: float | None = None  # features stay on the device; None: 45% of its memory, <= 40 GB
    # Compute the target features per training batch instead of caching them: the cache caps the data
    # at what fits in memory (~34k sequences in 40 GB), and a small drafter overfits that in minutes.
    features_on_the_fly: bool = False


class _FeatureFn:
    """Target features of a batch of token rows, computed when the batch is used (frozen target)."""

    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return target_features(self.model, tokens, self.layer_ids)


def batch_features(data: dict, rows: torch.Tensor) -> torch.Tensor:
    """The features of data rows `rows`: from the cache, or computed by the target now."""
    if data.get("features") is not None:
        return data["features"][rows]
    return data["feature_fn"](data["tokens"][rows])


def make_dataset(model, train_tokens: np.ndarray, layer_ids: list[int], dc: DataConfig, device: str,
                 seed: int) -> dict:
    """Continuations of random corpus prompts by the target, with their features.

    Returns tokens (N, L) int64, features (N, L, K*E) (bf16 on CUDA), prompt_len (N,), stats.
    """
    model.eval()
    rng = np.random.default_rng(seed + 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 2)
    budget = Budget(dc.seconds)
    E = model.config.hidden_size
    per_seq_bytes = dc.seq_len * len(layer_ids) * E * (2 if device.startswith("cuda") else 4)
    max_gb = dc.max_feature_gb
    if max_gb is None:
        max_gb = (min(40.0, 0.45 * torch.cuda.get_device_properties(device).total_memory / 1e9)
                  if device.startswith("cuda") else 4.0)
    cap = int(max_gb * 1e9 // per_seq_bytes) if not dc.features_on_the_fly else 10 ** 9
    if dc.max_seqs is not None:
        cap = min(cap, dc.max_seqs)
    toks, plens, temps, tcol = [], [], [], []
    n, b, last = 0, 0, 0.0
    t0 = time.perf_counter()
    while n < cap:
        # whole batches only: stop when the next one (timed like the last) would overrun the budget
        if dc.max_seqs is None and b > 0 and budget.left < last:
            break
        tb = time.perf_counter()
        P = int(rng.integers(dc.prompt_min, dc.prompt_max + 1))
        k = min(dc.gen_batch, cap - n)
        starts = rng.integers(0, len(train_tokens) - P, size=k)
        prompts = torch.from_numpy(np.stack([train_tokens[s:s + P] for s in starts]).astype(np.int64)).to(device)
        T = dc.temperatures[b % len(dc.temperatures)]
        seqs = continue_greedy_or_sampled(model, prompts, dc.seq_len - P, T, gen)
        toks.append(seqs)
        plens.append(torch.full((k,), P, dtype=torch.long, device=device))
        temps.append(T)
        tcol.append(torch.full((k,), T, dtype=torch.float32, device=device))
        n += k
        b += 1
        sync(device)
        last = time.perf_counter() - tb
        log(f"drafter data: batch {b} (P={P}, T={T}) {n} seqs, {last:.1f}s, "
            f"{k * (dc.seq_len - P) / last / 1e3:.1f}k generated tok/s")
    tokens = torch.cat(toks)
    if dc.features_on_the_fly:
        features = None
        feature_fn = _FeatureFn(model, layer_ids)
        shape = "computed per batch"
    else:
        feats = []
        for s in range(0, len(tokens), dc.feature_batch):
            feats.append(target_features(model, tokens[s:s + dc.feature_batch], layer_ids))
        features, feature_fn = torch.cat(feats), None
        shape = f"{tuple(features.shape)} {features.dtype}"
    sync(device)
    gen_s = time.perf_counter() - t0
    n_gen = int(sum((dc.seq_len - p) for p in torch.cat(plens).tolist()))
    log(f"drafter data: {len(tokens)} seqs x {dc.seq_len} ({n_gen / 1e6:.2f}M generated tokens), features "
        f"{shape}, {gen_s:.0f}s")
    return {"tokens": tokens, "features": features, "feature_fn": feature_fn,
            "prompt_len": torch.cat(plens), "temperature": torch.cat(tcol),
            "stats": {"seqs": len(tokens), "seq_len": dc.seq_len, "generated_tokens": n_gen,
                      "batches": b, "temperatures": temps, "seconds": round(gen_s, 1)}}


# --------------------------------------------------------------------------------------------------
# training


@dataclass
class DraftTrainConfig:
    batch_size: int = 32
    anchors: int = 64
    gamma: float = 7.0
    lr: float = 1e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seconds: float | None = 180.0
    steps: int | None = None
    calib_steps: int = 20
    eval_frac: float = 0.02            # sequences held out of drafter training for its metrics
    log_every: int = 50
    extra: dict = field(default_factory=dict)


def sample_anchors(prompt_len: torch.Tensor, L: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """m distinct sorted anchors per row, uniform over [prompt_len - 1, L - 2] (the generated part)."""
    N = prompt_len.shape[0]
    dev = prompt_len.device
    pos = torch.arange(L, device=dev)
    ok = (pos[None, :] >= (prompt_len[:, None] - 1)) & (pos[None, :] <= L - 2)
    score = torch.rand(N, L, device=dev, generator=gen)
    score = torch.where(ok, score, torch.full_like(score, -1.0))
    m = min(m, int(ok.sum(1).min()))
    return score.topk(m, dim=1).indices.sort(dim=1).values


def train_drafter(drafter: DFlashDraftModel, data: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                  mask_id: int, tc: DraftTrainConfig, device: str, seed: int) -> dict:
    drafter.to(device).train()
    tokens, plen = data["tokens"], data["prompt_len"]
    N, L = tokens.shape
    B = drafter.spec.block_size
    n_eval = max(1, int(round(N * tc.eval_frac))) if N > 1 else 0
    perm = torch.from_numpy(np.random.default_rng(seed + 3).permutation(N)).to(device)
    eval_idx, train_idx = perm[:n_eval], perm[n_eval:]
    if len(train_idx) == 0:
        train_idx = perm
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 4)
    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in drafter.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95),
                            fused=device.startswith("cuda"))
    amp = device.startswith("cuda")
    plan = StepPlanner(Budget(tc.seconds), tc.steps, first=3 + tc.calib_steps)
    warmup = tc.warmup_steps if tc.steps is None else min(tc.warmup_steps, max(1, tc.steps // 10))
    step, hist = 0, []
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M params, {len(train_idx)} train seqs ({n_eval} eval), batch "
        f"{tc.batch_size} x {tc.anchors} anchors x {B}, lr {tc.lr}, budget {tc.seconds}s")
    t0 = time.perf_counter()
    order = train_idx[torch.randperm(len(train_idx), generator=gen, device=device)]
    pos = 0
    while not plan.done(step):
        if pos + tc.batch_size > len(order):
            order, pos = train_idx[torch.randperm(len(train_idx), generator=gen, device=device)], 0
        rows = order[pos:pos + tc.batch_size]
        pos += tc.batch_size
        loss, met = _step_loss(drafter, tokens[rows], batch_features(data, rows), plen[rows], embed, lm_head,
                               mask_id, tc, gen, amp)
        lr = cosine_lr(step, plan.total or 10 ** 9, tc.lr, warmup, tc.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        if plan.after_step(step, device):
            warmup = min(warmup, max(1, plan.total // 10))
            log(f"drafter: {plan.ms_per_step:.1f} ms/step -> {plan.total} steps in the budget")
        if step % tc.log_every == 0 or step == 1:
            lv = float(loss.detach())
            hist.append((step, round(lv, 4), round(met["acc_len"], 3)))
            log(f"drafter: step {step}/{plan.total or '?'} loss {lv:.4f} block acc_len {met['acc_len']:.2f} "
                f"top1 {met['top1']:.3f} lr {lr:.2e} {plan.budget.elapsed:.0f}s "
                f"epoch {step * tc.batch_size / len(train_idx):.2f}")
    sync(device)
    train_s = time.perf_counter() - t0
    ev = evaluate_drafter(drafter, data, eval_idx if n_eval else train_idx[:8], embed, lm_head, mask_id, tc,
                          device, seed)
    log(f"drafter: {step} steps in {train_s:.0f}s; eval loss {ev['loss']:.4f} block acc_len {ev['acc_len']:.2f} "
        f"top1 {ev['top1']:.3f}; greedy chain replay: {ev['chain_acceptance_length']} tokens/step "
        f"({ev['chain_seqs']} seqs)")
    return {"steps": step, "train_seconds": round(train_s, 1), "history": hist, "eval": ev,
            "train_config": asdict(tc), "eval_seqs": int(n_eval)}


def _step_loss(drafter, tokens, feats, plen, embed, lm_head, mask_id, tc, gen, amp):
    L = tokens.shape[1]
    anchors = sample_anchors(plen, L, tc.anchors, gen)
    ids, labels = block_inputs(tokens, anchors, drafter.spec.block_size, mask_id)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        hidden = drafter(feats, ids, anchors, embed)
    return dflash_loss(hidden, labels, lm_head, tc.gamma)


@torch.no_grad()
def evaluate_drafter(drafter, data, idx, embed, lm_head, mask_id, tc, device, seed) -> dict:
    drafter.eval()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 5)
    tot = {"loss": 0.0, "acc_len": 0.0, "top1": 0.0}
    n = 0
    for s in range(0, len(idx), tc.batch_size):
        rows = idx[s:s + tc.batch_size]
        loss, met = _step_loss(drafter, data["tokens"][rows], batch_features(data, rows), data["prompt_len"][rows],
                               embed, lm_head, mask_id, tc, gen, device.startswith("cuda"))
        k = len(rows)
        tot["loss"] += float(loss) * k
        tot["acc_len"] += met["acc_len"] * k
        tot["top1"] += met["top1"] * k
        n += k
    out = {k: round(v / max(n, 1), 4) for k, v in tot.items()}
    # the decoding view on the greedy continuations among them
    steps = acc = 0
    greedy = [int(i) for i in idx.tolist() if float(data["temperature"][i]) <= 0][:256]
    for i in greedy:
        feats = batch_features(data, torch.tensor([i], device=data["tokens"].device))[0]
        walk = chain_walk(drafter, data["tokens"][i], feats, int(data["prompt_len"][i]), embed,
                          lm_head, mask_id, device.startswith("cuda"))
        steps, acc = steps + len(walk), acc + sum(walk)
    out["chain_acceptance_length"] = round((acc + steps) / steps, 4) if steps else None
    out["chain_seqs"] = len(greedy)
    drafter.train()
    return out


# --------------------------------------------------------------------------------------------------
# saving


def save_drafter(drafter: DFlashDraftModel, folder: str | Path, vocab_size: int, n_target_layers: int,
                 mask_token_id: int, dtype: str = "bfloat16") -> dict:
    """z-lab layout: config.json + model.safetensors (tensor names fc.weight, layers.{i}.*, ...)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    sd = {k: v.detach().to("cpu", dt).contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)
    cfg = hf_config(drafter.spec, drafter.hidden, vocab_size, n_target_layers, mask_token_id)
    cfg["torch_dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return cfg


def load_drafter_torch(folder: str | Path, device: str = "cpu") -> DFlashDraftModel:
    """The trained drafter back as a float32 torch module (for tests and tools)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    spec = DraftSpec(num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
                     num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                     intermediate_size=cfg["intermediate_size"], rope_theta=cfg["rope_theta"],
                     rms_norm_eps=cfg["rms_norm_eps"], block_size=cfg["block_size"],
                     n_features=len(cfg["dflash_config"]["target_layer_ids"]),
                     target_layer_ids=list(cfg["dflash_config"]["target_layer_ids"]),
                     layer_types=cfg.get("layer_types"), sliding_window=cfg.get("sliding_window"))
    model = DFlashDraftModel(spec, cfg["hidden_size"])
    sd = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    model.load_state_dict(sd, strict=True)
    return model.to(device).eval()


def param_count(drafter: nn.Module) -> int:
    return sum(p.numel() for p in drafter.parameters())
