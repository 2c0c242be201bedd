"""The NumPy quant codecs against gguf-py: bit-exact dequantization and byte-exact quantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from services.engine import quants
from services.engine.errors import UnsupportedModelError

Q = gguf.GGMLQuantizationType

# Byte offsets of the fp16 scale fields (d, dmin) inside one block of each quantized type.
FP16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q8_0: (0,),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


def random_blocks(qtype: Q, n_rows: int, n_blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw storage of (n_rows, row_bytes) uint8 whose fp16 scale fields are small and finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_rows * n_blocks_per_row, size), dtype=np.uint8)
    if qtype == Q.F16:
        raw = rng.standard_normal(raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, size)
    for start in FP16_FIELDS.get(qtype, ()):
        scales = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, n_blocks_per_row * size)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    # Compare bit patterns, so NaNs from random F32/BF16 bytes compare equal and -0.0 != 0.0.
    a, b = np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_bit_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    per_row = 8 if block > 1 else 96
    raw = random_blocks(qtype, 5, per_row, rng)
    shape = (5, per_row * block)

    ours = quants.dequantize(raw, qtype, shape)
    ref = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert same_bits(ours, ref.reshape(shape))


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_big_tensors_decode_in_pieces_to_the_same_bits(qtype: Q, monkeypatch) -> None:
    """A tensor past DEQUANT_CHUNK_VALUES is decoded a piece at a time (a 27B's LM head: 11 s and its own size in
    memory instead of 40 s and several copies); pieces that end mid-row and a short last piece included."""
    rng = np.random.default_rng(100 + int(qtype))
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    per_row = 8 if block > 1 else 96
    raw = random_blocks(qtype, 7, per_row, rng)
    shape = (7, per_row * block)
    monkeypatch.setattr(quants, "DEQUANT_CHUNK_VALUES", 3 * block)
    assert same_bits(quants.dequantize(raw, qtype, shape), gguf.quants.dequantize(raw, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.BF16, Q.F16], ids=lambda t: t.name)
def test_dequantize_accepts_flat_bytes_and_3d_shapes(qtype: Q) -> None:
    rng = np.random.default_rng(7)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 6, 256 // block, rng)
    ref = gguf.quants.dequantize(raw, qtype).reshape(2, 3, 256)
    assert same_bits(quants.dequantize(raw.reshape(-1), qtype, (2, 3, 256)), ref)


def test_typed_storage_is_accepted() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    assert np.array_equal(quants.dequantize(x, Q.F32, (2, 32)), x)
    assert np.array_equal(quants.dequantize(x.astype(np.float16), Q.F16, (2, 32)), x.astype(np.float16))
    exact = (np.arange(64, dtype=np.float32) - 32).reshape(2, 32) / 8  # representable in bf16
    bf16_bits = (exact.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(quants.dequantize(bf16_bits, Q.BF16, (2, 32)), exact)


def test_known_values() -> None:
    # Q8_0 block with d = 0.5 and qs = -16..15; Q4_0 block with d = 2 and nibbles 0..15 -> (q - 8) * 2.
    qs = np.arange(-16, 16, dtype=np.int8)
    q8 = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs.view(np.uint8)])
    assert np.array_equal(quants.dequantize(q8, Q.Q8_0, (32,)), np.arange(-16, 16, dtype=np.float32) * 0.5)
    nib = np.arange(16, dtype=np.uint8)
    q4 = np.concatenate([np.array([2.0], np.float16).view(np.uint8), nib | (nib[::-1] << 4)])
    expect = np.concatenate([(nib.astype(np.float32) - 8) * 2, (nib[::-1].astype(np.float32) - 8) * 2])
    assert np.array_equal(quants.dequantize(q4, Q.Q4_0, (32,)), expect)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.BF16, Q.F16, Q.F32], ids=lambda t: t.name)
def test_quantize_matches_gguf_py_bytes(qtype: Q) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 128)) * rng.uniform(0.01, 10, size=(7, 1))).astype(np.float32)
    x[1] = 0.0  # all-zero blocks: d = 0 must not divide by zero
    x[2, :32] = 1.0  # ties in |max|: the first one wins in ggml
    x[2, 5] = -1.0
    x[3, :32] = np.arange(32) - 15.5  # exact .5 products exercise round-half-away-from-zero
    ours = quants.quantize(x, qtype)
    ref = gguf.quants.quantize(x, qtype)
    assert ours.dtype == np.uint8
    assert np.array_equal(ours, np.ascontiguousarray(ref).view(np.uint8).reshape(ours.shape))
    back = quants.dequantize(ours, qtype, x.shape)
    tol = {Q.Q8_0: 0.01, Q.Q4_0: 0.15, Q.BF16: 0.01, Q.F16: 1e-3, Q.F32: 0.0}[qtype]
    scale = np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - x) <= tol * scale + 1e-12)


def test_bf16_quantize_rounds_to_nearest_even_and_keeps_nan() -> None:
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, np.nan, -np.inf, 3.4e38], dtype=np.float32)
    ours = quants.quantize(x, Q.BF16)
    assert np.array_equal(ours, gguf.quants.quantize(x, Q.BF16).view(np.uint8))
    back = quants.dequantize(ours, Q.BF16, x.shape)
    assert back[0] == 1.0 and back[1] == 1.0 + 4 * 2**-8 and np.isnan(back[2]) and back[3] == -np.inf


def test_row_bytes() -> None:
    assert quants.row_bytes(Q.Q4_K, 5120) == 20 * 144
    assert quants.row_bytes(Q.F32, 7) == 28
    assert quants.row_bytes(Q.IQ3_S, 256) == 110  # sizes are known even for types we cannot decode
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.row_bytes(Q.Q8_0, 48)
    assert quants.BLOCK_SIZES[Q.Q6_K] == (256, 210)


def test_unsupported_types_raise_clear_errors() -> None:
    raw = np.zeros((1, 110), dtype=np.uint8)
    with pytest.raises(UnsupportedModelError, match="IQ3_S is not supported"):
        quants.dequantize(raw, Q.IQ3_S, (1, 256))
    with pytest.raises(UnsupportedModelError, match="unknown ggml type id 99"):
        quants.dequantize(raw, 99, (1, 256))
    with pytest.raises(UnsupportedModelError, match="quantizing to Q4_K is not supported"):
        quants.quantize(np.zeros((1, 256), np.float32), Q.Q4_K)


def test_size_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="must be 68 bytes, found 34"):
        quants.dequantize(np.zeros(34, np.uint8), Q.Q8_0, (2, 32))
