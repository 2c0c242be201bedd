"""Tokenizer from GGUF metadata / HF folder, checked against transformers on a tiny trained byte-level BPE."""

from __future__ import annotations

import json
import os
import unicodedata

import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from services.engine.chat_template import DEFAULT_CHATML_TEMPLATE
from services.engine.errors import ModelFormatError, UnsupportedModelError
from services.engine.tokenizer import PRE_PATTERNS, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The tokenizer.json spelling (case-insensitive group), as Qwen ships it; our GGUF path spells it out.
QWEN2_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what they'd say, we'll see, I'm sure you've heard.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for i in range(10):\n\tprint(f"value {i} = {i * 2}")  # comment\n',
    "class Foo(Base):\n    def __init__(self, x):\n        self.x = x\n\n\n",
    "机器学习是人工智能的一个分支。我们今天学习分词器。你好，世界！",
    "日本語のテキストも少し入れます。こんにちは世界。",
    "Emoji test 😀😃😄 🚀🔥 👍🏽 👨‍👩‍👧 ❤️ and more 🎉",
    "Numbers 1234567890 3.14159 2024-05-09 $100.00 50%",
    "नमस्ते दुनिया, यह एक परीक्षण है। हिन्दी भाषा में शब्द।",
    "Ünïcödé àccents: café naïve résumé Straße Ελληνικά русский текст",
    "   leading spaces and trailing spaces   \n\n\nmultiple newlines\r\nwindows line\r\n",
]

PROBES = [
    "Hello world! It's a test, isn't it? WE'LL SEE.",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12345))",
    "机器学习和人工智能 — 你好，世界！",
    "Rocket 🚀 family 👨‍👩‍👧 thumbs 👍🏽 heart ❤️!",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "tabs\tand   many     spaces\n\n\n  \n end  ",
    "digits 0123456789 and 3.14159, 1e-9",
    "नमस्ते दुनिया x\u0301\u0302 a\u0323\u0308",
    "<|endoftext|><|endoftext|>",
    "",
    " ",
    "\n",
]


def _train_backend(pattern: str) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    # Like Qwen: specials come after the BPE vocabulary; <think> tags are added but not special.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
        ]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


def _write_folder(folder, backend: tokenizers.Tokenizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": DEFAULT_CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_tok")
    _write_folder(path, _train_backend(QWEN2_HF))
    return path


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def ours_hf(folder) -> Tokenizer:
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture(scope="module")
def meta(ours_hf) -> dict:
    return ours_hf.to_gguf_metadata()


@pytest.fixture(scope="module")
def ours(meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def test_metadata_shape(meta, ours_hf):
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    n = ours_hf.vocab_size
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == n
    assert all(isinstance(m, str) and m.count(" ") >= 1 for m in meta["tokenizer.ggml.merges"])
    types = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]))
    assert types["<|im_end|>"] == 3 and types["<think>"] == 4 and types["Ġ"] == 1
    assert meta["tokenizer.ggml.eos_token_id"] == ours_hf.token_to_id("<|im_end|>")
    assert meta["tokenizer.ggml.padding_token_id"] == ours_hf.token_to_id("<|endoftext|>")
    assert "tokenizer.ggml.bos_token_id" not in meta
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == DEFAULT_CHATML_TEMPLATE


@pytest.mark.parametrize("text", PROBES)
def test_encode_matches_transformers(hf, ours, ours_hf, text):
    want = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text) == want
    assert ours_hf.encode(text) == want


def test_special_ids_and_lookup(ours, hf):
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    eot = hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.eos_id == im_end
    assert {im_end, eot} <= ours.eos_ids
    assert ours.bos_id is None and ours.add_bos is False
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id("<think>") == hf.convert_tokens_to_ids("<think>")
    assert ours.id_to_token(im_end) == "<|im_end|>"
    assert ours.token_to_id("definitely not a token") is None
    assert ours.id_to_token(10**6) is None and ours.id_to_token(-1) is None
    assert ours.chat_template == DEFAULT_CHATML_TEMPLATE


@pytest.mark.parametrize("text", PROBES)
def test_decode_round_trip(hf, ours, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


def test_skip_special_keeps_user_defined(ours):
    ids = ours.encode("<|im_start|>assistant\n<think>x</think>y<|im_end|>")
    assert ours.decode(ids, skip_special=True) == "assistant\n<think>x</think>y"


@pytest.mark.parametrize("text", PROBES)
def test_incremental_decode(ours, text):
    ids = ours.encode(text)
    dec = ours.new_decoder()
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(pieces) + tail == ours.decode(ids)
    assert tail == ""
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_holds_back_partial_utf8(ours):
    text = "🚀"
    ids = ours.encode(text)
    assert len(ids) > 1, "the tiny vocabulary should split the emoji over several byte tokens"
    dec = ours.new_decoder()
    pieces = [dec.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == text
    # A stream cut mid-character ends in one replacement character, not an exception.
    dec = ours.new_decoder()
    assert dec.push(ids[0]) == "" and dec.flush() == "\ufffd"
    skipper = ours.new_decoder(skip_special=True)
    im_end = ours.token_to_id("<|im_end|>")
    assert skipper.push(im_end) == "" and ours.new_decoder().push(im_end) == "<|im_end|>"


def test_parse_special_false(ours, folder):
    text = "<|im_start|>user <|endoftext|> <think>"
    plain_ref = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    plain_ref.encode_special_tokens = True
    ids = ours.encode(text, parse_special=False)
    assert ids == plain_ref.encode(text, add_special_tokens=False).ids
    assert ours.token_to_id("<|im_start|>") not in ids
    assert ours.token_to_id("<think>") in ids  # user-defined tokens still parse, as in llama.cpp
    assert ours.decode(ids) == text
    # The shared instance is untouched.
    assert ours.encode(text)[0] == ours.token_to_id("<|im_start|>")


def test_add_special_prepends_bos(meta):
    m = dict(meta, **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 5})
    tok = Tokenizer.from_gguf_metadata(m)
    assert tok.encode("hi", add_special=True) == [5, *tok.encode("hi")]
    assert tok.encode("hi", add_special=False) == tok.encode("hi")


def test_metadata_round_trip(meta, ours):
    again = ours.to_gguf_metadata()
    assert again == meta


def test_unknown_model_or_pre(meta):
    with pytest.raises(UnsupportedModelError, match="llama-bpe"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "llama-bpe"}))
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.model": "llama"}))
    no_tokens = {k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(no_tokens, path="model.gguf")
    with pytest.raises(ModelFormatError, match="token types"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.token_type": [1]}))


def test_gguf_file_round_trip(tmp_path, meta, hf):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path))
    read = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    tok = Tokenizer.from_gguf_metadata(read, path=str(path))
    for text in PROBES:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    assert tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_template == DEFAULT_CHATML_TEMPLATE


def test_qwen35_pre_keeps_combining_marks(tmp_path):
    transformers = pytest.importorskip("transformers")
    backend = _train_backend(QWEN35_HF)
    _write_folder(tmp_path, backend)
    hf35 = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    meta = Tokenizer.from_hf_folder(tmp_path).to_gguf_metadata()
    assert meta["tokenizer.ggml.pre"] == "qwen35"
    tok35 = Tokenizer.from_gguf_metadata(meta)
    tok2 = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "qwen2"}))
    text = "नमस्ते दुनिया, x\u0301\u0302y and a\u0323\u0308b"
    for probe in [text, *PROBES]:
        assert tok35.encode(probe) == hf35.encode(probe, add_special_tokens=False)
    split35 = [p for p, _ in tok35._backend.pre_tokenizer.pre_tokenize_str(text)]
    split2 = [p for p, _ in tok2._backend.pre_tokenizer.pre_tokenize_str(text)]
    assert split35 != split2
    assert len(split35) < len(split2)  # marks stay inside their word with qwen35
    assert tok35.decode(tok35.encode(text)) == unicodedata.normalize("NFC", text)


def test_pre_patterns_are_the_llama_cpp_ones():
    # The GGUF path spells the contractions out; the rest is the tokenizer.json pattern verbatim.
    tail2 = QWEN2_HF.split(")", 1)[1]
    tail35 = QWEN35_HF.split(")", 1)[1]
    assert PRE_PATTERNS["qwen2"].endswith(tail2) and PRE_PATTERNS["qwen35"].endswith(tail35)
    assert PRE_PATTERNS["qwen2"].startswith("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|")


def test_hf_folder_side_files(tmp_path, folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    del config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.chat_template == "D" and tok.add_bos is False
    (tmp_path / "chat_template.jinja").write_text("J")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.chat_template == "J"
    assert {3, 4, tok.token_to_id("<|im_end|>")} <= tok.eos_ids
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path / "missing")
