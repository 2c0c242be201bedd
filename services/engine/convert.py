"""`specsplit convert`: Hugging Face safetensors folder -> GGUF with llama.cpp's names and conventions."""

from __future__ import annotations

import os

import gguf

from .config import gguf_metadata
from .formats import open_model_file
from .gguf_write import OUT_TYPES, pick_type, write_gguf
from .loader import hf_checkpoint
from .tokenizer import Tokenizer

_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}


def convert_hf_to_gguf(src: str, out: str, out_type: str = "f16") -> dict:
    """Convert `src` (folder with config.json + *.safetensors [+ tokenizer.json]) to the GGUF file `out`."""
    if out_type not in OUT_TYPES:
        raise ValueError(f"unknown output type '{out_type}'; choose one of {', '.join(OUT_TYPES)}")
    mf = open_model_file(src)
    if mf.kind != "safetensors":
        raise ValueError(f"{src}: is already a GGUF file; convert takes a Hugging Face safetensors folder")
    cfg, tensors = hf_checkpoint(mf)
    meta = gguf_metadata(cfg)
    meta["general.name"] = cfg.name
    meta["general.file_type"] = _FILE_TYPES[out_type]
    meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    folder = src if os.path.isdir(src) else os.path.dirname(src)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        tok = Tokenizer.from_hf_folder(folder)
        meta.update(tok.to_gguf_metadata())
        meta["tokenizer.ggml.pre"] = "qwen35" if cfg.arch == "qwen35" else "qwen2"
    qt = OUT_TYPES[out_type]
    typed = {name: (arr, pick_type(name, arr, qt)) for name, arr in sorted(tensors.items(), key=_tensor_order)}
    write_gguf(out, meta, typed)
    return {"arch": cfg.arch, "tensors": len(typed), "out": out, "type": out_type}


def _tensor_order(item):
    name = item[0]
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)
