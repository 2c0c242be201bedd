"""Byte-level BPE with the Qwen3.5 pre-tokenizer, trained on the code corpus.

Layout: NFC normalizer; Split(Qwen3.5 regex, isolated) + ByteLevel(add_prefix_space=False, use_regex=False);
ByteLevel decoder. The specials `<|endoftext|>` (document separator, pad), `<|im_start|>`, `<|im_end|>`
(chat turns) and `<|MASK|>` (the DFlash drafter's mask token) are special tokens; `<think>` and
`</think>` are added non-special tokens, as in Qwen3.5. The vocabulary size includes all of them.

Writes tokenizer.json, tokenizer_config.json (ChatML template with enable_thinking, eos `<|im_end|>`,
pad `<|endoftext|>`) and generation_config.json (eos ids: both `<|im_end|>` and `<|endoftext|>`, so a
code completion stops at the end of a file and a chat reply at the end of its turn).

    python -m tools.train.tokenizer --corpus DIR --out DIR [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from services.engine.chat_template import CHATML_MESSAGES

from .common import log

QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
SPECIALS = [EOT, IM_START, IM_END, MASK]
ADDED = ["<think>", "</think>"]

# ChatML; the generation prompt opens the think block the Qwen3.5 way (enable_thinking false closes it).
CHAT_TEMPLATE = CHATML_MESSAGES + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _sample(docs: Sequence[str], max_bytes: int) -> Iterator[str]:
    total = 0
    for d in docs:
        if total >= max_bytes:
            return
        total += len(d)
        yield d


def _byte_level_bpe(model):
    """A `tokenizers` Tokenizer around a BPE model with this layout: NFC, Qwen3.5 split + byte level."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(docs: Sequence[str], vocab_size: int = 4096, sample_mb: float = 24.0,
                    min_frequency: int = 2, max_token_length: int | None = 24):
    """Train on the first sample_mb of docs (already in a random order); vocab_size counts the specials."""
    from tokenizers import AddedToken, models, pre_tokenizers, trainers

    n_extra = len(SPECIALS) + len(ADDED)
    tok = _byte_level_bpe(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_extra, min_frequency=min_frequency, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=max_token_length)
    tok.train_from_iterator(_sample(docs, int(sample_mb * 1e6)), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def tokenizer_from_gguf(path: str | os.PathLike[str]):
    """The `tokenizers` object of a GGUF's byte-level BPE vocabulary (the layout `train_tokenizer` makes).

    For training a drafter against a shipped target: the token ids must be the target's own.
    """
    from tokenizers import AddedToken, models

    from services.engine.formats import open_model_file

    meta = open_model_file(str(path)).metadata
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") not in ("qwen35", "qwen2"):
        raise ValueError(f"{path}: tokenizer {meta.get('tokenizer.ggml.model')}/{meta.get('tokenizer.ggml.pre')} is "
                         "not the byte-level BPE with the Qwen pre-tokenizer this trainer uses")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    merges = [tuple(str(m).split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    tok = _byte_level_bpe(models.BPE(vocab=normal, merges=merges))
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 1:
            continue
        if i != tok.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"{path}: added token {t!r} at id {i} is not after the BPE vocabulary")
        if ty == 3:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
    if [tok.id_to_token(i) for i in range(len(tokens))] != tokens:
        raise ValueError(f"{path}: the rebuilt tokenizer does not reproduce the GGUF's token ids")
    return tok


def tokenizer_difference(tok, path: str | os.PathLike[str]) -> str | None:
    """None when the GGUF at `path` holds exactly `tok` (same ids, merges and added tokens), else what differs.

    For continuing a target (`--init-target`): the corpus must be tokenized into the ids it was trained on.
    """
    try:
        theirs = tokenizer_from_gguf(path)
    except ValueError as e:
        return str(e)
    mine_ids = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    their_ids = [theirs.id_to_token(i) for i in range(theirs.get_vocab_size())]
    if len(mine_ids) != len(their_ids):
        return f"its vocabulary has {len(their_ids)} tokens, this one {len(mine_ids)}"
    diff = [i for i, (a, b) in enumerate(zip(mine_ids, their_ids)) if a != b]
    if diff:
        i = diff[0]
        return (f"{len(diff)} of {len(mine_ids)} token ids differ (first: id {i} is {their_ids[i]!r} there, "
                f"{mine_ids[i]!r} here)")

    def parts(t) -> tuple[list, list]:
        j = json.loads(t.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
        added = [(a["id"], a["content"], a["special"]) for a in j["added_tokens"]]
        return merges, added

    (m1, a1), (m2, a2) = parts(tok), parts(theirs)
    if m1 != m2:
        i = next((k for k, (x, y) in enumerate(zip(m1, m2)) if x != y), min(len(m1), len(m2)))
        return f"the BPE merges differ ({len(m2)} there, {len(m1)} here; first difference at merge {i})"
    if a1 != a2:
        return f"the added tokens differ ({a2} there, {a1} here)"
    return None


def save_tokenizer(tok, folder: str | os.PathLike[str]) -> dict:
    """tokenizer.json + tokenizer_config.json + generation_config.json; returns the special ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS + ADDED}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in SPECIALS} for t in SPECIALS + ADDED}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "add_bos_token": False,
        "eos_token": IM_END, "pad_token": EOT, "mask_token": MASK,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [ids[IM_END], ids[EOT]], "pad_token_id": ids[EOT], "bos_token_id": None,
    }, indent=1))
    return ids


def encode_docs(tok, docs: Sequence[str], eot_id: int, batch: int = 512) -> np.ndarray:
    """Token stream of docs, each followed by <|endoftext|> (uint16; the vocabulary is < 65536)."""
    if tok.get_vocab_size() > 65535:
        raise ValueError("vocabulary too large for uint16 token storage")
    parts: list[np.ndarray] = []
    eot = np.array([eot_id], dtype=np.uint16)
    for s in range(0, len(docs), batch):
        for enc in tok.encode_batch(list(docs[s:s + batch]), add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(eot)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def main(argv: list[str] | None = None) -> None:
    from tokenizers import Tokenizer  # noqa: F401  (fail early without the package)

    from .corpus import read_docs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="folder with train.txt (tools.train.corpus)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--sample-mb", type=float, default=24.0)
    a = ap.parse_args(argv)
    docs = read_docs(Path(a.corpus) / "train.txt")
    tok = train_tokenizer(docs, a.vocab, a.sample_mb)
    ids = save_tokenizer(tok, a.out)
    log(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids} -> {a.out}")


if __name__ == "__main__":
    main()
