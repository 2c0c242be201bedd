"""Model-file reading: GGUF and safetensors round trips, detection by content, and clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from services.engine.errors import ModelFormatError, SpecsplitError
from services.engine.formats import ModelFile, RawTensor, detect_format, open_model_file

Q = gguf.GGMLQuantizationType
RNG = np.random.default_rng(1234)
W = RNG.standard_normal((8, 256)).astype(np.float32)  # (out, in)
NORM = RNG.standard_normal(256).astype(np.float32)
EXPERTS = RNG.standard_normal((2, 4, 32)).astype(np.float32)
# Q4_K has no quantizer in gguf-py: random blocks with small finite d/dmin stand in for real ones.
Q4K_RAW = RNG.integers(0, 256, size=(4, 144), dtype=np.uint8)
Q4K_RAW[:, 0:4] = (RNG.standard_normal((4, 2)) * 0.01).astype(np.float16).view(np.uint8)


def write_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_string("general.name", "tiny-test")
    w.add_bool("test.flag", True)
    w.add_uint64("test.big", 2**40 + 3)
    w.add_int32("test.neg", -7)
    w.add_array("test.sections", [11, 11, 10, 0])
    w.add_token_list(["<a>", "b", "ü", "Ġthe"])
    w.add_token_scores([0.0, -1.5, -2.0, -3.25])
    w.add_tensor("blk.0.attn_q.weight", W)  # F32
    w.add_tensor("blk.0.attn_norm.weight", NORM)  # 1-D F32
    w.add_tensor("blk.0.ffn_up.weight", W.astype(np.float16))  # F16
    w.add_tensor("blk.0.ffn_gate.weight", gguf.quants.quantize(W, Q.BF16), raw_dtype=Q.BF16)
    w.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(W, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.1.attn_q.weight", gguf.quants.quantize(W, Q.Q4_0), raw_dtype=Q.Q4_0)
    w.add_tensor("blk.1.ffn_up.weight", Q4K_RAW, raw_dtype=Q.Q4_K)  # (4, 256) values
    w.add_tensor("blk.1.ffn_up_exps.weight", EXPERTS)  # 3-D
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray], bf16: dict[str, np.ndarray] | None = None
) -> Path:
    """safetensors by hand, so BF16 (which numpy cannot hold) can be written as its uint16 bits."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, pos = [], 0
    items = [(n, a, {np.float32: "F32", np.float16: "F16"}[a.dtype.type]) for n, a in tensors.items()]
    for n, a in (bf16 or {}).items():
        items.append((n, gguf.quants.quantize(a, Q.BF16).view(np.uint16).reshape(a.shape), "BF16"))
    for name, arr, dtype in items:
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def expect_error(path: Path, *fragments: str) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as info:
        open_model_file(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg
    for fragment in fragments:
        assert fragment in msg, msg
    return info.value


# ---------------------------------------------------------------------------------------------- GGUF


def test_gguf_metadata_round_trip(gguf_file: Path) -> None:
    m = open_model_file(gguf_file)
    assert m.kind == "gguf" and m.path == str(gguf_file)
    md = m.metadata
    assert md["general.architecture"] == "qwen35"
    assert md["qwen35.block_count"] == 2 and isinstance(md["qwen35.block_count"], int)
    assert md["qwen35.context_length"] == 4096
    assert md["qwen35.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert md["general.name"] == "tiny-test"
    assert md["test.flag"] is True
    assert md["test.big"] == 2**40 + 3
    assert md["test.neg"] == -7
    assert md["test.sections"] == [11, 11, 10, 0]
    assert md["tokenizer.ggml.tokens"] == ["<a>", "b", "ü", "Ġthe"]
    assert md["tokenizer.ggml.scores"] == [0.0, -1.5, -2.0, -3.25]
    assert not any(k.startswith("GGUF.") for k in md)


def test_gguf_tensors_round_trip(gguf_file: Path) -> None:
    m = open_model_file(gguf_file)
    assert len(m.tensors) == 8
    expected = {
        "blk.0.attn_q.weight": (Q.F32, W, 0.0),
        "blk.0.attn_norm.weight": (Q.F32, NORM, 0.0),
        "blk.0.ffn_up.weight": (Q.F16, W, 3e-3),
        "blk.0.ffn_gate.weight": (Q.BF16, W, 2e-2),
        "blk.0.ffn_down.weight": (Q.Q8_0, W, 3e-2),
        "blk.1.attn_q.weight": (Q.Q4_0, W, 1.0),
        "blk.1.ffn_up_exps.weight": (Q.F32, EXPERTS, 0.0),
    }
    for name, (qtype, ref, tol) in expected.items():
        t = m.require(name)
        assert t.qtype == qtype and t.shape == ref.shape and t.source == str(gguf_file)
        values = t.dequantize()
        assert values.dtype == np.float32 and values.shape == ref.shape
        assert np.abs(values - ref).max() <= tol, name
    # The quantized tensors must decode exactly as gguf-py would from the same bytes.
    quantized = [
        ("blk.0.ffn_down.weight", Q.Q8_0),
        ("blk.1.attn_q.weight", Q.Q4_0),
        ("blk.1.ffn_up.weight", Q.Q4_K),
    ]
    for name, qtype in quantized:
        t = m.require(name)
        assert np.array_equal(t.dequantize(), gguf.quants.dequantize(t.data, qtype).reshape(t.shape))
    q4k = m.require("blk.1.ffn_up.weight")
    assert q4k.shape == (4, 256) and q4k.nbytes == Q4K_RAW.nbytes
    assert np.array_equal(q4k.data.reshape(4, 144), Q4K_RAW)


def test_gguf_data_is_memory_mapped(gguf_file: Path) -> None:
    t = open_model_file(gguf_file).require("blk.0.attn_q.weight")
    assert isinstance(t.data.base, np.memmap) or isinstance(t.data, np.memmap)
    assert not t.data.flags.writeable


def test_require_missing_tensor(gguf_file: Path) -> None:
    m = open_model_file(gguf_file)
    with pytest.raises(ModelFormatError) as info:
        m.require("output.weight")
    expected = f"{gguf_file}: expected tensor 'output.weight', found it missing (file has 8 tensors)"
    assert str(info.value) == expected
    assert "output.weight" not in m and "blk.0.attn_q.weight" in m


# ---------------------------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_including_bf16(tmp_path: Path) -> None:
    path = write_safetensors(
        tmp_path / "model.safetensors",
        {"a.weight": W, "b.half": W.astype(np.float16)},
        bf16={"c.bf16": W, "d.norm": NORM},
    )
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256, "block_size": 16}))
    m = open_model_file(path)
    assert m.kind == "safetensors" and m.metadata == {"hidden_size": 256, "block_size": 16}
    assert m.require("a.weight").qtype == Q.F32 and np.array_equal(m.require("a.weight").dequantize(), W)
    assert m.require("b.half").qtype == Q.F16
    assert np.array_equal(m.require("b.half").dequantize(), W.astype(np.float16).astype(np.float32))
    c = m.require("c.bf16")
    assert c.qtype == Q.BF16 and c.data.dtype == np.uint16 and c.shape == (8, 256)
    ref = gguf.quants.dequantize(gguf.quants.quantize(W, Q.BF16), Q.BF16)
    assert np.array_equal(c.dequantize(), ref)
    assert m.require("d.norm").shape == (256,)


def test_safetensors_written_by_the_library(tmp_path: Path) -> None:
    tensors = {"x": W, "y": NORM.astype(np.float16), "ids": np.arange(5, dtype=np.int64)}
    save_file(tensors, str(tmp_path / "lib.safetensors"))
    m = open_model_file(tmp_path / "lib.safetensors")
    assert m.metadata == {}
    ref = load_file(str(tmp_path / "lib.safetensors"))
    for name in tensors:
        assert np.array_equal(m.require(name).data, ref[name])
    assert m.require("ids").qtype == Q.I64


def test_hf_folder_sharded_by_index(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": W})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": NORM})
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert detect_format(tmp_path) == "safetensors"
    m = open_model_file(tmp_path)
    assert m.path == str(tmp_path) and m.metadata == {"model_type": "qwen3"}
    assert sorted(m.tensors) == ["a", "b"]
    assert np.array_equal(m.require("b").dequantize(), NORM)
    assert m.require("a").source == str(tmp_path / "model-00001-of-00002.safetensors")


def test_hf_folder_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": W})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="00002-of-00002.safetensors' beside the index, found no such"):
        open_model_file(tmp_path)


def test_hf_folder_without_index_merges_all_shards(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "one.safetensors", {"a": W})
    write_safetensors(tmp_path / "two.safetensors", {"b": NORM})
    m = open_model_file(tmp_path)
    assert sorted(m.tensors) == ["a", "b"] and m.metadata == {}


def test_folder_with_one_gguf(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model-Q4_K_M.gguf")
    (tmp_path / "README.md").write_text("hi")
    assert detect_format(tmp_path) == "gguf"
    m = open_model_file(tmp_path)
    assert m.kind == "gguf" and m.path == str(path)


# ---------------------------------------------------------------------------------------------- detection


def test_detection_is_by_content_not_name(tmp_path: Path, gguf_file: Path) -> None:
    st_named_gguf = write_safetensors(tmp_path / "model.gguf", {"a": W})
    gguf_named_bin = tmp_path / "pytorch_model.bin"
    gguf_named_bin.write_bytes(gguf_file.read_bytes())
    assert detect_format(st_named_gguf) == "safetensors"
    assert detect_format(gguf_named_bin) == "gguf"
    assert open_model_file(st_named_gguf).kind == "safetensors"
    m = open_model_file(gguf_named_bin)
    assert m.kind == "gguf" and len(m.tensors) == 8


# ---------------------------------------------------------------------------------------------- errors


def test_wrong_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" + bytes(64))
    err = expect_error(
        path, "expected a GGUF file (magic 'GGUF') or a safetensors file, found b'PK\\x03\\x04 thi'"
    )
    assert err.offset == 0


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(path, "found an empty file (0 bytes)")
    with pytest.raises(ModelFormatError, match="empty file"):
        detect_format(path)


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.gguf", "found no such file or directory")
    (tmp_path / "notes.txt").write_text("x")
    err = expect_error(tmp_path, "expected a model folder", "found no model files (folder holds: notes.txt)")
    assert err.path == str(tmp_path)


def test_folder_with_two_ggufs_is_ambiguous(tmp_path: Path, gguf_file: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_file.read_bytes())
    expect_error(tmp_path, "found 2 GGUF files (a.gguf, b.gguf)")


def test_unsupported_gguf_version(tmp_path: Path, gguf_file: Path) -> None:
    data = bytearray(gguf_file.read_bytes())
    data[4:8] = struct.pack("<I", 7)
    (path := tmp_path / "v7.gguf").write_bytes(bytes(data))
    assert expect_error(path, "expected GGUF version 2 or 3 (little-endian), found version 7").offset == 4
    data[4:8] = struct.pack(">I", 3)
    path.write_bytes(bytes(data))
    expect_error(path, "big-endian GGUF")


def test_truncated_header(tmp_path: Path, gguf_file: Path) -> None:
    data = gguf_file.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:20])
    expect_error(
        path, "expected metadata key/value count (8 bytes), found only 4 bytes left in the file (truncated?)"
    )
    # Cut in the middle of the token list: the string length points past the end of the file.
    cut = data.index(b"\xc4\xa0the") + 2
    path.write_bytes(data[:cut])
    err = expect_error(path, "value of 'tokenizer.ggml.tokens'", "truncated?")
    assert err.offset is not None and err.offset < cut


def test_truncated_tensor_data_names_the_tensor(tmp_path: Path, gguf_file: Path) -> None:
    data = gguf_file.read_bytes()
    path = tmp_path / "chopped.gguf"
    path.write_bytes(data[:-100])
    expect_error(
        path, "expected tensor 'blk.1.ffn_up_exps.weight' data of 1024 bytes", f"at byte {len(data) - 100}"
    )


def _tensor_info_at(data: bytes, name: str) -> int:
    """Offset just after the tensor-info name, i.e. where n_dims starts."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    return data.index(needle) + len(needle)


def test_bad_type_id_and_n_dims(tmp_path: Path, gguf_file: Path) -> None:
    data = bytearray(gguf_file.read_bytes())
    at = _tensor_info_at(bytes(data), "blk.0.attn_norm.weight")  # 1-D: n_dims, ne0, type
    bad_type = bytearray(data)
    bad_type[at + 12 : at + 16] = struct.pack("<I", 250)
    (path := tmp_path / "type.gguf").write_bytes(bytes(bad_type))
    err = expect_error(
        path, "expected a known ggml type id for tensor 'blk.0.attn_norm.weight', found type id 250"
    )
    assert err.offset == at + 12
    bad_dims = bytearray(data)
    bad_dims[at : at + 4] = struct.pack("<I", 0xFFFFFFFF)
    path.write_bytes(bytes(bad_dims))
    expect_error(
        path, "expected 1 to 4 dimensions for tensor 'blk.0.attn_norm.weight', found n_dims = 4294967295"
    )


def test_absurd_counts(tmp_path: Path, gguf_file: Path) -> None:
    data = bytearray(gguf_file.read_bytes())
    data[16:24] = struct.pack("<Q", 2**62)
    (path := tmp_path / "kv.gguf").write_bytes(bytes(data))
    expect_error(path, "expected tensor and key/value counts that fit in the file")


def test_every_truncation_gives_a_model_format_error(tmp_path: Path, gguf_file: Path) -> None:
    data = gguf_file.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in list(range(1, 700, 3)) + [len(data) - 1]:
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError) as info:
            open_model_file(path)
        assert str(path) in str(info.value)


def test_random_corruption_never_escapes_as_another_exception(tmp_path: Path, gguf_file: Path) -> None:
    data = gguf_file.read_bytes()
    rng = np.random.default_rng(5)
    path = tmp_path / "corrupt.gguf"
    for _ in range(150):
        bad = bytearray(data)
        for pos in rng.integers(4, 650, size=3):
            bad[pos] = rng.integers(0, 256)
        path.write_bytes(bytes(bad))
        try:
            m = open_model_file(path)
            for t in m.tensors.values():
                t.dequantize()
        except SpecsplitError:
            pass


def test_safetensors_errors(tmp_path: Path) -> None:
    good = write_safetensors(tmp_path / "good.safetensors", {"a.weight": W}).read_bytes()
    path = tmp_path / "bad.safetensors"
    (n,) = struct.unpack("<Q", good[:8])

    path.write_bytes(good[: 8 + n // 2])
    assert expect_error(path, f"expected a JSON header of {n} bytes", "truncated?").offset == 8

    path.write_bytes(good[:-10])
    expect_error(path, "expected tensor 'a.weight' data in bytes", f"the file ends at byte {len(good) - 10}")

    path.write_bytes(struct.pack("<Q", 12) + b"{not json!} " + bytes(16))
    expect_error(path, "expected a JSON header, found invalid JSON")

    # Overlapping tensors pass our own checks; the safetensors library itself must reject them.
    overlap = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    header = json.dumps(overlap).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    expect_error(path, "expected a valid safetensors file, found safetensors rejected it", "tensor `b`")

    header = json.dumps({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    expect_error(path, "expected 64 bytes for tensor 'a' (F32 [4, 4]), found data_offsets spanning 60")


def test_bad_config_json(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"a": W})
    (tmp_path / "config.json").write_text('{"hidden_size": 256,')
    match = r"config\.json at byte offset \d+: expected a JSON object, found invalid JSON"
    with pytest.raises(ModelFormatError, match=match):
        open_model_file(tmp_path)


def test_dequantize_wraps_errors_with_the_tensor_name(tmp_path: Path) -> None:
    t = RawTensor("blk.3.ffn_down.weight", int(Q.IQ3_S), (1, 256), np.zeros((1, 110), np.uint8), "m.gguf")
    with pytest.raises(SpecsplitError, match=r"m\.gguf: tensor 'blk\.3\.ffn_down\.weight': quant type IQ3_S"):
        t.dequantize()
    short = RawTensor("w", int(Q.Q8_0), (2, 32), np.zeros(34, np.uint8), "m.gguf")
    with pytest.raises(ModelFormatError, match="m.gguf: expected tensor 'w' storage"):
        short.dequantize()
    assert ModelFile("m.gguf", "gguf", {}, {"w": short}).require("w") is short


def test_invalid_utf8_token_is_kept_not_fatal(tmp_path: Path, gguf_file: Path) -> None:
    data = gguf_file.read_bytes().replace(b"\xc4\xa0the", b"\xff\xfethe")
    (path := tmp_path / "bad-utf8.gguf").write_bytes(data)
    tokens = open_model_file(path).metadata["tokenizer.ggml.tokens"]
    assert tokens == ["<a>", "b", "ü", "\ufffd\ufffdthe"]


def test_gguf_reading_equals_gguf_pys(tmp_path: Path, gguf_file: Path) -> None:
    """formats reads GGUF headers itself (gguf-py's reader takes ~20 s over a 250k-token vocabulary); every value
    type, a long string array, a nested array and every tensor come out as gguf-py reads them."""
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    scalars = {"u8": (200, gguf.GGUFValueType.UINT8), "i8": (-100, gguf.GGUFValueType.INT8),
               "u16": (60000, gguf.GGUFValueType.UINT16), "i16": (-30000, gguf.GGUFValueType.INT16),
               "u32": (4_000_000_000, gguf.GGUFValueType.UINT32), "i32": (-2_000_000_000, gguf.GGUFValueType.INT32),
               "u64": (2**63 + 5, gguf.GGUFValueType.UINT64), "i64": (-(2**62), gguf.GGUFValueType.INT64),
               "f32": (0.1, gguf.GGUFValueType.FLOAT32), "f64": (0.1, gguf.GGUFValueType.FLOAT64),
               "b": (False, gguf.GGUFValueType.BOOL), "s": ("ünïcode", gguf.GGUFValueType.STRING)}
    for k, (v, t) in scalars.items():
        w.add_key_value(f"t.{k}", v, t)
    for k, (v, t) in scalars.items():
        w.add_key_value(f"t.arr_{k}", [v, v], gguf.GGUFValueType.ARRAY, sub_type=t)
    w.add_array("t.empty", [])
    words = [f"tok{i}\u0120{i % 7}" for i in range(20_000)]
    w.add_token_list(words)
    w.add_tensor("x.weight", W)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, gguf_file):
        mine = open_model_file(p)
        ref = gguf.GGUFReader(p)
        want = {f.name: f.contents() for f in ref.fields.values() if not f.name.startswith("GGUF.")}
        assert list(mine.metadata) == list(want)
        for k, v in want.items():
            got = mine.metadata[k]
            assert got == v and type(got) is type(v), k
            if isinstance(v, list) and v:
                assert type(got[0]) is type(v[0]), k
        assert [t.name for t in ref.tensors] == list(mine.tensors)
        for t in ref.tensors:
            m = mine.tensors[t.name]
            assert m.qtype == int(t.tensor_type) and m.data.dtype == t.data.dtype and m.data.shape == t.data.shape
            assert np.array_equal(m.data, t.data), t.name
    assert open_model_file(path).metadata["tokenizer.ggml.tokens"] == words
