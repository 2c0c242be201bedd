"""Train a small `qwen3_5` hybrid target (Gated DeltaNet + gated full attention) on the code corpus.

Plain transformers `Qwen3_5ForCausalLM` in float32 master weights, bf16 autocast on CUDA, AdamW with
linear warmup + cosine decay, packed sequences of the token stream (documents separated by
`<|endoftext|>`), a fixed seed and a deterministic data order. Training stops at a wall-clock budget:
after a few calibration steps the step time fixes the total step count the cosine schedule runs over
(`--steps` fixes it instead, for an exact rerun). Reports held-out loss, perplexity and bits per byte.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .common import Budget, StepPlanner, cosine_lr, log, sync


@dataclass
class TargetConfig:
    hidden_size: int = 384
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e6
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 1152
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6

    def hf_config(self, vocab_size: int, eos_ids: list[int] | None = None, pad_id: int | None = None):
        from transformers import Qwen3_5TextConfig

        n = self.num_hidden_layers
        types = ["linear_attention" if (i + 1) % self.full_attention_interval else "full_attention"
                 for i in range(n)]
        return Qwen3_5TextConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=n, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads, tie_word_embeddings=False, layer_types=types,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None, use_cache=False,
        )


@dataclass
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 128               # the pure-torch DeltaNet is launch-bound below ~64 sequences a step
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seconds: float | None = 300.0       # wall-clock budget of the training loop
    steps: int | None = None            # fixed step count (overrides the budget for the schedule)
    calib_steps: int = 20               # steps timed before the total is fixed
    eval_seqs: int = 256
    log_every: int = 50
    extra: dict = field(default_factory=dict)


def build_model(cfg: TargetConfig, vocab_size: int, seed: int, eos_ids=None, pad_id=None):
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg.hf_config(vocab_size, eos_ids, pad_id))
    return model.float()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _windows(tokens: np.ndarray, seq_len: int) -> int:
    return max(0, (len(tokens) - 1) // seq_len)


def _batch(tok_dev, starts, seq_len: int):
    import torch

    idx = starts[:, None] + torch.arange(seq_len + 1, device=tok_dev.device)[None, :]
    return tok_dev[idx].long()


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lm_loss(model, ids, device: str):
    """Mean next-token cross-entropy of a (B, T+1) batch."""
    import torch
    import torch.nn.functional as F

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def evaluate(model, tokens: np.ndarray, seq_len: int, device: str, max_seqs: int = 256,
             batch_size: int = 32) -> dict:
    """Held-out loss over the first max_seqs windows (a fixed set)."""
    import torch

    n = min(max_seqs, _windows(tokens, seq_len))
    if n == 0:
        raise ValueError(f"held-out set has fewer than {seq_len + 1} tokens")
    tok_dev = torch.from_numpy(tokens.astype(np.int32)).to(device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, n, batch_size):
            starts = torch.arange(s, min(n, s + batch_size), device=device) * seq_len
            ids = _batch(tok_dev, starts, seq_len)
            loss = lm_loss(model, ids, device)
            k = ids.shape[0] * seq_len
            total += float(loss) * k
            count += k
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count}


def train(model, train_tokens: np.ndarray, heldout_tokens: np.ndarray, tc: TrainConfig, device: str,
          seed: int, bytes_per_token: float | None = None) -> dict:
    """Train in place; returns stats (steps, tokens, losses, held-out metrics, timings)."""
    import torch

    model.to(device)
    model.train()
    S = tc.seq_len
    n_win = _windows(train_tokens, S)
    if n_win < tc.batch_size:
        raise ValueError(f"only {n_win} training windows of {S} tokens for batch size {tc.batch_size}")
    tok_dev = torch.from_numpy(train_tokens.astype(np.int32)).to(device)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_win)
    pos, epoch = 0, 0
    fused = device.startswith("cuda")
    opt = torch.optim.AdamW(_param_groups(model, tc.weight_decay), lr=tc.lr, betas=tc.betas, eps=1e-8,
                            fused=fused)
    plan = StepPlanner(Budget(tc.seconds), tc.steps, first=3 + tc.calib_steps)
    warmup = tc.warmup_steps if tc.steps is None else min(tc.warmup_steps, max(1, tc.steps // 10))
    hist: list[tuple[int, float]] = []
    step = 0
    log(f"target: {n_params(model) / 1e6:.2f}M params, {n_win} windows of {S} ({len(train_tokens) / 1e6:.1f}M "
        f"tokens), batch {tc.batch_size}, lr {tc.lr}, budget {tc.seconds}s, steps {tc.steps or 'by time'}")
    t_start = time.perf_counter()
    while not plan.done(step):
        if pos + tc.batch_size > n_win:
            order, pos, epoch = rng.permutation(n_win), 0, epoch + 1
        starts = torch.from_numpy(order[pos:pos + tc.batch_size] * S).to(device)
        pos += tc.batch_size
        ids = _batch(tok_dev, starts, S)
        lr = cosine_lr(step, plan.total or 10 ** 9, tc.lr, warmup, tc.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = lm_loss(model, ids, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        if plan.after_step(step, device):
            warmup = min(warmup, max(1, plan.total // 10))
            log(f"target: {plan.ms_per_step:.1f} ms/step ({tc.batch_size * S / plan.ms_per_step:.1f}k tok/s) -> "
                f"{plan.total} steps in the budget")
        if step % tc.log_every == 0 or step == 1:
            lv = float(loss.detach())
            hist.append((step, round(lv, 4)))
            log(f"target: step {step}/{plan.total or '?'} loss {lv:.4f} lr {lr:.2e} epoch {epoch} "
                f"{plan.budget.elapsed:.0f}s")
    sync(device)
    train_s = time.perf_counter() - t_start
    ev = evaluate(model, heldout_tokens, S, device, tc.eval_seqs)
    if bytes_per_token:
        ev["bits_per_byte"] = ev["loss"] / math.log(2) / bytes_per_token
    log(f"target: {step} steps in {train_s:.0f}s; held-out loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}"
        + (f" bpb {ev['bits_per_byte']:.3f}" if "bits_per_byte" in ev else ""))
    return {
        "params": n_params(model), "steps": step, "tokens_seen": step * tc.batch_size * S,
        "epochs": round(step * tc.batch_size / n_win, 3),
        "train_seconds": round(train_s, 1), "tokens_per_second": round(step * tc.batch_size * S / train_s),
        "loss_history": hist, "final_train_loss": hist[-1][1] if hist else None,
        "heldout": ev, "train_config": asdict(tc),
    }


def save_hf(model, folder: str | Path, tokenizer_folder: str | Path | None = None) -> None:
    """save_pretrained (float32 safetensors) + the tokenizer files beside it."""
    import shutil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.to("cpu").float().save_pretrained(folder, safe_serialization=True)
    if tokenizer_folder is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            src = Path(tokenizer_folder) / name
            if src.exists():
                shutil.copy(src, folder / name)


def load_gguf_target(path: str | Path, eos_ids=None, pad_id=None):
    """A trainable float32 `Qwen3_5ForCausalLM` with a shipped qwen35 GGUF's weights (dequantized).

    Returns (model, TargetConfig). Used to train a drafter for an existing target without retraining it
    (the weights are the GGUF's, e.g. Q8_0-rounded: exactly what the engine will serve) and to continue a
    target's training (`--init-target`: the config comes from the GGUF's metadata, not from TargetConfig()).
    """
    import torch

    from services.engine.config import config_from_gguf
    from services.engine.formats import open_model_file
    from services.engine.models.qwen35 import tensors_to_hf

    mf = open_model_file(str(path))
    mc = config_from_gguf(mf.metadata, path=str(path))
    if mc.arch != "qwen35":
        raise ValueError(f"{path}: training from a GGUF supports qwen35 targets, not {mc.arch}")
    every = list(mc.recurrent_layers).index(False) + 1 if False in mc.recurrent_layers else 0
    expected = [(i + 1) % every != 0 for i in range(mc.n_layer)]
    if not every or list(mc.recurrent_layers) != expected:
        raise ValueError(f"{path}: layer pattern {mc.recurrent_layers} is not 'full attention every {every}'")
    cfg = TargetConfig(
        hidden_size=mc.n_embd, num_hidden_layers=mc.n_layer, full_attention_interval=every,
        num_attention_heads=mc.n_head, num_key_value_heads=mc.n_head_kv, head_dim=mc.head_dim,
        partial_rotary_factor=mc.n_rot / mc.head_dim, rope_theta=mc.rope_theta,
        linear_num_key_heads=mc.ssm_n_k_heads, linear_num_value_heads=mc.ssm_n_v_heads,
        linear_key_head_dim=mc.ssm_head_k_dim, linear_value_head_dim=mc.ssm_head_v_dim,
        linear_conv_kernel_dim=mc.ssm_conv_kernel, intermediate_size=mc.n_ff,
        # GGUF stores float32: the shortest decimal of that float32 (1e-06) is the value the model was made with
        max_position_embeddings=mc.context_length, rms_norm_eps=float(str(np.float32(mc.rms_eps))),
    )
    model = build_model(cfg, mc.n_vocab, seed=0, eos_ids=eos_ids, pad_id=pad_id)
    state = tensors_to_hf(mc, {n: t.dequantize() for n, t in mf.tensors.items()})
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{path}: tensors do not match the rebuilt model (missing {missing[:4]}, extra {extra[:4]})")
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()})
    return model.float(), cfg

