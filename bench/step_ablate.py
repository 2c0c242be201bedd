"""What each non-product piece of a captured qwen35 step costs inside the step: the step's graph against graphs of
the same step with one piece left out (its launches skipped, its consumers reading a stale buffer), replays
interleaved in one process.

    python3 bench/step_ablate.py --model PATH.gguf [--widths 1 23] [--context 512] [--rounds 6] [--json OUT]

A piece's row is the step's replay time less the step's without it: its marginal cost where it sits, after the
overlap the step's programmatic dependent launches give it (what fusing it away could win at most; the kernels
around it move up). The outputs of a step without a piece are garbage; only its time is used. Pieces (PIECES):
the DeltaNet core (deltanet.decode_step at one token; wider, the tree walk alone: conv and gates stay), the attention
chain (q/k norm + RoPE, the KV store, attention), the residual-stream norm packs (pack_activations with a norm and
no gate: a step's input / post-attention norms where the products do not stage them), the SwiGLU pack and the
DeltaNet output norm-gate pack. A skipped pack keeps its first launch (its buffers, made once per shape, are what
its consumers then read). H100 results: docs/benchmarks.md, "Session 18".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_bench import device_name, json_saver, model_at_context  # noqa: E402


def _stale(fn: Callable, key: Callable[[tuple, dict], Any]) -> Callable:
    """fn that runs once per key and then hands back that first result without launching (key None: always runs)."""
    made: dict[Any, Any] = {}

    def wrapper(*args: Any, **kw: Any) -> Any:
        k = key(args, kw)
        if k is None:
            return fn(*args, **kw)
        if k not in made:
            made[k] = fn(*args, **kw)
        return made[k]

    return wrapper


def _empty_like_rows(cupy: Any, shape_of: Callable[[tuple, dict], tuple]) -> Callable:
    """A stand-in for a kernel launcher: an (uninitialised, reused) float32 output of the launcher's shape."""
    made: dict[tuple, Any] = {}

    def launcher(*args: Any, **kw: Any) -> Any:
        shape = shape_of(args, kw)
        if shape not in made:
            made[shape] = cupy.empty(shape, cupy.float32)
        return made[shape]

    return launcher


def _pack_key(kind: str) -> Callable[[tuple, dict], Any]:
    def key(args: tuple, kw: dict) -> Any:
        x = args[0]
        if kind == "norm":
            hit = kw.get("rms_weight") is not None and kw.get("gate") is None
        else:
            hit = kw.get(kind) is not None
        return (kind, tuple(x.shape), kw.get("residual") is not None) if hit else None

    return key


def _patches(piece: str, cupy: Any) -> list[tuple[Any, str, Any]]:
    """(object, attribute, stand-in) for each attribute a piece's removal replaces."""
    from kernels import attention as att
    from kernels import deltanet as dn
    from kernels import norm_rope as nr
    from kernels import quant_matmul as qm

    if piece == "deltanet core":
        return [(dn, "decode_step", _empty_like_rows(cupy, lambda a, kw: (1, int(a[7].shape[0]), int(a[7].shape[2])))),
                (dn, "gated_delta_tree", _empty_like_rows(
                    cupy, lambda a, kw: (int(a[0].shape[0]), int(a[5].shape[0]), int(a[5].shape[2]))))]
    if piece == "attention chain":
        return _patches("attention kernels", cupy) + [(nr, "qk_norm_rope", lambda q, k, *a, **kw: (q, k)),
                                                      (att.KVCacheLayer, "store", lambda self, *a, **kw: None)]
    if piece == "KV store":
        return [(att.KVCacheLayer, "store", lambda self, *a, **kw: None)]
    if piece == "q/k norm + RoPE":
        made: dict[tuple, Any] = {}

        def norm_rope(q: Any, k: Any, *a: Any, **kw: Any) -> tuple[Any, Any]:
            key = (tuple(q.shape), tuple(k.shape), str(q.dtype))
            if key not in made:  # contiguous outputs, as the kernel's: attention then copies nothing
                made[key] = (cupy.empty(q.shape, q.dtype), cupy.empty(k.shape, k.dtype))
            return made[key]

        return [(nr, "qk_norm_rope", norm_rope)]
    if piece == "attention kernels":  # (a one-token step's whole chain is the one decode_attention launch)
        return [(att, "attention", _empty_like_rows(cupy, lambda a, kw: tuple(a[0].shape))),
                (att, "decode_attention", _empty_like_rows(cupy, lambda a, kw: tuple(a[0].shape)))]
    kind = {"norm packs": "norm", "SwiGLU pack": "silu_up", "norm-gate pack": "gate"}[piece]
    return [(qm, "pack_activations", _stale(qm.pack_activations, _pack_key(kind)))]


PIECES = ("deltanet core", "attention chain", "norm packs", "SwiGLU pack", "norm-gate pack", "KV store",
          "q/k norm + RoPE", "attention kernels")


@contextlib.contextmanager
def without(piece: str | None, cupy: Any) -> Iterator[None]:
    """The step's launches with `piece` left out (None: the whole step); the originals are back on exit."""
    saved = []
    try:
        for obj, name, stand_in in ([] if piece is None else _patches(piece, cupy)):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, stand_in)
        yield
    finally:
        for obj, name, orig in reversed(saved):
            setattr(obj, name, orig)


def capture(model: Any, state: Any, width: int, rng: Any) -> Any:
    """The step's graph entry for `width` tokens (a chain of one, else step_profile's tree), captured now; the entry
    is kept by the caller so that its memory stays the graph's."""
    from step_profile import tree_parents

    toks = [int(t) for t in rng.integers(0, model.cfg.n_vocab, size=width)]
    par = tree_parents(width) if width > 1 else None
    state.graphs.clear()
    for _ in range(2):
        model.forward(state, toks, parents=par, checkpoints=par is not None, logits="all")
        state.pending = None
    entry = next(iter(state.graphs.values()))
    state.graphs.clear()
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a qwen35 GGUF (`specsplit make-synthetic` writes the 27B one)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 23])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds of 8 timed replays a graph")
    ap.add_argument("--pieces", nargs="+", choices=PIECES, default=list(PIECES), help="the pieces to leave out")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"step_ablate: skipped: {reason}")
        return 0
    cupy = loader.require()
    model, state, rng = model_at_context(args.model, args.context)
    rep: dict[str, Any] = {"device": device_name(cupy), "model": os.path.basename(args.model), "widths": {}}
    save = json_saver(rep, args.json, t0)
    entries: dict[tuple[int, str], Any] = {}
    for width in args.widths:
        for piece in (None, *args.pieces):
            with without(piece, cupy):
                entries[(width, piece or "step")] = capture(model, state, width, rng)
    times: dict[tuple[int, str], list[float]] = {k: [] for k in entries}
    stream = cupy.cuda.get_current_stream()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(args.rounds):
        for key, entry in entries.items():
            for _ in range(2):
                entry.graph.launch(stream)
            for _ in range(8):
                e0.record(stream)
                entry.graph.launch(stream)
                e1.record(stream)
                e1.synchronize()
                times[key].append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
    print(f"== bench/step_ablate.py on {rep['device']}: {rep['model']}, context {args.context}")
    for width in args.widths:
        step = statistics.median(times[(width, "step")])
        rows = {"step_us": step}
        print(f"width {width}: step {step:.1f} us")
        for piece in args.pieces:
            t = statistics.median(times[(width, piece)])
            rows[piece] = {"without_us": t, "cost_us": step - t}
            print(f"  {piece:16s} without {t:9.1f} us: costs {step - t:7.1f} us ({(step - t) / step:6.1%})")
        rep["widths"][str(width)] = rows
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
