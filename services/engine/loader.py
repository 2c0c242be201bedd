"""Load a target model (GGUF file or Hugging Face folder) with its tokenizer and chat template."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backend import NumpyBackend
from .chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from .config import ModelConfig, config_from_gguf
from .errors import ModelFormatError
from .formats import ModelFile, open_model_file
from .models import arch_from_hf_config, arch_module, model_class
from .models.base import TargetModel
from .models.hf_names import hf_text_config
from .sampling import hf_sampling_defaults, model_sampling_defaults
from .tokenizer import Tokenizer


@dataclass
class LoadedTarget:
    path: str
    cfg: ModelConfig
    model: TargetModel
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    file: ModelFile

    @property
    def name(self) -> str:
        return self.cfg.name or os.path.basename(os.path.normpath(self.path))

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling the model declares, the values of the fields a request leaves unset: a GGUF's
        general.sampling.* keys (as llama.cpp reads them), a Hugging Face folder's generation_config.json (as
        vLLM reads it)."""
        if self.file.kind == "gguf":
            return model_sampling_defaults(self.file.metadata)
        gen = Path(self.file.path if os.path.isdir(self.file.path) else os.path.dirname(self.file.path))
        gen = gen / "generation_config.json"
        if not gen.is_file():
            return {}
        try:
            data = json.loads(gen.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(str(gen), "a JSON object", f"unreadable JSON ({e})") from None
        return hf_sampling_defaults(data) if isinstance(data, dict) else {}


def hf_checkpoint(mf: ModelFile) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and llama.cpp-convention tensors of a Hugging Face folder (also what the converter writes)."""
    if not mf.metadata:
        raise ModelFormatError(mf.path, "a config.json beside the safetensors weights", "none")
    arch = arch_from_hf_config(mf.metadata, mf.path)
    mod = arch_module(arch)
    cfg = mod.config_from_hf(hf_text_config(mf.metadata))
    cfg.name = os.path.basename(os.path.normpath(mf.path))
    tensors = mod.tensors_from_hf(cfg, {n: t.dequantize() for n, t in mf.tensors.items()})
    return cfg, tensors


def config_of(mf: ModelFile) -> ModelConfig:
    if mf.kind == "gguf":
        emb = mf.tensors.get("token_embd.weight")
        return config_from_gguf(mf.metadata, n_vocab=emb.shape[0] if emb is not None else None, path=mf.path)
    return hf_checkpoint(mf)[0]


@dataclass
class TargetHead:
    """What a drafter reads of its target, without the target's blocks: the config, the token table and the LM
    head. The drafter service's target: a 27B's blocks would be ~100 GB of float32 as the NumPy engine holds them,
    and minutes to dequantize, for nothing it uses."""
    cfg: ModelConfig
    tok_embd: Any       # as NumpyBackend.embedding keeps it: packed, rows dequantized on lookup
    output: Any         # float32 (out, in) for the NumPy drafter, or the RawTensor as stored (packed=True)
    be: NumpyBackend
    source: str


def load_target_head(path: str, packed: bool = False) -> TargetHead:
    """The token table and LM head of a target file (GGUF or HF folder). packed: the LM head as stored, for a GPU
    drafter that uploads it in its quantized form (as the target's own GPU model does); else float32."""
    mf = open_model_file(path)
    if mf.kind == "gguf":
        cfg = config_of(mf)
        arch_module(cfg.arch)
        tensors: Any = mf.tensors
    else:
        cfg, tensors = hf_checkpoint(mf)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFormatError(mf.path, f"tensor 'token_embd.weight' ({cfg.arch})",
                               f"it missing ({len(tensors)} tensors in the file)")
    out = tensors.get("output.weight")
    out = emb if out is None else out       # tied embeddings
    be = NumpyBackend()
    return TargetHead(cfg, be.embedding(emb), out if packed else be.weight(out), be, mf.path)


def load_target(path: str, backend: NumpyBackend | None = None, with_tokenizer: bool = True) -> LoadedTarget:
    mf = open_model_file(path)
    if mf.kind == "gguf":
        emb = mf.tensors.get("token_embd.weight")
        cfg = config_from_gguf(mf.metadata, n_vocab=emb.shape[0] if emb is not None else None, path=mf.path)
        arch_module(cfg.arch)
        tensors = mf.tensors
    else:
        cfg, tensors = hf_checkpoint(mf)
    model = model_class(cfg.arch)(cfg, tensors, backend, source=mf.path)
    tok, tmpl = None, None
    if with_tokenizer:
        tok = _tokenizer_of(mf)
        if tok is not None:
            tmpl = ChatTemplate(tok.chat_template or DEFAULT_CHATML_TEMPLATE,
                                bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
                                eos_token=_eos_text(tok))
    return LoadedTarget(path=path, cfg=cfg, model=model, tokenizer=tok, chat_template=tmpl, file=mf)


def _tokenizer_of(mf: ModelFile) -> Tokenizer | None:
    if mf.kind == "gguf":
        if "tokenizer.ggml.tokens" not in mf.metadata:
            return None
        return Tokenizer.from_gguf_metadata(mf.metadata, path=mf.path)
    folder = mf.path if os.path.isdir(mf.path) else os.path.dirname(mf.path)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return Tokenizer.from_hf_folder(folder)
    return None


def _eos_text(tok: Tokenizer) -> str:
    for s in ("<|im_end|>", "<|endoftext|>"):
        if tok.token_to_id(s) is not None:
            return s
    return ""
