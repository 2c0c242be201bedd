"""A speculative request's prompt up to its first verify, with the prompt's features handed to the drafter as its
chunks commit (append_features: on the device beside a GPU target) against gathered and sent with the first draft
(the path of a proposer without appends: through the host), in one process; prints the ratio.

    python3 bench/prompt_features.py --model T.gguf --draft D.gguf [--device cuda:0] [--prompts 512 2048 8192]

With --drafter ADDR (a running `specsplit drafter`) instead of --draft: the same request with that service as the
drafter, its features on the wire as f32 against f16 (`--draft-features`; inline over TCP, shared memory over a unix
socket), the prompt's in appends either way; prints f16 / f32.

Each round runs both paths on a pooled state and session as a request gets them, the device idle before and drained
after; medians over --reps rounds after a warm one (captures, kernel fetches). Random prompt tokens, budget 22.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WithoutAppends:
    """A proposer's propose() alone: speculative_stream then gathers the prompt's features and sends them with the
    first draft."""

    def __init__(self, inner: Any):
        self.inner, self.block_size, self.target_layer_ids = inner, inner.block_size, inner.target_layer_ids

    def propose(self, *a: Any) -> Any:
        return self.inner.propose(*a)

    def close(self) -> None:
        self.inner.close()


def to_first_verify(model: Any, proposer: Any, ids: list[int], sync: Any) -> float:
    """Seconds from an idle device to the first verify's tokens: the prompt, its root token, one draft, one verify."""
    from services.engine.generate import GenerationResult
    from services.engine.speculative import SpecConfig, speculative_stream

    res = GenerationResult()
    sync()
    t0 = time.perf_counter()
    gen = speculative_stream(model, proposer, ids, 3, spec=SpecConfig(budget=22), result=res)
    try:
        next(gen)      # the prompt and its root token
        next(gen)      # the first draft and verify
        sync()
        return time.perf_counter() - t0
    finally:
        gen.close()


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", help="an in-process drafter (appends against features with the first draft)")
    ap.add_argument("--drafter", help="a drafter service's address (its features as f32 against f16)")
    ap.add_argument("--device", default="cuda:0", help="the target's and drafter's device (cpu: the NumPy engine)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if bool(args.draft) == bool(args.drafter):
        ap.error("give --draft (an in-process drafter) or --drafter (a drafter service's address)")

    from services.engine.placement import load_drafter_on, load_target_on

    model = load_target_on(args.model, args.device, with_tokenizer=False).model
    if args.drafter:
        from services.drafter.client import DrafterClient

        def client(dtype: str) -> Any:
            return DrafterClient(args.drafter, feature_dtype=dtype, wait_ready=True, ready_timeout=600)

        paths = {"f32": lambda: client("f32"), "f16": lambda: client("f16")}
        where = f"drafter service {args.drafter}, {client('f32').transport}"
    else:
        loaded = load_drafter_on(args.draft, model, args.device)
        paths = {"appends": loaded.new_proposer, "first_draft": lambda: WithoutAppends(loaded.new_proposer())}
        where = f"{loaded.device} drafter"
    a_name, b_name = paths
    sync: Any = lambda: None  # noqa: E731
    name = "CPU (NumPy)"
    if args.device.startswith("cuda"):
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        sync = cupy.cuda.Device().synchronize
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rng = np.random.default_rng(1)
    out: dict[int, dict[str, float]] = {}
    for n in args.prompts:
        ids = rng.integers(0, model.cfg.n_vocab, n).tolist()
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(args.reps + 1):
            for how, make in paths.items():
                prop = make()
                try:
                    dt = to_first_verify(model, prop, ids, sync)
                finally:
                    prop.close()
                if r:
                    times[how].append(dt)
        a, f = (statistics.median(times[k]) for k in paths)
        out[n] = {f"{a_name}_ms": round(a * 1e3, 2), f"{b_name}_ms": round(f * 1e3, 2), "ratio": round(f / a, 3)}
        if args.drafter:
            print(f"prompt {n}: to the first verify {a * 1e3:.1f} ms with f32 features on the wire, {f * 1e3:.1f} ms "
                  f"with f16; f16 / f32 {f / a:.3f}", flush=True)
        else:
            print(f"prompt {n}: to the first verify {a * 1e3:.1f} ms with the features appended as the chunks "
                  f"commit, {f * 1e3:.1f} ms gathered for the first draft; first draft / appends {f / a:.3f}",
                  flush=True)
    print(f"({name}, {os.path.basename(args.model)}, {where}, median of {args.reps})")
    return out


if __name__ == "__main__":
    main()
