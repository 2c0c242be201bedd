"""Byte-level BPE tokenizer built from GGUF metadata or a Hugging Face folder, with incremental decoding.

Encoding runs through the `tokenizers` library (built in memory the way reference §5.3 describes);
decoding maps ids to raw bytes ourselves so streamed and one-shot decoding agree byte for byte.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from services.engine.errors import ModelFormatError, UnsupportedModelError

# GGUF token types (gguf-py TokenType / llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# llama.cpp spells the case-insensitive contractions out; HF tokenizer.json files write `(?i:...)`.
_CONTRACTIONS_LLAMA = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_CONTRACTIONS_HF = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (llama.cpp src/llama-vocab.cpp).
PRE_PATTERNS: dict[str, str] = {
    "qwen2": _CONTRACTIONS_LLAMA
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # qwen35 keeps combining marks inside words; using the qwen2 pattern here is a real mismatch.
    "qwen35": _CONTRACTIONS_LLAMA
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# Tokens that end a generation besides the declared eos, looked up by text because ids differ per model.
# The FIM ones are in llama.cpp's end-of-generation set for Qwen (a Qwen3.6 GGUF lists them as EOG).
EOG_TOKEN_STRINGS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _as_str(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return str(value)


def _as_list(value: Any) -> list:
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value)


def _detect_pre(pattern: str | None) -> str | None:
    if pattern is None:
        return None
    canonical = pattern.replace(_CONTRACTIONS_HF, _CONTRACTIONS_LLAMA)
    for name, known in PRE_PATTERNS.items():
        if canonical == known:
            return name
    return None


def _split_merge(merge: str) -> list[str]:
    # Like llama.cpp: the separator is the first space after position 0, so a piece may start with one.
    i = merge.find(" ", 1)
    if i < 0:
        raise ValueError(merge)
    return [merge[:i], merge[i + 1 :]]


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back bytes of a UTF-8 character not yet complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        return self._utf8.decode(self._tok._token_bytes(token_id, self._skip_special))

    def flush(self) -> str:
        """End of stream: return what is left, with U+FFFD for an incomplete trailing character."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """A byte-level BPE tokenizer (GGUF `gpt2` model) with the ids, specials and template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        pre: str | None,
        vocab_size: int,
        eos_id: int | None,
        eos_ids: Iterable[int],
        bos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        gguf_lists: tuple[list[str], list[int], list[str]] | None = None,
    ):
        self._backend = backend
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._plain_lock = threading.Lock()
        self.pre = pre
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.eos_ids: set[int] = set(eos_ids)
        self.bos_id = bos_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._gguf_lists = gguf_lists
        added = backend.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._bytes_cache: dict[int, bytes] = {}

    # ----------------------------------------------------------------------------------------- loading

    @classmethod
    def from_gguf_metadata(cls, meta: dict, path: str = "<gguf>") -> Tokenizer:
        """Build from GGUF key/value metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(path, "tokenizer.ggml.model in the metadata", "no such key")
        model = _as_str(model)
        if model != "gpt2":
            raise UnsupportedModelError(
                f"{path}: tokenizer.ggml.model = {model!r} is not supported (only byte-level BPE 'gpt2')"
            )
        pre = _as_str(meta.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_PATTERNS:
            raise UnsupportedModelError(
                f"{path}: tokenizer.ggml.pre = {pre!r} is not supported (known: {', '.join(PRE_PATTERNS)})"
            )
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelFormatError(path, "tokenizer.ggml.tokens in the metadata", "no such key")
        tokens = [_as_str(t) for t in _as_list(meta["tokenizer.ggml.tokens"])]
        merges = [_as_str(m) for m in _as_list(meta.get("tokenizer.ggml.merges", []))]
        types_raw = meta.get("tokenizer.ggml.token_type")
        types = (
            [int(t) for t in _as_list(types_raw)] if types_raw is not None else [TOKEN_NORMAL] * len(tokens)
        )
        if len(types) != len(tokens):
            raise ModelFormatError(
                path,
                f"{len(tokens)} token types (one per token)",
                f"{len(types)} in tokenizer.ggml.token_type",
            )

        vocab: dict[str, int] = {}
        added_tokens = []
        for i, (text, ttype) in enumerate(zip(tokens, types)):
            if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                # Only CONTROL tokens are "special": llama.cpp still parses USER_DEFINED ones (e.g. <think>)
                # with parse_special off and prints them when told to drop specials, as HF does.
                added_tokens.append(
                    {
                        "id": i,
                        "content": text,
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "special": ttype == TOKEN_CONTROL,
                    }
                )
            else:
                vocab.setdefault(text, i)
        try:
            merge_pairs = [_split_merge(m) for m in merges]
        except ValueError as e:
            raise ModelFormatError(path, "merges of the form 'a b'", f"{str(e)!r}") from None

        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added_tokens,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": PRE_PATTERNS[pre]},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                ],
            },
            "post_processor": None,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": vocab,
                "merges": merge_pairs,
            },
        }
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # the library reports bad merges/vocab as a bare Exception
            raise ModelFormatError(path, "a consistent BPE vocabulary and merge list", str(e)) from None

        def meta_id(key: str) -> int | None:
            v = _as_int(meta.get(key))
            return v if v is not None and 0 <= v < len(tokens) else None

        eos_id = meta_id("tokenizer.ggml.eos_token_id")
        eos_ids = {
            i
            for i in (eos_id, meta_id("tokenizer.ggml.eot_token_id"), meta_id("tokenizer.ggml.eom_token_id"))
            if i is not None
        }
        eos_ids |= {backend.token_to_id(s) for s in EOG_TOKEN_STRINGS if backend.token_to_id(s) is not None}
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            pre=pre,
            vocab_size=len(tokens),
            eos_id=eos_id,
            eos_ids=eos_ids,
            bos_id=meta_id("tokenizer.ggml.bos_token_id"),
            pad_id=meta_id("tokenizer.ggml.padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=_as_str(template) if template is not None else None,
            gguf_lists=(tokens, types, merges),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ModelFormatError(str(folder), "a tokenizer.json file", "none")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:
            raise ModelFormatError(str(tj), "a Hugging Face tokenizers JSON file", str(e)) from None
        spec = json.loads(backend.to_str())
        if spec.get("model", {}).get("type") != "BPE":
            raise UnsupportedModelError(
                f"{tj}: tokenizer model {spec.get('model', {}).get('type')!r} is not BPE"
            )

        config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")

        def special_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos_id = special_id("eos_token")
        bos_id = special_id("bos_token")
        pad_id = special_id("pad_token")
        eos_ids = {eos_id} if eos_id is not None else set()
        gen_eos = gen_config.get("eos_token_id")
        if gen_eos is not None:
            eos_ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos])}
        if eos_id is None and gen_eos is not None:
            eos_id = int(gen_eos[0] if isinstance(gen_eos, list) else gen_eos)
        eos_ids |= {backend.token_to_id(s) for s in EOG_TOKEN_STRINGS if backend.token_to_id(s) is not None}

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # Llama-style tokenizers add BOS through the post-processor rather than a config flag.
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]

        template = _pick_template(config.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # transformers >= 4.43 saves the template next to the config
            template = jinja_file.read_text(encoding="utf-8")

        pre_tok = spec.get("pre_tokenizer") or {}
        pattern = None
        for p in pre_tok.get("pretokenizers", [pre_tok]):
            if p.get("type") == "Split":
                pattern = p.get("pattern", {}).get("Regex")
                break
        size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        return cls(
            backend,
            pre=_detect_pre(pattern),
            vocab_size=size,
            eos_id=eos_id,
            eos_ids=eos_ids,
            bos_id=bos_id,
            pad_id=pad_id,
            add_bos=add_bos,
            chat_template=template,
        )

    # ---------------------------------------------------------------------------------------- encoding

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_special prepends BOS where the model wants it; parse_special=False
        reads control-token text (e.g. `<|im_start|>`) as plain text."""
        backend = self._backend if parse_special else self._plain()
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def _plain(self) -> tokenizers.Tokenizer:
        # encode_special_tokens is a flag on the shared object; flipping it per call would race between
        # threads, so a second instance holds it on for good.
        with self._plain_lock:
            if self._plain_backend is None:
                plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain_backend = plain
            return self._plain_backend

    # ---------------------------------------------------------------------------------------- decoding

    def _token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        if skip_special and token_id in self.special_ids:
            return b""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            data = self._added[token_id].encode("utf-8")
        else:
            text = self.id_to_token(token_id)
            if text is None:
                data = b""  # ids past the tokenizer (padded embedding rows) have no text
            else:
                data = b"".join(
                    bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text
                )
        self._bytes_cache[token_id] = data
        return data

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character for some byte-level tokens)."""
        return self._token_bytes(int(token_id))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid or incomplete UTF-8 becomes U+FFFD (like HF and llama.cpp)."""
        data = b"".join(self._token_bytes(int(i), skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def new_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        """A fresh streaming decoder (one per request)."""
        return IncrementalDecoder(self, skip_special)

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    def id_to_token(self, i: int) -> str | None:
        if self._gguf_lists is not None:
            tokens = self._gguf_lists[0]
            return tokens[i] if 0 <= i < len(tokens) else None
        return self._backend.id_to_token(i) if i >= 0 else None

    # ----------------------------------------------------------------------------------------- writing

    def to_gguf_metadata(self) -> dict:
        """The `tokenizer.ggml.*` / `tokenizer.chat_template` keys a GGUF writer should store."""
        if self.pre not in PRE_PATTERNS:
            raise UnsupportedModelError(
                f"cannot name a GGUF pre-tokenizer for this tokenizer (detected {self.pre!r}; "
                f"known: {', '.join(PRE_PATTERNS)})"
            )
        if self._gguf_lists is not None:
            tokens, types, merges = (list(x) for x in self._gguf_lists)
        else:
            tokens, types, merges = self._lists_from_backend()
        meta: dict[str, Any] = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": bool(self.add_bos),
        }
        for key, value in (
            ("tokenizer.ggml.bos_token_id", self.bos_id),
            ("tokenizer.ggml.eos_token_id", self.eos_id),
            ("tokenizer.ggml.padding_token_id", self.pad_id),
        ):
            if value is not None:
                meta[key] = int(value)
        if self.chat_template is not None:
            meta["tokenizer.chat_template"] = self.chat_template
        return meta

    def _lists_from_backend(self) -> tuple[list[str], list[int], list[str]]:
        spec = json.loads(self._backend.to_str())
        tokens: list[str | None] = [None] * self.vocab_size
        types = [TOKEN_NORMAL] * self.vocab_size
        for text, i in spec["model"]["vocab"].items():
            tokens[i] = text
        for i, t in self._backend.get_added_tokens_decoder().items():
            tokens[i] = t.content
            types[i] = TOKEN_CONTROL if t.special else TOKEN_USER_DEFINED
        for i, text in enumerate(tokens):
            if text is None:  # holes get the placeholder convert_hf_to_gguf.py writes
                tokens[i] = f"[PAD{i}]"
                types[i] = TOKEN_UNUSED
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
        return tokens, types, merges  # type: ignore[return-value]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(str(path), "a JSON object", str(e)) from None
    return data if isinstance(data, dict) else {}


def _pick_template(value: Any) -> str | None:
    # tokenizer_config.json may hold a list of named templates; "default" is the chat one.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None
