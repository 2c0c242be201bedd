"""What the GPU benches share: the model-source flags, the device's name, and a qwen35 GGUF loaded onto the GPU."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any


def add_model_source(ap: argparse.ArgumentParser, what: str = "the synthetic file") -> None:
    """--model PATH | --make-synthetic DIR, with --shape and --layers for the synthetic file."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an existing qwen35 GGUF")
    src.add_argument("--make-synthetic", metavar="DIR", help=f"write {what} into DIR first")
    ap.add_argument("--shape", default="qwen3.6-27b", help="synthetic shape (tiny: a smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="synthetic blocks (real widths, fewer layers)")


def json_saver(rep: dict[str, Any], path: str | None, t_start: float) -> Callable[[], None]:
    """A save() that stamps the elapsed seconds into `rep` and rewrites it at `path` (nothing without a path),
    so a run cut short by its deadline still leaves what it measured."""

    def save() -> None:
        rep["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(rep, f, indent=1, default=str)

    return save


def device_name(cupy: Any) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def load_gpu_model(path: str) -> tuple[Any, Any, dict[str, float]]:
    """(Qwen35GpuModel on cuda:0, the opened model file, {header_s, load_s}): the header parse (a 248k-token
    vocabulary in Python) timed apart from the weights' upload."""
    from services.engine import loader as ld
    from services.engine.backend import CupyBackend
    from services.engine.models.qwen35_gpu import Qwen35GpuModel

    t0 = time.perf_counter()
    mf = ld.open_model_file(path)
    header_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    emb = mf.tensors["token_embd.weight"]
    cfg = ld.config_from_gguf(mf.metadata, n_vocab=emb.shape[0], path=mf.path)
    model = Qwen35GpuModel(cfg, mf.tensors, CupyBackend(0), source=mf.path)
    import cupy

    cupy.cuda.Device().synchronize()
    return model, mf, {"header_s": round(header_s, 1), "load_s": round(time.perf_counter() - t0, 1)}


def model_at_context(path: str, context: int, room: int = 64, seed: int = 0) -> tuple[Any, Any, Any]:
    """(model, state, rng) for timing steps: load_gpu_model, a state for context + room tokens holding `context`
    committed random tokens, and the generator that drew them (for the step's own tokens)."""
    import numpy as np

    model, _, _ = load_gpu_model(path)
    rng = np.random.default_rng(seed)
    state = model.new_state(context + room)
    ids = rng.integers(0, model.cfg.n_vocab, size=context)
    model.forward(state, ids, logits="none")
    state.commit(list(range(len(ids))))
    return model, state, rng
