"""Synthetic models for benchmarks: GGUFs with a real model's shapes, tensor types and metadata but random
(valid) quantized weights, plus the matching DFlash drafter; written streaming, so a 16.5 GB file never sits in RAM.

Tensor types follow llama.cpp's Q4_K_M mix (`src/llama-quant.cpp`, as the peer baseline's synthetic file; `--quant
q5_k_m`: its Q5_K_M mix, the same with Q5_K for Q4_K; `--quant iq4_xs` / `q4_0` / `iq4_nl` / `q3_k_m`: the same with
IQ4_XS / Q4_0 / IQ4_NL / Q3_K for Q4_K, see QUANT_MIXES for where llama.cpp's own mixes of those differ):
every 2-D weight is Q4_K, except `output.weight` (Q6_K) and, on the "more bits" layers (the first eighth,
the last eighth and every third layer in between: `use_more_bits`), `attn_v` / `attn_qkv` (counted
together, one per layer) and `ffn_down` (Q6_K). `token_embd` stays Q4_K (the model is untied). Norms,
`ssm_a`, `ssm_dt.bias` and `ssm_conv1d` are F32. A row length that is not a multiple of 256 cannot hold a
k-quant: llama.cpp then falls back to Q5_0 (Q4_K) / Q8_0 (Q6_K); specsplit reads no Q5_0, so both fall
back to Q8_0 here (no real Qwen3.6 shape needs it). For Qwen3.6-27B the byte totals equal the peer's file:
Q4_K 12,076,646,400 + Q6_K 4,449,177,600 + F32 10,582,016 = 16,536,406,016 bytes in 851 tensors.

Weights: quant blocks are random codes with controlled fp16 scales (no quantizer runs), zero-mean, with a
standard deviation of 1/sqrt(fan_in), so activations stay O(1) through any depth (every block input is
RMS-normalised). Norm weights are 1, `ssm_a` = -U(1, 16) and `ssm_dt.bias` = softplus^-1(U(1e-3, 1e-1)
log-uniform), as the HF initialisers of Gated DeltaNet. The tokenizer is a synthetic byte-level BPE of the
real vocabulary size (256 bytes + generated merges + ChatML specials + unused padding rows); general.name
and general.description say the file is synthetic.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import gguf
import numpy as np

from .config import ModelConfig, gguf_metadata
from .errors import SpecsplitError
from .gguf_write import _value_type
from .models.dflash import DrafterConfig, drafter_gguf_metadata
from .tokenizer import _BYTE_TO_CHAR, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED

Q = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT     # 32, so general.alignment is not written
CHUNK_BYTES = 64 << 20                      # bytes of one tensor generated and written at a time
FILE_TYPE_Q4_K_M = 15                       # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
FILE_TYPE_Q5_K_M = 17                       # LLAMA_FTYPE_MOSTLY_Q5_K_M
FILE_TYPE_IQ4_XS = 30                       # LLAMA_FTYPE_MOSTLY_IQ4_XS
FILE_TYPE_Q3_K_M = 12                       # LLAMA_FTYPE_MOSTLY_Q3_K_M
FILE_TYPE_Q4_0 = 2                          # LLAMA_FTYPE_MOSTLY_Q4_0
FILE_TYPE_IQ4_NL = 25                       # LLAMA_FTYPE_MOSTLY_IQ4_NL
DISK_MARGIN = 64 << 20                      # free space kept beyond the files (metadata, filesystem slack)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
            "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
            "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")


# --------------------------------------------------------------------------------------------------
# shapes


@dataclass
class SyntheticShape:
    """A target config, where its specials start in the vocabulary, and its drafter's config."""

    target: ModelConfig
    drafter: DrafterConfig
    first_special: int          # id of <|endoftext|>; regular (byte + merge) tokens come before it
    rope_sections: list[int] = field(default_factory=list)
    size_label: str = ""
    type_layers: int = 0        # layer count the Q4_K_M type rule sees (the real model's, also under --layers)


def _qwen36_27b() -> SyntheticShape:
    n_layer = 64
    target = ModelConfig(
        arch="qwen35", n_layer=n_layer, n_embd=5120, n_ff=17408, n_vocab=248320, n_head=24, n_head_kv=4,
        head_dim=256, rms_eps=1e-6, rope_theta=1e7, n_rot=64, context_length=262144,
        recurrent_layers=[(i + 1) % 4 != 0 for i in range(n_layer)], full_attention_interval=4,
        ssm_conv_kernel=4, ssm_head_k_dim=128, ssm_n_k_heads=16, ssm_n_v_heads=48, ssm_inner_size=6144,
        name="Qwen3.6-27B (synthetic)")
    # z-lab Qwen3.6-27B-DFlash (SpecForge configs/qwen3.6-27b-dflash.json): 4 sliding layers + 1 full
    drafter = DrafterConfig(
        n_layer=5, n_embd=5120, n_ff=17408, n_head=32, n_head_kv=8, head_dim=128, rms_eps=1e-6,
        rope_theta=1e7, block_size=16, mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61],
        layer_causal=[True, True, True, True, False], sliding_window=2048, n_vocab=248320)
    return SyntheticShape(target, drafter, first_special=248044, rope_sections=[11, 11, 10, 0], size_label="27B",
                          type_layers=n_layer)


def _tiny() -> SyntheticShape:
    # Every row length a multiple of 256, so the tiny file takes exactly the 27B's type choices.
    n_layer = 4
    target = ModelConfig(
        arch="qwen35", n_layer=n_layer, n_embd=256, n_ff=512, n_vocab=512, n_head=2, n_head_kv=1,
        head_dim=128, rms_eps=1e-6, rope_theta=1e7, n_rot=32, context_length=4096,
        recurrent_layers=[(i + 1) % 4 != 0 for i in range(n_layer)], full_attention_interval=4,
        ssm_conv_kernel=4, ssm_head_k_dim=64, ssm_n_k_heads=2, ssm_n_v_heads=4, ssm_inner_size=256,
        name="specsplit tiny qwen35 (synthetic)")
    drafter = DrafterConfig(
        n_layer=2, n_embd=256, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, rms_eps=1e-6, rope_theta=1e7,
        block_size=16, mask_token_id=500, target_layer_ids=[1, 3], layer_causal=[True, False],
        sliding_window=64, n_vocab=512)
    return SyntheticShape(target, drafter, first_special=472, rope_sections=[6, 5, 5, 0], size_label="tiny",
                          type_layers=n_layer)


SHAPES: dict[str, Callable[[], SyntheticShape]] = {"qwen3.6-27b": _qwen36_27b, "tiny": _tiny}
# --quant: (the base matrix type, the "more bits" / LM head type, llama_ftype). iq4_xs is Q4_K_M's mix with IQ4_XS for
# Q4_K (llama.cpp's own IQ4_XS mix differs in which tensors it raises): a file of its bytes and its decoding work.
# q3_k_m likewise with Q3_K: the LM head Q6_K and token_embd Q3_K as llama.cpp's Q3_K_M, but where it raises every
# attn_v / attn_qkv (the first two Q5_K, the rest Q4_K), every ffn_down (Q5_K in the first n_layer / 16 layers, Q4_K
# after) and attn_output to Q4_K, this raises the "more bits" layers' attn_v / attn_qkv and ffn_down to Q6_K and leaves
# the rest Q3_K: the 27B 13.68 GB against llama.cpp's 13.29 GB, 9.2 GB of it Q3_K against 7.2
# q4_0 and iq4_nl likewise. llama.cpp's MOSTLY_Q4_0 (llama_tensor_get_type) raises the LM head alone (Q6_K; without
# an imatrix nothing else), so its more-bits layers' attn_v / attn_qkv / ffn_down stay Q4_0 where this form gives
# them Q6_K. MOSTLY_IQ4_NL raises the LM head (Q6_K), attn_v / attn_qkv on every layer to Q5_K (n_gqa >= 4: the 27B's
# 6) and ffn_down on the first eighth to Q5_K (no imatrix); here the more-bits layers' Q6_K. The token table is the
# base type in both, as here.
QUANT_MIXES = {"q4_k_m": (Q.Q4_K, Q.Q6_K, FILE_TYPE_Q4_K_M), "q5_k_m": (Q.Q5_K, Q.Q6_K, FILE_TYPE_Q5_K_M),
               "iq4_xs": (Q.IQ4_XS, Q.Q6_K, FILE_TYPE_IQ4_XS), "q4_0": (Q.Q4_0, Q.Q6_K, FILE_TYPE_Q4_0),
               "iq4_nl": (Q.IQ4_NL, Q.Q6_K, FILE_TYPE_IQ4_NL),
               "q3_k_m": (Q.Q3_K, Q.Q6_K, FILE_TYPE_Q3_K_M)}
QUANTS = tuple(QUANT_MIXES)
DRAFT_QUANTS = {"q8_0": Q.Q8_0, "f16": Q.F16, "q4_k": Q.Q4_K}


def get_shape(name: str, layers: int | None = None, ctx: int | None = None) -> SyntheticShape:
    """The named shape, optionally with `layers` trunk layers (same widths) and a context length."""
    if name not in SHAPES:
        raise SpecsplitError(f"unknown synthetic shape {name!r}; known: {', '.join(SHAPES)}")
    s = SHAPES[name]()
    t, d = s.target, s.drafter
    if layers is not None:
        if layers < 1:
            raise SpecsplitError(f"--layers must be >= 1, got {layers}")
        if layers != t.n_layer:
            # keep the drafter's feature count; spread its target layers over the shorter trunk
            ids = [min(layers - 1, round(i * layers / t.n_layer)) for i in d.target_layer_ids]
            t = replace(t, n_layer=layers, recurrent_layers=[(i + 1) % t.full_attention_interval != 0
                                                              for i in range(layers)])
            t.name = t.name.replace("(synthetic)", f"{layers}-layer (synthetic)")
            d = replace(d, target_layer_ids=ids, layer_causal=list(d.layer_causal))
    if ctx is not None:
        if ctx < 1:
            raise SpecsplitError(f"--ctx must be >= 1, got {ctx}")
        t = replace(t, context_length=ctx, recurrent_layers=list(t.recurrent_layers))
    return replace(s, target=t, drafter=d)


# --------------------------------------------------------------------------------------------------
# tensor plan


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]      # numpy order (out, in)
    qtype: Q
    kind: str                   # how values are made: matrix | ones | ssm_a | dt_bias | conv

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v/attn_qkv and ffn_down."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fit(qtype: Q, n_cols: int) -> Q:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if n_cols % block == 0:
        return qtype
    # llama.cpp's k-quant fallback is Q5_0/Q8_0; Q8_0 for both here (specsplit reads no Q5_0)
    return Q.Q8_0 if n_cols % 32 == 0 else Q.F16


def _matrix(name: str, out: int, inp: int, qtype: Q) -> TensorSpec:
    return TensorSpec(name, (out, inp), _fit(qtype, inp), "matrix")


def target_tensors(cfg: ModelConfig, quant: str = "q4_k_m", type_layers: int | None = None) -> list[TensorSpec]:
    """The tensors of a qwen35 GGUF in llama.cpp's order (globals, then per layer), with Q4_K_M types (q5_k_m: Q5_K_M's,
    the same mix with Q5_K for Q4_K; iq4_xs, q3_k_m, q4_0, iq4_nl: with their base type for Q4_K: QUANT_MIXES).

    type_layers: the layer count the "more bits" rule uses (default cfg.n_layer); with the real model's
    count a --layers N file has, layer by layer, the real file's types.
    """
    if quant not in QUANTS:
        raise SpecsplitError(f"unknown --quant {quant!r}; supported: {', '.join(QUANTS)}")
    if cfg.arch != "qwen35":
        raise SpecsplitError(f"synthetic targets are qwen35 only, not {cfg.arch!r}")
    E, F, V, L = cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.n_layer
    n_types = type_layers or L
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    f32 = Q.F32
    base, high, _ = QUANT_MIXES[quant]
    specs = [_matrix("token_embd.weight", V, E, base), TensorSpec("output_norm.weight", (E,), f32, "ones"),
             _matrix("output.weight", V, E, high)]
    for i in range(L):
        p = f"blk.{i}."
        more = high if use_more_bits(i, n_types) else base   # i_attention_wv == i: one attn_v/qkv a layer
        specs.append(TensorSpec(p + "attn_norm.weight", (E,), f32, "ones"))
        if cfg.recurrent_layers[i]:
            Hv, inner, conv = cfg.ssm_n_v_heads, cfg.ssm_inner_size, cfg.ssm_conv_dim
            specs += [
                _matrix(p + "attn_qkv.weight", conv, E, more),
                _matrix(p + "attn_gate.weight", inner, E, base),
                _matrix(p + "ssm_beta.weight", Hv, E, base),
                _matrix(p + "ssm_alpha.weight", Hv, E, base),
                TensorSpec(p + "ssm_conv1d.weight", (conv, cfg.ssm_conv_kernel), f32, "conv"),
                TensorSpec(p + "ssm_dt.bias", (Hv,), f32, "dt_bias"),
                TensorSpec(p + "ssm_a", (Hv,), f32, "ssm_a"),
                TensorSpec(p + "ssm_norm.weight", (cfg.ssm_head_v_dim,), f32, "ones"),
                _matrix(p + "ssm_out.weight", E, inner, base),
            ]
        else:
            specs += [
                _matrix(p + "attn_q.weight", 2 * H * D, E, base),
                _matrix(p + "attn_k.weight", Hkv * D, E, base),
                _matrix(p + "attn_v.weight", Hkv * D, E, more),
                _matrix(p + "attn_output.weight", E, H * D, base),
                TensorSpec(p + "attn_q_norm.weight", (D,), f32, "ones"),
                TensorSpec(p + "attn_k_norm.weight", (D,), f32, "ones"),
            ]
        specs += [
            TensorSpec(p + "post_attention_norm.weight", (E,), f32, "ones"),
            _matrix(p + "ffn_gate.weight", F, E, base),
            _matrix(p + "ffn_up.weight", F, E, base),
            _matrix(p + "ffn_down.weight", E, F, more),
        ]
    return specs


def drafter_tensors(cfg: DrafterConfig, quant: str = "q8_0") -> list[TensorSpec]:
    """The tensors of a `dflash-draft` GGUF (no embedding / lm head: the drafter borrows the target's)."""
    if quant not in DRAFT_QUANTS:
        raise SpecsplitError(f"unknown --draft-quant {quant!r}; supported: {', '.join(DRAFT_QUANTS)}")
    qt = DRAFT_QUANTS[quant]
    E, D = cfg.n_embd, cfg.head_dim
    specs = [_matrix("dflash_fc.weight", E, cfg.n_features, qt),
             TensorSpec("dflash_hidden_norm.weight", (E,), Q.F32, "ones"),
             TensorSpec("output_norm.weight", (E,), Q.F32, "ones")]
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        specs += [
            TensorSpec(p + "attn_norm.weight", (E,), Q.F32, "ones"),
            _matrix(p + "attn_q.weight", cfg.n_head * D, E, qt),
            _matrix(p + "attn_k.weight", cfg.n_head_kv * D, E, qt),
            _matrix(p + "attn_v.weight", cfg.n_head_kv * D, E, qt),
            _matrix(p + "attn_output.weight", E, cfg.n_head * D, qt),
            TensorSpec(p + "attn_q_norm.weight", (D,), Q.F32, "ones"),
            TensorSpec(p + "attn_k_norm.weight", (D,), Q.F32, "ones"),
            TensorSpec(p + "post_attention_norm.weight", (E,), Q.F32, "ones"),
            _matrix(p + "ffn_gate.weight", cfg.n_ff, E, qt),
            _matrix(p + "ffn_up.weight", cfg.n_ff, E, qt),
            _matrix(p + "ffn_down.weight", E, cfg.n_ff, qt),
        ]
    return specs


# --------------------------------------------------------------------------------------------------
# metadata


def synthetic_vocab(n_vocab: int, first_special: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE: 256 byte tokens, then merges of a fixed alphabet
    (pairs, then pair + character) up to `first_special`, ChatML specials, unused rows to `n_vocab`."""
    n_regular = first_special
    if n_regular < 256 or n_regular + len(SPECIALS) > n_vocab:
        raise SpecsplitError(f"a vocabulary of {n_vocab} cannot hold 256 byte tokens, merges and "
                             f"{len(SPECIALS)} specials starting at {first_special}")
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)]
    # space (Ġ) and letters first, so short English text gets multi-byte tokens
    alphabet = [_BYTE_TO_CHAR[b] for b in b" etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ.,:;'\"-()_/"]
    merges: list[str] = []
    pairs: list[str] = []

    def gen() -> Iterator[tuple[str, str]]:
        for a in alphabet:
            for b in alphabet:
                pairs.append(a + b)
                yield a, b
        for p in pairs:
            for c in alphabet:
                yield p, c

    it = gen()
    while len(tokens) < n_regular:
        try:
            a, b = next(it)
        except StopIteration:
            raise SpecsplitError(f"cannot generate {n_regular} distinct synthetic tokens") from None
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += list(SPECIALS)
    types += [TOKEN_CONTROL] * len(SPECIALS)
    for i in range(len(tokens), n_vocab):
        tokens.append(f"<|synthetic_unused_{i}|>")
        types.append(TOKEN_UNUSED)
    return tokens, types, merges


def target_metadata(shape: SyntheticShape, quant: str = "q4_k_m") -> dict[str, Any]:
    cfg = shape.target
    tokens, types, merges = synthetic_vocab(cfg.n_vocab, shape.first_special)
    meta = {
        "general.architecture": cfg.arch,
        "general.type": "model",
        "general.name": f"{cfg.name} {quant.upper()}",
        "general.description": ("SYNTHETIC model for benchmarks: random weights with the real shapes, tensor "
                                "types and metadata; synthetic byte-level tokenizer. Produces no meaningful text."),
        "general.size_label": shape.size_label,
        "general.file_type": QUANT_MIXES[quant][2],
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
    }
    meta.update(gguf_metadata(cfg))
    meta[f"{cfg.arch}.rope.dimension_sections"] = list(shape.rope_sections)
    eos = shape.first_special + SPECIALS.index("<|im_end|>")
    meta.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": shape.first_special,
        "tokenizer.ggml.add_bos_token": False,
    })
    return meta


def drafter_metadata(shape: SyntheticShape) -> dict[str, Any]:
    meta = {"general.architecture": "dflash-draft", "general.type": "model",
            "general.name": f"{shape.target.name} DFlash drafter",
            "general.description": "SYNTHETIC DFlash drafter for benchmarks: random weights, real shapes."}
    meta.update(drafter_gguf_metadata(shape.drafter))
    return meta


# --------------------------------------------------------------------------------------------------
# random blocks


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _sub_scale_ms(lo: int, hi: int) -> float:
    """sqrt(E[s^2]) of an integer scale uniform in [lo, hi]."""
    s = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.sqrt(np.mean(s * s)))


# 6-bit sub-block scales drawn from [8, 31]; a larger range would push d into fp16's subnormals
_K_SC = (8, 31)


def random_blocks(qtype: Q, n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, type_size) uint8 of zero-mean random values with standard deviation ~std."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16):
        vals = (rng.standard_normal(n_blocks * block, dtype=np.float32) * np.float32(std))
        return vals.astype(np.float32 if qtype == Q.F32 else np.float16).view(np.uint8).reshape(n_blocks, size)
    out = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    # per-block jitter of the super-scale (x0.8 .. x1.2) so blocks differ like real ones
    jitter = rng.uniform(0.8, 1.2, size=n_blocks).astype(np.float32)
    if qtype == Q.Q8_0:
        # {f16 d; int8 qs[32]}: w = d*q, q uniform in [-128, 127]: E[q^2] = 5461.5
        out[:, 0:2] = _f16_bytes(std / math.sqrt(5461.5) * jitter)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        # {f16 d; f16 dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]}: w = d*sc*q - dmin*m, q uniform in
        # [0, 15] (Q5_K: [0, 31], random qs nibbles and qh bits). m = sc and dmin = mid d with mid = 7.5 / 15.5
        # make every sub-block zero-mean: w = d*sc*(q - mid), E[(q - mid)^2] = 21.25 / 85.25.
        mid, var = (7.5, 21.25) if qtype == Q.Q4_K else (15.5, 85.25)
        sc = rng.integers(_K_SC[0], _K_SC[1] + 1, size=(n_blocks, 8), dtype=np.uint8)
        d = (std / (_sub_scale_ms(*_K_SC) * math.sqrt(var)) * jitter).astype(np.float16)
        out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = _f16_bytes(d.astype(np.float32) * mid)
        lo, hi = sc[:, :4], sc[:, 4:]
        six, four = np.uint8(63), np.uint8(0x0F)
        top = (hi >> np.uint8(4)) << np.uint8(6)           # bits 4-5 of scales 4-7 ride on bytes 0-7
        out[:, 4:8] = (lo & six) | top
        out[:, 8:12] = (lo & six) | top                    # mins equal the scales
        out[:, 12:16] = (hi & four) | ((hi & four) << np.uint8(4))
    elif qtype == Q.IQ4_XS:
        # {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}: w = d*(ls - 32)*kv[q], q uniform over the 16-entry
        # codebook: E[kv^2] = 4548. Its mean (-5.9 against a spread of 67) cancels with ls - 32 of either sign,
        # magnitude drawn from [8, 31]
        mag = rng.integers(_K_SC[0], _K_SC[1] + 1, size=(n_blocks, 8)).astype(np.int32)
        ls = (32 + np.where(rng.random((n_blocks, 8)) < 0.5, -mag, mag)).astype(np.uint16)
        out[:, 0:2] = _f16_bytes(std / (_sub_scale_ms(*_K_SC) * math.sqrt(4548.0)) * jitter)
        high = ((ls >> np.uint16(4)) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
        out[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(-1, 2)
        low = (ls & np.uint16(0x0F)).astype(np.uint8)
        out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << np.uint8(4))
    elif qtype == Q.Q3_K:
        # {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: w = d*(sc - 32)*q, q = q2 - 4 (hmask bit clear) uniform in
        # [-4, 3] (random qs and hmask bytes): E[q^2] = 5.5. Its mean (-0.5 against a spread of 2.3) cancels with
        # sc - 32 of either sign, magnitude drawn from [8, 31]; sc packed as ggml's 6-bit scales (low nibbles in bytes
        # 0-7, scales 8-15 in their high halves; top two bits 2 (i / 4) of byte 8 + i % 4)
        mag = rng.integers(_K_SC[0], _K_SC[1] + 1, size=(n_blocks, 16)).astype(np.int32)
        sc = (32 + np.where(rng.random((n_blocks, 16)) < 0.5, -mag, mag)).astype(np.uint8)
        low = sc & np.uint8(0x0F)
        out[:, 96:104] = low[:, :8] | (low[:, 8:] << np.uint8(4))
        top = (sc >> np.uint8(4)).reshape(n_blocks, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]
        out[:, 104:108] = np.bitwise_or.reduce(top, axis=1)
        out[:, 108:110] = _f16_bytes(std / (_sub_scale_ms(*_K_SC) * math.sqrt(5.5)) * jitter)
    elif qtype in (Q.Q4_0, Q.IQ4_NL):
        # {f16 d; u8 qs[16]}: w = d*(q - 8) (Q4_0: E[(q - 8)^2] = 21.5) or d*kv[q] (IQ4_NL: the codebook, E[kv^2] =
        # 4548), q uniform in [0, 15]; their means (-0.5 against a spread of 4.6, -5.9 against 67) cancel with d of
        # either sign
        ms = 21.5 if qtype == Q.Q4_0 else 4548.0
        sign = np.where(rng.random(n_blocks) < 0.5, np.float32(-1), np.float32(1))
        out[:, 0:2] = _f16_bytes(std / math.sqrt(ms) * jitter * sign)
    elif qtype == Q.Q6_K:
        # {u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d}: w = d*sc*(q - 32), q uniform in [0, 63]:
        # E[(q-32)^2] = 341.5 (mean -0.5 of 32: small against the spread)
        sc = rng.integers(_K_SC[0], _K_SC[1] + 1, size=(n_blocks, 16), dtype=np.int8)
        out[:, 192:208] = sc.view(np.uint8)
        out[:, 208:210] = _f16_bytes(std / (_sub_scale_ms(*_K_SC) * math.sqrt(341.5)) * jitter)
    else:
        raise SpecsplitError(f"no random block generator for {qtype.name}")
    return out


def _values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Float values of a small (1-D / conv) tensor."""
    n = math.prod(spec.shape)
    if spec.kind == "ones":
        return np.ones(n, np.float32)
    if spec.kind == "ssm_a":                      # -exp(A_log), A ~ U(1, 16)
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if spec.kind == "dt_bias":                    # inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if spec.kind == "conv":
        return (rng.standard_normal(n) / math.sqrt(spec.shape[-1])).astype(np.float32)
    raise AssertionError(spec.kind)


def tensor_chunks(spec: TensorSpec, rng: np.random.Generator,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The tensor's storage as flat uint8 arrays of at most ~chunk_bytes (whole rows)."""
    if spec.kind != "matrix":
        vals = _values(spec, rng)
        if spec.qtype != Q.F32:
            raise AssertionError(f"{spec.name}: small tensors are F32")
        yield vals.view(np.uint8)
        return
    rows, cols = spec.shape
    block, size = gguf.GGML_QUANT_SIZES[spec.qtype]
    blocks_per_row = cols // block
    row_bytes = blocks_per_row * size
    std = 1.0 / math.sqrt(cols)
    step = max(1, chunk_bytes // row_bytes)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        yield random_blocks(spec.qtype, n * blocks_per_row, std, rng).reshape(-1)


# --------------------------------------------------------------------------------------------------
# GGUF stream writer


def _pack_scalar(vt: VT, v: Any) -> bytes:
    if vt == VT.STRING:
        b = str(v).encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    fmt = {VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q"}[vt]
    return struct.pack(fmt, v)


def _pack_kv(key: str, value: Any) -> bytes:
    vt, sub = _value_type(value)
    out = [_pack_scalar(VT.STRING, key), struct.pack("<I", vt)]
    if vt == VT.ARRAY:
        out.append(struct.pack("<IQ", sub, len(value)))
        if sub == VT.STRING:
            enc = [s.encode("utf-8") for s in value]
            out.append(b"".join(struct.pack("<Q", len(b)) + b for b in enc))
        else:
            dtype = {VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "u1"}[sub]
            out.append(np.asarray(value, dtype=dtype).tobytes())
    else:
        out.append(_pack_scalar(vt, value))
    return b"".join(out)


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def gguf_header(metadata: dict[str, Any], specs: list[TensorSpec]) -> bytes:
    """Everything before the tensor data (padded to the alignment): magic, counts, KVs, tensor infos."""
    kvs = [(k, v) for k, v in metadata.items() if not (isinstance(v, (list, tuple)) and len(v) == 0)]
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(specs), len(kvs))]
    parts += [_pack_kv(k, v) for k, v in kvs]
    offset = 0
    for s in specs:
        ne = s.shape[::-1]
        parts.append(_pack_scalar(VT.STRING, s.name) + struct.pack("<I", len(ne))
                     + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", s.qtype, offset))
        offset += s.nbytes + _pad(s.nbytes)
    head = b"".join(parts)
    return head + b"\0" * _pad(len(head))


def file_size(header: bytes, specs: list[TensorSpec]) -> int:
    return len(header) + sum(s.nbytes + _pad(s.nbytes) for s in specs)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _Progress:
    """One line on stderr every few percent (or seconds), and a last one at the end."""

    def __init__(self, label: str, total: int, stream: Any = None, every_s: float = 5.0):
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = self.last_t = time.perf_counter()
        self.last_pct = -100.0
        self.every_s = every_s

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        pct = 100.0 * self.done / self.total if self.total else 100.0
        due = (pct - self.last_pct >= 5.0 and now - self.last_t >= 1.0) or now - self.last_t >= self.every_s
        if self.done >= self.total or due:
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0.0
            print(f"make-synthetic: {self.label}: {_size(self.done)} of {_size(self.total)} ({pct:.0f}%), "
                  f"{rate / 1e6:.0f} MB/s, eta {eta:.0f} s", file=self.stream, flush=True)
            self.last_t, self.last_pct = now, pct


def write_stream(path: str, metadata: dict[str, Any], specs: list[TensorSpec], seed: int,
                 progress: _Progress | None = None) -> int:
    """Write the GGUF through `path`.partial-<pid> and rename it into place; returns the file size."""
    header = gguf_header(metadata, specs)
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            if progress:
                progress.add(len(header))
            for idx, s in enumerate(specs):
                # one stream per tensor: contents do not depend on the chunk size or on other tensors
                rng = np.random.default_rng([seed, idx])
                for piece in tensor_chunks(s, rng):
                    f.write(piece.data)
                    if progress:
                        progress.add(piece.nbytes)
                pad = _pad(s.nbytes)
                if pad:
                    f.write(b"\0" * pad)
                    if progress:
                        progress.add(pad)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return size


# --------------------------------------------------------------------------------------------------
# entry point


@dataclass
class SyntheticResult:
    target_path: str
    target_bytes: int
    target_tensors: int
    drafter_path: str | None
    drafter_bytes: int
    drafter_tensors: int
    bytes_by_type: dict[str, int]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def bytes_by_type(specs: list[TensorSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.qtype.name] = out.get(s.qtype.name, 0) + s.nbytes
    return out


def make_synthetic(shape: str, out_dir: str, quant: str = "q4_k_m", seed: int = 0, ctx: int | None = None,
                   layers: int | None = None, draft: bool = True, draft_quant: str = "q8_0",
                   progress_stream: Any = None, quiet: bool = False) -> SyntheticResult:
    """Write `<out_dir>/<shape>[-L<layers>]-<quant>.synthetic.gguf` and its `...-dflash-draft-...` drafter."""
    t0 = time.perf_counter()
    sh = get_shape(shape, layers=layers, ctx=ctx)
    tspecs = target_tensors(sh.target, quant, sh.type_layers)
    dspecs = drafter_tensors(sh.drafter, draft_quant) if draft else []
    tmeta = target_metadata(sh, quant)
    theader = gguf_header(tmeta, tspecs)
    dmeta = drafter_metadata(sh) if draft else {}
    dheader = gguf_header(dmeta, dspecs) if draft else b""
    tsize = file_size(theader, tspecs)
    dsize = file_size(dheader, dspecs) if draft else 0

    os.makedirs(out_dir, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    need = tsize + dsize + DISK_MARGIN
    if free < need:
        raise SpecsplitError(
            f"not enough disk space in {out_dir}: the synthetic files need {need / 1e9:.2f} GB "
            f"(target {tsize / 1e9:.2f} GB, drafter {dsize / 1e9:.2f} GB, margin {DISK_MARGIN >> 20} MiB) "
            f"but only {free / 1e9:.2f} GB are free; free some space, pick another --out, or use --layers N")

    stem = shape + (f"-L{sh.target.n_layer}" if layers is not None else "")
    tpath = os.path.join(out_dir, f"{stem}-{quant}.synthetic.gguf")
    dpath = os.path.join(out_dir, f"{stem}-dflash-draft-{draft_quant}.synthetic.gguf") if draft else None
    stream = progress_stream if progress_stream is not None else sys.stderr
    prog = None if quiet else _Progress(f"target {os.path.basename(tpath)}", tsize, stream)
    written = write_stream(tpath, tmeta, tspecs, seed, prog)
    dwritten = 0
    if dpath is not None:
        prog = None if quiet else _Progress(f"drafter {os.path.basename(dpath)}", dsize, stream)
        dwritten = write_stream(dpath, dmeta, dspecs, seed + 1, prog)
    return SyntheticResult(target_path=tpath, target_bytes=written, target_tensors=len(tspecs),
                           drafter_path=dpath, drafter_bytes=dwritten, drafter_tensors=len(dspecs),
                           bytes_by_type=bytes_by_type(tspecs), seconds=round(time.perf_counter() - t0, 3))
