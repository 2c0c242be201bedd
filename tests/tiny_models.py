"""A tiny target (qwen35 GGUF with a trained byte-level BPE tokenizer and chat template) and its DFlash
drafter, written to disk the way users have them; shared by the CLI, speculative and service tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from services.engine.chat_template import DEFAULT_CHATML_TEMPLATE

QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "你好，世界！ 😀 café",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]


def train_tokenizer(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


def write_tokenizer(folder: Path, tok: Tokenizer) -> None:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "chat_template": DEFAULT_CHATML_TEMPLATE,
    }))


def make_tiny_pair(folder: Path, seed: int = 0, drafter_layers: int = 2) -> tuple[str, str, str]:
    """Write hf/ (qwen3_5 + tokenizer), target.gguf and drafter/ (z-lab layout); return their paths."""
    from services.engine.convert import convert_hf_to_gguf
    from services.engine.loader import load_target
    from tests.dflash_models import make_zlab_drafter
    from tests.hf_models import make_hf_model

    folder = Path(folder)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    hf = folder / "hf"
    make_hf_model("qwen35", hf, seed=seed, vocab_size=vocab, num_hidden_layers=4)
    write_tokenizer(hf, tok)
    gguf_path = folder / "target.gguf"
    convert_hf_to_gguf(str(hf), str(gguf_path), "f32")
    target = load_target(str(gguf_path), with_tokenizer=False).model
    drafter = make_zlab_drafter(folder / "drafter", target.cfg, n_layer=drafter_layers, block_size=16,
                                target_layer_ids=[0, 2], seed=seed, mask_token_id=tok.token_to_id("<|MASK|>"))
    return str(hf), str(gguf_path), str(drafter)
