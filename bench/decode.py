"""Decode timing of the GPU engine on a Qwen3.6-27B-shaped target (`make-synthetic`: Q4_K_M, Q5_K_M, IQ4_XS, Q4_0 or
IQ4_NL; or any GGUF file of that architecture): verify-width curve, plain decode vs the
copy-bandwidth roofline, and a forced-acceptance projection of speculative tokens/s, all measured in one run;
with --drafter, the DFlash drafter on the same GPU too (models/dflash_gpu.py): one drafter pass (block 16, one
CUDA graph replay) against the width-23 verify step, and the whole speculative loop with forced acceptance.

    python3 bench/decode.py --make-synthetic DIR [--layers N] [--drafter] [--json OUT]   # write the files first
    python3 bench/decode.py --model PATH.gguf [--draft DRAFTER.gguf] [--json OUT]
    python3 bench/decode.py --model PATH.gguf --draft DRAFTER.gguf --drafter-service unix:///tmp/d.sock
        # with `specsplit drafter --model PATH.gguf --draft DRAFTER.gguf --device cuda:1 --listen unix:///tmp/d.sock`

Roofline tokens/s = device copy bandwidth (bench/roofline.py's copy_bandwidth: bytes read + written by a
device-to-device copy) / bytes of weights read per decode step. Counted: every quantized matrix of the blocks
and the LM head (output.weight); not counted: token_embd (one row per token is read) and the F32 vectors (norms,
conv taps, gates; listed separately, < 0.1 %). With --layers N < 64 (real widths, fewer blocks) the per-block
time is scaled to the 64-block model explicitly: t64 = t_head + t_blocks * 64 / N, where t_blocks is the pass
without logits and t_head = t(logits) - t(no logits) (final norm, LM head, copy of the logits to the host).
The forward passes are the engine's own (models/qwen35_gpu.py, logits copied to the host), so the numbers
include its Python and launch overhead: --graphs (default) replays captured CUDA graphs, --no-graphs launches
eagerly, --graphs-compare measures both in one run (eager first). In the graphs mode each width's captured verify
graph is also replayed alone (`verify_replay_ms`, `verify_replay_rel`: the device's part, without the host's share,
which moves the width-1 pass most).

Drafter timing (measured in the graphs mode): `pass_replay_ms` is the captured pass alone (append of 3 context rows,
the 16-token block, LM head over 15 rows, top-8 log-softmax; graph launch to device idle), `pass_api_ms` the
whole draft_topk call (per-step values and features uploaded, top-8 ids / log-probs downloaded), `pass_eager_ms`
the same pass launched eagerly; `ratio_to_verify23` = pass_replay / width-23 verify (the issue's target: <= 0.15;
`_scaled` against the verify scaled to the full block count). The drafter keeps its full 5 layers when the target
is shortened. `long_context` repeats the pass past the sliding window (2048), where the 4 sliding layers' attention
reads only their window's tiles (the kernel's `window`); there `ratio_to_verify23` still divides by the
verify at `--context`, and `ratio_to_verify23_at_ctx` (`_replay_at_ctx`: graph against graph) by a width-23 verify
measured at the same long context. The speculative loop (`spec_loop`): per
step draft_topk (k=8) -> DDTree of 22 nodes -> tree verify (23 tokens, checkpoints, captured features, all logits)
-> greedy argmax of the rows -> commit of a forced path of a tokens (root + the top-1 chain's first a-1 nodes)
-> next draft from those features; in the engine's order (`spec_loop`) that draft is queued before the commit
(speculative.begin_propose, the host building the next tree while the commit runs), and `spec_loop_serial` runs the
same steps one after another, each from an idle device. Its
`outside_kernels_ms` = step - the loop's own drafter, verify and commit graphs each replayed alone: the loop's work
outside kernels (Python, uploads and downloads, tree build, argmax, graph launches). With --drafter-service ADDR
the same loop (the engine's order) runs with a DrafterClient of that running drafter service as its proposer: its
draft is the features' trip out, the service's pass and the top-k's trip back (`vs_in_process`: its tok/s over the
in-process drafter's at the same acceptance length, in the same run). With DECODE_PROFILE=PATH
the last acceptance length runs PROFILE_STEPS more steps under cProfile after its timed ones (stats to PATH).

Prompt processing (`--prompts`, llama-bench's "pp n"; ../shared/reference/peer_baseline.md has the peer's): a prompt
of n tokens from an empty context through generate.prefill as a request runs it (on a GPU model its chunks are graph
steps: qwen35_gpu.PROMPT_GRAPHS), in ms, tokens/s and decode steps (the plain decode's tokens/s inverted, the peer's
"batch / decode step"); beside it, in the same rounds, the same prompt in eager 512-token chunks (the knob off) as the
host's enqueue time plus what the device still had to do after it, and eager / served.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_bench import add_model_source, device_name, json_saver, load_gpu_model  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 23, 32, 41, 64)
ACCEPT = (2, 3, 4, 6)
PROMPTS = (32, 128, 512, 2048)
SPEC_WIDTH = 23
SERVICE_READY_S = 60.0     # how long a --drafter-service may take to say it is serving
PROFILE_STEPS = 20
REPLAYS = 20             # width_curve: replays of each captured verify graph (median)
WARM_STEPS = 4           # spec_loop's untimed first row
COPY_BYTES = 4 << 30


class _Skip(Exception):
    """A part left out by a flag."""


def _err() -> str:
    import traceback

    return traceback.format_exc()[-1500:]


def precompile_matmul(workers: int, qtypes: tuple[int, ...]) -> dict[str, Any]:
    """Build the v2 matmul kernels (all token tiles, 1 and 2 m-tiles) in worker processes, filling CuPy's disk
    cache while the synthetic file is being written (NVRTC builds one kernel at a time per process)."""
    import roofline

    jobs: list[tuple] = [("pack", f32, False) for f32 in (False, True)]
    jobs += [("v2", q, nt, mt, 0, False) for q in qtypes for nt in range(1, 9) for mt in (1, 2)]
    try:
        return {"kernels": len(jobs), "seconds": round(roofline.precompile(jobs, workers), 1)}
    except Exception:  # the main process then compiles on first use: slower, still correct
        return {"error": _err()}


def weight_bytes(tensors: dict[str, Any]) -> dict[str, int]:
    """Bytes read per decode step by kind: block matrices, LM head; F32 vectors and the token table apart."""
    out = {"blocks": 0, "head": 0, "f32_vectors": 0, "token_embd": 0}
    for name, t in tensors.items():
        n = int(getattr(t, "nbytes", 0) or np.asarray(t.data).nbytes)
        if name == "token_embd.weight":
            out["token_embd"] += n
        elif int(t.qtype) == 0:  # F32: norms, conv taps, ssm_a / dt
            out["f32_vectors"] += n
        elif name == "output.weight":
            out["head"] += n
        else:
            out["blocks"] += n
    return out


def full_shape_bytes(shape: str, layers: int) -> dict[str, int]:
    """weight_bytes of the unshortened synthetic shape, from its tensor plan (no file written)."""
    from services.engine import synthetic as syn

    sh = syn.get_shape(shape)
    specs = syn.target_tensors(sh.target, "q4_k_m", sh.type_layers)
    assert sh.target.n_layer == layers, (sh.target.n_layer, layers)
    out = {"blocks": 0, "head": 0, "f32_vectors": 0, "token_embd": 0}
    for s in specs:
        key = ("token_embd" if s.name == "token_embd.weight" else "f32_vectors" if s.qtype.name == "F32"
               else "head" if s.name == "output.weight" else "blocks")
        out[key] += s.nbytes
    return out


class Timer:
    """Wall time of one forward pass with the device idle before and drained after (logits='none' returns
    before its launches finish)."""

    def __init__(self, cupy):
        self.cupy = cupy

    def __call__(self, fn) -> tuple[float, Any]:
        self.cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        r = fn()
        self.cupy.cuda.Device().synchronize()
        return time.perf_counter() - t0, r


def prefill(model, state, ids: np.ndarray) -> None:
    model.forward(state, ids, logits="none")
    state.commit(list(range(len(ids))))


def width_curve(model, timer: Timer, context: int, reps: int, widths, deadline: float) -> dict[str, Any]:
    """Median seconds of a width-w verify (chain, checkpoints, logits for every row) and of the same pass
    without logits, after `context` committed tokens; rounds over all widths so drift hits all alike."""
    rng = np.random.default_rng(0)
    n_vocab = model.cfg.n_vocab
    state = model.new_state(context + max(widths) + 8)
    prefill(model, state, rng.integers(0, n_vocab, size=context))
    toks = rng.integers(0, n_vocab, size=max(widths))
    runs: dict[str, dict[int, list[float]]] = {"all": {w: [] for w in widths}, "none": {w: [] for w in widths}}
    done = 0
    for r in range(reps + 1):                       # round 0 warms: remaining kernel builds, allocations
        if r > 1 and time.perf_counter() > deadline:
            break
        for w in widths:
            for lg in ("all", "none"):
                dt, _ = timer(lambda: model.forward(state, toks[:w], checkpoints=True, logits=lg))  # noqa: B023
                state.pending = None                # nothing committed: every pass sees the same context
                if r:
                    runs[lg][w].append(dt)
        done = r
    med = {lg: {w: statistics.median(v) for w, v in d.items() if v} for lg, d in runs.items()}
    # each width's captured verify graph replayed alone: the device's part of the pass, steadier than the pass
    # through the API (whose host share moves the width-1 time most)
    replay = {}
    for w in widths:
        g = next((g for k, g in getattr(state, "graphs", {}).items()
                  if isinstance(k, tuple) and len(k) > 3 and k[0] == w and k[3] == "all"), None)  # fmt: skip
        if g is not None:
            replay[w] = _replay_s(g.graph, timer, REPLAYS)
    return {"rounds": done, "verify_s": med["all"], "blocks_s": med["none"], "replay_s": replay}


def plain_decode(model, n_tokens: int, context: int, rounds: int = 3) -> dict[str, Any]:
    """Greedy decode through services.engine.generate (prefill of `context` tokens, then one token per pass): as
    served (a GPU model decodes a step ahead of the host), one step at a time (the host reads each token before the
    next step: decode_ahead_on off), and the device's bound: the decode step's graph and its commit's replayed back
    to back with no host work between them. Interleaved rounds, medians. Rates are decode passes a second: the
    tokens after the first (which the prompt's pass gives) over the decode time; the served response's
    predicted_per_second counts the first too (llama.cpp's convention: n / (n - 1) passes, 1.6 % more at 64)."""
    from services.engine.generate import generate

    ids = list(np.random.default_rng(1).integers(0, model.cfg.n_vocab, size=context))
    generate(model, ids, 4)                          # warm: the decode-shaped launches
    ahead = hasattr(model, "decode_ahead_on")
    runs: dict[str, list[float]] = {"tps": [], "step_tps": [], "replay_tps": []}
    res = None

    def rate(r) -> float:
        return (len(r.token_ids) - 1) / (r.decode_ms / 1e3)

    for _ in range(rounds):
        res = generate(model, ids, n_tokens)
        runs["tps"].append(rate(res))
        if ahead:
            model.decode_ahead_on = False
            try:
                runs["step_tps"].append(rate(generate(model, ids, n_tokens)))
            finally:
                model.decode_ahead_on = True
        for k, v in _decode_replay_tps(model, context, n_tokens).items():
            runs.setdefault(k, []).append(v)
    out = {"tokens": len(res.token_ids), "prompt_ms": round(res.prompt_ms, 1), "rounds": rounds}
    out.update({k: round(statistics.median(v), 2) for k, v in runs.items() if v})
    for k in ("step_tps", "replay_tps", "ahead_replay_tps"):
        if k in out:
            out[f"tps_over_{k}"] = round(out["tps"] / out[k], 4)
    return out


def _decode_replay_tps(model, context: int, n: int) -> dict[str, float]:
    """Tokens/s of graphs replayed n times back to back, no host work between them: replay_tps, the decode step's
    graph + its commit's (one step at a time); ahead_replay_tps, decode_ahead's graph (step, commit and the next
    step's values in one). Empty without graphs."""
    try:
        import cupy
    except ImportError:
        return {}
    st = model.acquire_state(context + n + 16) if hasattr(model, "acquire_state") else None
    if st is None or not hasattr(st, "graphs"):
        return {}
    out = {}
    stream = cupy.cuda.get_current_stream()

    def timed(graphs) -> float:
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            for g in graphs:
                g.launch(stream)
        stream.synchronize()
        return n / (time.perf_counter() - t0)

    try:
        prefill(model, st, np.random.default_rng(2).integers(0, model.cfg.n_vocab, size=context))
        for _ in range(2):
            model.forward(st, [1], logits="last")
            st.commit([0])
        step = next((g for k, g in st.graphs.items() if k[:5] == (1, True, False, "last", ()) and len(k) == 6), None)
        commit = st.commit_graphs.get((1, True, False))
        if step is not None and commit is not None:
            out["replay_tps"] = timed([step.graph, commit])
        if getattr(model, "can_decode_ahead", lambda _: False)(st):
            for _ in model.decode_ahead(st, 1, 2):   # its graph (each replay then advances S by one on the device)
                pass
            ahead = next((g for k, g in st.graphs.items() if k[-1] == "ahead"), None)
            if ahead is not None:
                out["ahead_replay_tps"] = timed([ahead.graph])
    finally:
        model.release_state(st)
    return out


def prompt_processing(model, lengths, reps: int, deadline: float, sync=None) -> dict[int, dict]:
    """A prompt of n tokens from an empty context as a request runs it (generate.prefill: the model's chunks, on a
    GPU model with graphs its graph steps: qwen35_gpu.PROMPT_GRAPHS; the last position's logits to the host),
    llama-bench's "pp n": median wall ms over `reps` rounds after a warm-up one, each on a pooled state as a request
    gets. Beside it in the same rounds, where the model has prompt graphs: the same prompt in eager
    generate.PREFILL_CHUNK-token chunks (what a request ran before them), eager_host_ms the time to put them in the
    stream (forward + commit, no logits, no wait) and eager_drain_ms what the device still had to do then (near 0:
    the host is the bound). sync: waits for the device (default: CuPy's, when there is a GPU)."""
    from services.engine.generate import PREFILL_CHUNK as chunk
    from services.engine.generate import prefill as serve_prefill

    if sync is None:
        import cupy

        sync = cupy.cuda.Device().synchronize
    mod = sys.modules.get(type(model).__module__)
    graphs_knob = hasattr(mod, "PROMPT_GRAPHS") and getattr(model, "use_graphs", False)
    rng = np.random.default_rng(3)
    out: dict[int, dict] = {}
    for n in lengths:
        if out and time.perf_counter() > deadline:
            break
        ids = rng.integers(0, model.cfg.n_vocab, size=n)
        walls, hosts, drains = [], [], []
        for r in range(reps + 1):
            for how in ("serve", "eager") if graphs_knob else ("serve",):
                st = model.acquire_state(n + 8) if hasattr(model, "acquire_state") else model.new_state(n + 8)
                keep = getattr(mod, "PROMPT_GRAPHS", None)
                try:
                    sync()
                    t0 = time.perf_counter()
                    if how == "serve":
                        serve_prefill(model, st, ids)
                        t1 = time.perf_counter()
                    else:
                        mod.PROMPT_GRAPHS = False
                        for s in range(0, n, chunk):
                            part = ids[s:s + chunk]
                            model.forward(st, part, logits="none")
                            st.commit(range(len(part)))
                        t1 = time.perf_counter()
                        sync()
                    t2 = time.perf_counter()
                finally:
                    if how == "eager":
                        mod.PROMPT_GRAPHS = keep
                    if hasattr(model, "release_state"):
                        model.release_state(st)
                if r:
                    if how == "serve":
                        walls.append(t1 - t0)
                    else:
                        hosts.append(t1 - t0)
                        drains.append(t2 - t1)
        med = statistics.median(walls)
        out[n] = {"ms": round(med * 1e3, 2), "tps": round(n / med, 1)}
        if hosts:
            eager = statistics.median(h + d for h, d in zip(hosts, drains))
            out[n].update(eager_ms=round(eager * 1e3, 2), eager_host_ms=round(statistics.median(hosts) * 1e3, 2),
                          eager_drain_ms=round(statistics.median(drains) * 1e3, 2),
                          eager_over_served=round(eager / med, 3))
    return out


def forced_acceptance(model, timer: Timer, context: int, steps: int, deadline: float) -> dict[int, dict]:
    """The verify side of a speculative loop with a forced acceptance length a: per step one width-23 verify
    (chain, checkpoints, all logits to the host), greedy argmax of every row on the host, commit of the first
    a tokens. Drafter excluded. Returns seconds per step (median) and a / step."""
    rng = np.random.default_rng(2)
    n_vocab = model.cfg.n_vocab
    out: dict[int, dict] = {}
    for a in ACCEPT:
        if time.perf_counter() > deadline:
            break
        state = model.new_state(context + (steps + 1) * a + SPEC_WIDTH + 8)
        prefill(model, state, rng.integers(0, n_vocab, size=context))
        times = []
        for s in range(steps + 1):
            toks = rng.integers(0, n_vocab, size=SPEC_WIDTH)

            def step() -> None:
                res = model.forward(state, toks, checkpoints=True, logits="all")  # noqa: B023
                np.argmax(res.logits, axis=-1)       # what the greedy acceptance test reads
                state.commit(list(range(a)))         # noqa: B023

            dt, _ = timer(step)
            if s:
                times.append(dt)
        med = statistics.median(times)
        out[a] = {"step_s": med, "tps": a / med}
    return out


def drafter_timing(model, dpath: str, timer: Timer, context: int, reps: int, long_context: int,
                   deadline: float) -> tuple[Any, dict[str, Any]]:
    """Load the GPU drafter beside the target; time one pass at `context` (and past the sliding window)."""
    import cupy

    from services.engine.models.dflash_gpu import load_gpu_drafter

    t0 = time.perf_counter()
    dr = load_gpu_drafter(dpath, model)
    cupy.cuda.Device().synchronize()
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 1), "weight_bytes": dr.weight_bytes,
                           "layers": dr.cfg.n_layer, "block": dr.block_size, "sliding": dr.cfg.layer_causal,
                           "window": dr.cfg.sliding_window, "target_layer_ids": dr.target_layer_ids}
    for name, ctx in (("context", context), ("long_context", long_context)):
        if ctx <= 0 or (name != "context" and time.perf_counter() > deadline):
            continue
        out[name] = _time_pass(dr, timer, ctx, reps)
    return dr, out


def _time_pass(dr, timer: Timer, ctx: int, reps: int, n_new: int = 3) -> dict[str, Any]:
    """Median pass times at `ctx` committed rows; the same shape each time (the session is cut back to ctx)."""
    import cupy

    feats = cupy.random.standard_normal((ctx + n_new, dr.cfg.n_features), dtype=cupy.float32)
    warm = dr.new_session()     # a first append fetches its kernels (a served request finds them warm: reserve_serving)
    dr.append_context(warm, feats[:ctx], ctx)
    del warm
    s = dr.new_session()
    dt, _ = timer(lambda: dr.append_context(s, feats[:ctx], ctx))
    res: dict[str, Any] = {"ctx": ctx, "n_new": n_new, "prompt_append_ms": round(dt * 1e3, 2),
                           "windowed": bool(dr.cfg.sliding_window and any(dr.cfg.layer_causal)
                                            and ctx + n_new + dr.block_size > dr.cfg.sliding_window)}
    start = ctx + n_new

    def once() -> None:
        s.truncate(ctx)
        dr.draft_topk(s, feats[ctx:start], 7, start, 8)

    modes = {}
    for graphs in (False, True):
        dr.use_graphs = graphs
        once()                                          # warm: kernel builds; with graphs, the capture
        modes[graphs] = statistics.median(timer(once)[0] for _ in range(reps))
    res["pass_eager_ms"], res["pass_api_ms"] = round(modes[False] * 1e3, 3), round(modes[True] * 1e3, 3)
    g = next((g for k, g in s.graphs.items() if k[0] == n_new), None)
    if g is not None:
        stream = cupy.cuda.get_current_stream()
        res["pass_replay_ms"] = round(statistics.median(timer(lambda: g.graph.launch(stream))[0]
                                                        for _ in range(max(reps, 10))) * 1e3, 3)
    res["graph_stats"] = dict(dr.graph_stats)
    res["graph_blocker"] = dr.graph_blocker
    return res


def spec_loop(model, new_proposer: Callable[[], Any], layer_ids: list[int], timer: Timer, context: int, steps: int,
              deadline: float, overlap: bool = True) -> dict[int, dict]:
    """The speculative loop with a drafter and a forced acceptance length a (see the module docstring).
    new_proposer() makes the proposer of one run of steps: the in-process GPU drafter's (GpuProposer), or a
    DrafterClient of a drafter service (its draft then includes the features' trip and the answer's).
    overlap (the engine's order, speculative.begin_propose): the next draft is queued before the step's commit and
    the host builds the next tree while the commit runs; a step is then the time from one step's end to the next's.
    Without: draft, tree, verify, accept and commit one after another, the device idle between steps."""
    from services.engine.ddtree import build_ddtree
    from services.engine.speculative import begin_propose

    rng = np.random.default_rng(3)
    n_vocab = model.cfg.n_vocab
    layer_ids = list(layer_ids)
    out: dict[int, dict] = {}
    # a first, untimed row of WARM_STEPS steps: the loop's first-time host costs (the proposer's and the tree's
    # first calls, pinned buffers, the allocator's pools) otherwise land in the first timed row, which every session
    # read as the 2-token row's unexplained share above 5 %
    for row, a in enumerate((ACCEPT[0],) + tuple(ACCEPT)):
        if time.perf_counter() > deadline:
            break
        warm = row == 0
        # DECODE_PROFILE=PATH: after the timed steps of the last acceptance length, PROFILE_STEPS more under
        # cProfile (host-side costs by function; the timed steps run without it)
        prof_path = os.environ.get("DECODE_PROFILE") if a == ACCEPT[-1] and not warm and overlap else None
        n_steps = (WARM_STEPS if warm else steps + 1) + (PROFILE_STEPS if prof_path else 0)
        state = model.new_state(context + (n_steps + 1) * SPEC_WIDTH + 8)
        res = model.forward(state, rng.integers(0, n_vocab, size=context), capture=layer_ids, logits="last")
        state.commit(list(range(context)))
        feats, root = res.captured, int(np.argmax(np.asarray(res.logits)[-1]))
        prop = new_proposer()
        parts: dict[str, list[float]] = {"step": [], "draft": [], "tree": [], "verify": [], "accept": []}
        served = hasattr(prop, "last_draft_ms")     # a drafter service: its own time of each draft too
        if served:
            parts["service_draft"] = []
        prof = None
        pending, t_end = None, 0.0
        for s in range(n_steps):
            if prof_path and s == steps + 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            if pending is None:     # serial, or the first step: from an idle device
                timer.cupy.cuda.Device().synchronize()
                t0 = time.perf_counter()
                pending = begin_propose(prop, feats, root, state.n_past, 8)
            else:                   # overlapped: this step began where the last one ended
                t0 = t_end
            top_ids, top_lp = pending()
            pending = None
            t1 = time.perf_counter()
            tree = build_ddtree(top_ids, top_lp, SPEC_WIDTH - 1)
            tokens, parents = tree.verify_batch(root)
            t2 = time.perf_counter()
            res = model.forward(state, tokens, parents, capture=layer_ids, checkpoints=True, logits="all")
            t3 = time.perf_counter()
            lg = res.logits
            amax = lg.argmax_rows() if hasattr(lg, "argmax_rows") else np.argmax(np.asarray(lg), axis=-1)
            path = list(range(a))                       # root + the top-1 chain's first a-1 nodes
            feats, root = res.captured[path], int(amax[path[-1]])
            if overlap:
                pending = begin_propose(prop, feats, root, state.n_past + len(path), 8)
            state.commit(path)
            res = lg = None   # as the engine's loop: no result held over the next replay (it would be copied)
            if not overlap:
                timer.cupy.cuda.Device().synchronize()
            t4 = t_end = time.perf_counter()
            if 0 < s <= steps:
                for k, v in (("step", t4 - t0), ("draft", t1 - t0), ("tree", t2 - t1), ("verify", t3 - t2),
                             ("accept", t4 - t3)):
                    parts[k].append(v)
                if served:
                    parts["service_draft"].append(prop.last_draft_ms / 1e3)
        if pending is not None:
            pending()
        if prof is not None:
            prof.disable()
            prof.dump_stats(prof_path)
        if warm:
            prop.close()
            continue
        med = {k: statistics.median(v) for k, v in parts.items()}
        out[a] = {f"{k}_ms": round(v * 1e3, 3) for k, v in med.items()}
        out[a]["tps"] = round(a / med["step"], 2)
        # the loop's own captured passes replayed alone (device time of its kernels, no host work): what is left
        # of a step is the loop's overhead outside kernels (Python, uploads, downloads, tree, commit)
        # (a drafter service's passes run in its own process: no graph of them here, so no outside share)
        session = getattr(prop, "session", None)
        dg = [g for k, g in session.graphs.items() if k[0] == a] if session is not None else []
        vg = [g for k, g in getattr(state, "graphs", {}).items() if isinstance(k, tuple) and k and k[0] == SPEC_WIDTH]
        # the commit's graph (DeltaNet state replayed along the path, conv window; models/qwen35_gpu.commit) is
        # device work too; replayed alone it recomputes the state in place again, so it is timed last, on a state
        # this loop is done with
        cg = [g for k, g in getattr(state, "commit_graphs", {}).items() if k and k[0] == SPEC_WIDTH]
        if vg:
            out[a]["verify_replay_ms"] = round(_replay_s(vg[-1].graph, timer) * 1e3, 3)
            out[a]["commit_replay_ms"] = round(_replay_s(cg[-1], timer) * 1e3, 3) if cg else 0.0
        if dg and vg:
            out[a]["draft_replay_ms"] = round(_replay_s(dg[-1].graph, timer) * 1e3, 3)
            out[a]["outside_kernels_ms"] = round(out[a]["step_ms"] - out[a]["draft_replay_ms"]
                                                 - out[a]["verify_replay_ms"] - out[a]["commit_replay_ms"], 3)
        prop.close()
    return out


def _replay_s(graph, timer: Timer, reps: int = 10) -> float:
    """Median seconds of one replay of a captured graph, device idle before and drained after."""
    stream = timer.cupy.cuda.get_current_stream()
    return statistics.median(timer(lambda: graph.launch(stream))[0] for _ in range(reps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source(ap)          # --layers N < the shape's blocks: times scaled to the full count
    ap.add_argument("--full-layers", type=int, default=None,
                    help="block count to scale to when the model is shortened (default: the shape's)")
    ap.add_argument("--context", type=int, default=512, help="committed tokens before each timed pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--spec-steps", type=int, default=8)
    ap.add_argument("--precompile", type=int, default=12, help="processes building matmul kernels (0: none)")
    ap.add_argument("--deadline-s", type=float, default=500.0, help="later parts are skipped past this")
    ap.add_argument("--json", help="write the results here")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--graphs", dest="graphs", action="store_true", default=True,
                   help="CUDA-graph replay of each step shape (the engine's default)")
    g.add_argument("--no-graphs", dest="graphs", action="store_false", help="eager launches")
    g.add_argument("--graphs-compare", action="store_true", help="measure eager, then graphs, in one run")
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="verify widths to time")
    ap.add_argument("--drafter", action="store_true", help="with --make-synthetic: write and time its DFlash drafter")
    ap.add_argument("--draft", help="with --model: a DFlash drafter GGUF to time")
    ap.add_argument("--drafter-service", action="append", default=[], metavar="ADDR",
                    help="a running `specsplit drafter` for this target (unix:///path or host:port; repeatable): the "
                         "speculative loop through it, against the in-process drafter's (--draft) in the same run")
    ap.add_argument("--draft-features", choices=("auto", "f32", "f16"), nargs="+", default=["auto"],
                    help="features on the wire to a --drafter-service (auto: f32 through shared memory, else f16); "
                         "more than one: the loop through each service once with each")
    ap.add_argument("--long-context", type=int, default=2600,
                    help="drafter pass also timed at this context (past the 2048 window; 0: skip)")
    ap.add_argument("--no-decode", action="store_true", help="skip the plain-decode part")
    ap.add_argument("--prompts", type=int, nargs="*", default=list(PROMPTS),
                    help="prompt lengths timed from an empty context (pp n; none: skip)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason:
        print(f"decode: no GPU here: {reason}")
        return 1
    import cupy

    rep: dict[str, Any] = {"device": device_name(cupy), "argv": sys.argv[1:]}

    save = json_saver(rep, args.json, t_start)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    # matmul kernels build in other processes while the file is written (and the file is read)
    from kernels import quant_matmul as qm

    pre: dict[str, Any] = {}
    th = None
    if args.precompile > 0:
        qtypes = (qm.Q4_K, qm.Q6_K) + ((qm.Q8_0,) if args.drafter or args.draft else ())   # Q8_0: the drafter
        th = threading.Thread(target=lambda: pre.update(precompile_matmul(args.precompile, qtypes)), daemon=True)
        th.start()

    path = args.model
    if args.make_synthetic:
        from services.engine.synthetic import make_synthetic

        r = make_synthetic(args.shape, args.make_synthetic, layers=args.layers, draft=args.drafter)
        path = r.target_path
        args.draft = r.drafter_path if args.drafter else None
        rep["synthetic"] = {"path": path, "bytes": r.target_bytes, "seconds": r.seconds, "layers": args.layers,
                            "drafter_bytes": r.drafter_bytes if args.drafter else None}
        log(f"wrote {path}: {r.target_bytes / 1e9:.2f} GB in {r.seconds:.0f} s")
        save()

    bw = None
    try:  # before the weights: the copy needs 2 x 4 GiB free
        import roofline

        bw = roofline.copy_bandwidth(cupy, COPY_BYTES)
        cupy.get_default_memory_pool().free_all_blocks()
        rep["copy_GBps"] = round(bw, 1)
        log(f"copy bandwidth {bw:.0f} GB/s")
    except Exception:
        rep["copy_error"] = _err()

    model, mf, load = load_gpu_model(path)
    rep.update(load)
    rep["fallback_weights"] = model.fallback_weights[:8]
    cfg = model.cfg
    wb = weight_bytes(mf.tensors)
    rep["weight_bytes"] = wb
    rep["n_layer"] = cfg.n_layer
    log(f"loaded {cfg.n_layer} blocks in {rep['load_s']} s (header {rep['header_s']} s); weights/step "
        f"{(wb['blocks'] + wb['head']) / 1e9:.3f} GB")
    full = args.full_layers
    if full is None and args.make_synthetic:
        from services.engine.synthetic import get_shape

        full = get_shape(args.shape).target.n_layer
    full = full or cfg.n_layer
    scale = full / cfg.n_layer
    fb = full_shape_bytes(args.shape, full) if scale != 1 and args.make_synthetic else None
    if scale != 1 and fb is None:  # a given shortened file: blocks scaled by count
        fb = dict(wb, blocks=int(wb["blocks"] * scale))
    rep["full_layers"], rep["scale"] = full, scale
    if fb:
        rep["full_weight_bytes"] = fb
    step_bytes = (fb or wb)["blocks"] + (fb or wb)["head"]
    rep["roofline_tps"] = bw / (step_bytes / 1e9) if bw else None
    if th is not None:
        th.join()                                    # the first forward then finds every matmul kernel built
        rep["precompile"] = pre
        log(f"precompile {pre}")
    save()

    timer = Timer(cupy)
    modes = [False, True] if args.graphs_compare else [args.graphs]
    rep["modes"] = {}
    for graphs in modes:
        name = "graphs" if graphs else "eager"
        model.use_graphs = graphs
        model.graph_stats = dict.fromkeys(model.graph_stats, 0)
        log(f"-- {name} --")
        rep["modes"][name] = r = {"graphs": graphs}
        measure(model, r, timer, args, scale, rep["roofline_tps"], deadline, log, save)
        if args.draft and graphs:
            measure_drafter(model, r, timer, args, scale, deadline, log, save)
        if args.drafter_service and graphs and args.spec_steps > 0:
            spec_with_services(model, r, timer, args, scale, deadline, log)
        r["graph_stats"] = dict(model.graph_stats)
        r["graph_blocker"] = model.graph_blocker
        save()
    print_table(rep, path)
    return 0


def measure_drafter(model, r: dict[str, Any], timer: Timer, args, scale: float, deadline: float, log, save) -> None:
    """Drafter pass vs the width-23 verify, then the speculative loop with the drafter, into r["drafter"]."""
    r["drafter"] = d = {}
    dr = None
    v23 = r.get("verify_ms", {}).get(SPEC_WIDTH)
    s23 = r.get("scaled_verify_ms", {}).get(SPEC_WIDTH, v23)

    def ratios(p: dict[str, Any]) -> None:
        if v23 and p.get("pass_replay_ms"):
            p["ratio_to_verify23"] = round(p["pass_replay_ms"] / v23, 4)
            p["ratio_to_verify23_scaled"] = round(p["pass_replay_ms"] / s23, 4)
            p["api_ratio_to_verify23_scaled"] = round(p["pass_api_ms"] / s23, 4)

    try:
        dr, t = drafter_timing(model, args.draft, timer, args.context, args.reps, 0, deadline)
        d.update(t)
        ratios(d["context"])
        log(f"drafter pass: {d.get('context')}")
    except Exception:
        d["error"] = _err()
    save()
    if dr is None:
        return
    if args.spec_steps > 0:
        spec_with_drafter(model, dr, d, r, timer, args, scale, deadline, log)
    save()
    try:
        # last: a capture failure of the windowed path would turn the drafter's graphs off
        if args.long_context > 0 and time.perf_counter() < deadline:
            d["long_context"] = lc = _time_pass(dr, timer, args.long_context, args.reps)
            ratios(lc)
            long_context_ratios(model, timer, lc, args.long_context, min(args.reps, 3), scale, deadline)
            log(f"drafter pass past the window: {lc}")
    except Exception:
        d["long_error"] = _err()
    save()


def long_context_ratios(model, timer: Timer, lc: dict[str, Any], context: int, reps: int, scale: float,
                        deadline: float) -> None:
    """Like with like: the drafter's pass at `context` (lc, from _time_pass) against a width-23 verify at the same
    committed context (its attention reads as many rows), the pass's replay against the verify's graph alone too."""
    wc = width_curve(model, timer, context, reps, (SPEC_WIDTH,), deadline)
    v, b = wc["verify_s"][SPEC_WIDTH], wc["blocks_s"][SPEC_WIDTH]
    lc["verify23_at_ctx_ms"] = round(((v - b) + b * scale) * 1e3, 3)
    rp = wc["replay_s"].get(SPEC_WIDTH)
    if rp and scale == 1 and lc.get("pass_replay_ms"):
        lc["verify23_replay_at_ctx_ms"] = round(rp * 1e3, 3)
        lc["ratio_to_verify23_replay_at_ctx"] = round(lc["pass_replay_ms"] / (rp * 1e3), 4)
    if lc.get("pass_replay_ms"):
        lc["ratio_to_verify23_at_ctx"] = round(lc["pass_replay_ms"] / lc["verify23_at_ctx_ms"], 4)


def spec_with_drafter(model, dr, d: dict[str, Any], r: dict[str, Any], timer: Timer, args, scale: float,
                      deadline: float, log) -> None:
    """The speculative loop with the GPU drafter (spec_loop), scaled like the verify when the model is short."""
    try:
        # the engine's order (the next draft before the commit) and the serial one, in one process
        from services.engine.models.dflash_gpu import GpuProposer

        for key, overlap in (("spec_loop", True), ("spec_loop_serial", False)):
            loop = spec_loop(model, lambda: GpuProposer(dr), dr.target_layer_ids, timer, args.context,
                             args.spec_steps, deadline, overlap=overlap)
            for a, v in loop.items():
                if scale != 1 and "blocks_ms" in r:
                    step = v["step_ms"] + (scale - 1) * r["blocks_ms"][SPEC_WIDTH]
                    v["scaled_step_ms"], v["scaled_tps"] = round(step, 3), round(a / (step / 1e3), 2)
            d[key] = loop
            log(f"speculative loop with the GPU drafter ({key}): {loop}")
    except Exception:
        d["spec_loop_error"] = _err()


def spec_with_services(model, r: dict[str, Any], timer: Timer, args, scale: float, deadline: float, log) -> None:
    """The speculative loop (the engine's order) through each --drafter-service, into r["drafter_services"][ADDR],
    with each acceptance length's tok/s relative to the in-process drafter's in this run (when --draft was timed)."""
    from services.drafter.client import DrafterClient

    r["drafter_services"] = out = {}
    local = r.get("drafter", {}).get("spec_loop", {})
    dtypes = list(args.draft_features)
    for addr, dtype in ((a, t) for a in args.drafter_service for t in dtypes):
        out[addr if len(dtypes) == 1 else f"{addr} {dtype}"] = d = {"address": addr}
        try:
            with DrafterClient(addr, wait_ready=True, ready_timeout=SERVICE_READY_S, feature_dtype=dtype) as c:
                info = c.info()
                d.update(backend=info.backend, transport=c.transport, feature_dtype=c.feature_dtype,
                         block=info.block_size)
                layer_ids = list(c.target_layer_ids)

            def client(addr=addr, dtype=dtype) -> Any:
                return DrafterClient(addr, feature_dtype=dtype)

            loop = spec_loop(model, client, layer_ids, timer, args.context, args.spec_steps, deadline)
            for a, v in loop.items():
                if scale != 1 and "blocks_ms" in r:
                    step = v["step_ms"] + (scale - 1) * r["blocks_ms"][SPEC_WIDTH]
                    v["scaled_step_ms"], v["scaled_tps"] = round(step, 3), round(a / (step / 1e3), 2)
                if a in local:
                    v["vs_in_process"] = round(v["tps"] / local[a]["tps"], 4)
            d["spec_loop"] = loop
            log(f"speculative loop through the drafter service {addr} ({d['backend']}): {loop}")
        except Exception:
            d["error"] = _err()


def measure(model, r: dict[str, Any], timer: Timer, args, scale: float, roof: float | None, deadline: float, log,
            save) -> None:
    """Width curve, plain decode and forced-acceptance loop in the model's current launch mode, into r."""
    ctx = args.context
    widths = tuple(args.widths)
    try:
        t0 = time.perf_counter()
        wc = width_curve(model, timer, ctx, args.reps, widths, deadline)
        r["width_rounds"] = wc["rounds"]
        r["verify_ms"] = {w: round(v * 1e3, 3) for w, v in wc["verify_s"].items()}
        r["blocks_ms"] = {w: round(v * 1e3, 3) for w, v in wc["blocks_s"].items()}
        v1 = wc["verify_s"][widths[0]]
        r["verify_rel"] = {w: round(v / v1, 3) for w, v in wc["verify_s"].items()}
        if widths[0] in wc["replay_s"]:
            r["verify_replay_ms"] = {w: round(v * 1e3, 3) for w, v in wc["replay_s"].items()}
            r["verify_replay_rel"] = {w: round(v / wc["replay_s"][widths[0]], 3) for w, v in wc["replay_s"].items()}
        if scale != 1:
            sc = {w: (wc["verify_s"][w] - wc["blocks_s"][w]) + wc["blocks_s"][w] * scale for w in wc["verify_s"]}
            r["scaled_verify_ms"] = {w: round(v * 1e3, 3) for w, v in sc.items()}
            r["scaled_verify_rel"] = {w: round(v / sc[widths[0]], 3) for w, v in sc.items()}
        log(f"width curve ({wc['rounds']} rounds, {time.perf_counter() - t0:.0f} s): {r['verify_ms']} ms")
    except Exception:
        r["width_error"] = _err()
    save()

    try:
        if args.no_decode:
            raise _Skip
        d = plain_decode(model, args.decode_tokens, 32)
        r["decode"] = d
        step = 1.0 / d["tps"]
        if scale != 1 and 1 in r.get("blocks_ms", {}):
            step += (scale - 1) * r["blocks_ms"][1] / 1e3
            r["scaled_decode_tps"] = 1.0 / step
        tps = 1.0 / step
        if roof:
            r["decode_fraction_of_roofline"] = tps / roof
        log(f"plain decode {d['tps']:.1f} tok/s measured, {tps:.1f} for the full model")
    except _Skip:
        pass
    except Exception:
        r["decode_error"] = _err()
    save()

    try:
        if args.prompts and time.perf_counter() < deadline:
            pp = prompt_processing(model, args.prompts, min(args.reps, 3), deadline)
            step = r.get("verify_replay_ms", {}).get(1)
            if "decode" in r:
                step = 1e3 / r["decode"]["tps"]       # llama-bench's decode step: tg time / tokens
            for v in pp.values():
                v["decode_steps"] = round(v["ms"] / step, 2) if step and scale == 1 else None
            r["prompts"] = pp
            log(f"prompt processing (pp n): {pp}")
    except Exception:
        r["prompts_error"] = _err()
    save()

    if args.spec_steps <= 0 or SPEC_WIDTH not in widths:
        return
    try:
        fa = forced_acceptance(model, timer, ctx, args.spec_steps, deadline)
        vw = r.get("scaled_verify_ms", r.get("verify_ms", {})).get(SPEC_WIDTH)
        proj = {}
        for a, v in fa.items():
            step = v["step_s"] + ((scale - 1) * r["blocks_ms"][SPEC_WIDTH] / 1e3 if scale != 1 else 0.0)
            proj[a] = {"loop_step_ms": round(step * 1e3, 3), "loop_tps": round(a / step, 2),
                       "arith_tps": round(a / (vw / 1e3), 2) if vw else None}
        r["spec_projection"] = proj
        log(f"forced acceptance (verify side only): {proj}")
    except Exception:
        r["spec_error"] = _err()
    save()


def print_table(rep: dict[str, Any], path: str) -> None:
    scaled = rep.get("scale", 1) != 1
    n, full = rep.get("n_layer"), rep.get("full_layers")
    tag = f" (measured on {n} blocks, scaled to {full})" if scaled else ""
    wb = rep.get("full_weight_bytes", rep.get("weight_bytes", {}))
    modes = rep.get("modes", {})
    names = list(modes)
    lines = [f"\n== bench/decode.py on {rep['device']}: {os.path.basename(path)}{tag}",
             "| quantity | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             f"| device copy bandwidth (read + written) | {rep.get('copy_GBps')} GB/s |",
             f"| weights read per step (block matrices + LM head; token_embd, F32 vectors not counted) | "
             f"{(wb.get('blocks', 0) + wb.get('head', 0)) / 1e9:.3f} GB |",
             f"| roofline tokens/s (copy bandwidth / weight bytes) | {_f(rep.get('roofline_tps'), 1)} |"]

    def row(label: str, fn) -> None:
        cells = []
        for m in modes.values():
            try:
                cells.append(fn(m))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    widths = list(next(iter(modes.values()), {}).get("verify_ms", {}))
    vkey = "scaled_verify_ms" if scaled else "verify_ms"
    row(f"verify step (chain, checkpoints, all logits) at widths {' / '.join(map(str, widths))}, ms",
        lambda m: " / ".join(f"{m[vkey][w]:.2f}" for w in widths))
    row("same passes without logits, ms", lambda m: " / ".join(f"{m['blocks_ms'][w]:.2f}" for w in widths))
    row(f"verify graph replayed alone, ms (relative to width {widths[0] if widths else 1})",
        lambda m: " / ".join(f"{m['verify_replay_ms'][w]:.2f}" for w in widths)
        + " (" + " / ".join(f"{m['verify_replay_rel'][w]:.2f}" for w in widths) + ")")
    row("plain greedy decode, tok/s (fraction of the roofline)",
        lambda m: f"{m.get('scaled_decode_tps', m['decode']['tps']):.1f} "
                  f"({_f(m.get('decode_fraction_of_roofline'), 3)})")
    row("  measured: served (a step ahead) / one step at a time; graphs back to back: ahead's / step + commit, tok/s",
        lambda m: " / ".join(_f(m["decode"].get(k), 1) for k in ("tps", "step_tps")) + "; "
        + " / ".join(_f(m["decode"].get(k), 1) for k in ("ahead_replay_tps", "replay_tps")))
    prompts = list(next(iter(modes.values()), {}).get("prompts", {}))
    if prompts:
        row(f"prompt of {' / '.join(map(str, prompts))} tokens from an empty context (pp n): ms; tok/s; decode steps",
            lambda m: " | ".join(f"{v['ms']:.1f}; {v['tps']:.0f}; {_f(v['decode_steps'], 2)}"
                                 for v in m["prompts"].values()))
        row("  the same in eager 512-token chunks: ms (host's enqueue + the device's drain after it); / served",
            lambda m: " | ".join(f"{v['eager_ms']:.1f} ({v['eager_host_ms']:.1f} + {v['eager_drain_ms']:.1f}); "
                                 f"{v['eager_over_served']:.2f}x" for v in m["prompts"].values()))
    accepts = list(next(iter(modes.values()), {}).get("spec_projection", {}))
    if accepts:
        row(f"forced acceptance {' / '.join(map(str, accepts))} per width-{SPEC_WIDTH} step (drafter excluded), "
            f"tok/s", lambda m: " / ".join(f"{m['spec_projection'][a]['loop_tps']:.1f}" for a in accepts))
    row("graph captures / replays / eager passes",
        lambda m: "{captures} / {replays} / {eager}".format(**m["graph_stats"]))
    for name in ("context", "long_context"):
        row(f"drafter pass at {name.replace('_', ' ')}: replay / API / eager ms; replay / width-{SPEC_WIDTH} verify "
            f"(scaled)", lambda m, n=name: "{pass_replay_ms:.3f} / {pass_api_ms:.3f} / {pass_eager_ms:.3f}; "
            "{ratio_to_verify23_scaled:.3f}".format(**m["drafter"][n]))
    row(f"drafter pass at long context against a width-{SPEC_WIDTH} verify at the same context: verify ms (its graph "
        "alone); replay / verify (/ verify graph alone)", lambda m: "{verify23_at_ctx_ms:.2f} ({}); {:.3f} ({})".format(
            _f(m["drafter"]["long_context"].get("verify23_replay_at_ctx_ms"), 2),
            m["drafter"]["long_context"]["ratio_to_verify23_at_ctx"],
            _f(m["drafter"]["long_context"].get("ratio_to_verify23_replay_at_ctx"), 3), **m["drafter"]["long_context"]))
    for key, how in (("spec_loop", "the next draft before the commit (the engine's order)"),
                     ("spec_loop_serial", "serial (each step from an idle device)")):
        loops = list(next(iter(modes.values()), {}).get("drafter", {}).get(key, {}))
        if not loops:
            continue
        row(f"speculative loop with the GPU drafter, {how}, forced acceptance {' / '.join(map(str, loops))}: "
            f"tok/s ({'scaled' if scaled else 'measured'})", lambda m, key=key: " / ".join(
                f"{v.get('scaled_tps', v['tps']):.1f}" for v in m["drafter"][key].values()))
        row("  per step: draft / tree / verify / accept ms; commit replay; outside kernels ms (share of the step)",
            lambda m, key=key: " | ".join(
                f"{v['draft_ms']:.2f} / {v['tree_ms']:.2f} / {v['verify_ms']:.2f} / {v['accept_ms']:.2f}; "
                f"{v.get('commit_replay_ms')}; {v.get('outside_kernels_ms')} ({_share(v)})"
                for v in m["drafter"][key].values()))
    first = next(iter(modes.values()), {})
    for addr, svc in first.get("drafter_services", {}).items():
        loops = list(svc.get("spec_loop", {}))
        if not loops:
            continue
        row(f"speculative loop through the drafter service {svc['address']} ({svc.get('backend')}, "
            f"{svc.get('transport')}, {svc.get('feature_dtype')} features), forced acceptance "
            f"{' / '.join(map(str, loops))}: tok/s ({'scaled' if scaled else 'measured'}; relative to the "
            "in-process drafter's)",
            lambda m, addr=addr: " / ".join(
                f"{v.get('scaled_tps', v['tps']):.1f} ({_f(v.get('vs_in_process'), 3)})"
                for v in m["drafter_services"][addr]["spec_loop"].values()))
        row("  per step: draft (features out, the service's draft, top-k back; the service's own draft ms) / tree / "
            "verify / accept ms",
            lambda m, addr=addr: " | ".join(
                f"{v['draft_ms']:.2f} ({_f(v.get('service_draft_ms'), 2)}) / {v['tree_ms']:.2f} / "
                f"{v['verify_ms']:.2f} / {v['accept_ms']:.2f}"
                for v in m["drafter_services"][addr]["spec_loop"].values()))
    print("\n".join(lines))
    for name, m in modes.items():
        for addr, svc in m.get("drafter_services", {}).items():
            if svc.get("error"):
                print(f"{name} drafter service {addr} error: {svc['error']}")
        for k in ("width_error", "decode_error", "prompts_error", "spec_error", "graph_blocker"):
            if m.get(k):
                print(f"{name} {k}: {m[k]}")
        for k in ("error", "spec_loop_error", "long_error"):
            if m.get("drafter", {}).get(k):
                print(f"{name} drafter {k}: {m['drafter'][k]}")
    print(f"(run {rep.get('elapsed_s')} s; header {rep.get('header_s')} s, load {rep.get('load_s')} s, "
          f"synthetic write {rep.get('synthetic', {}).get('seconds')} s)")


def _share(v: dict) -> str:
    """A loop row's time outside kernels as a share of its step."""
    return "n/a" if v.get("outside_kernels_ms") is None else f"{100 * v['outside_kernels_ms'] / v['step_ms']:.1f} %"


def _f(x: float | None, nd: int) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


if __name__ == "__main__":
    sys.exit(main())
