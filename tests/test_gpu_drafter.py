"""The DFlash drafter on the GPU (models/dflash_gpu.py) against the NumPy drafter (models/dflash.py), on the embedded
default model (a qwen35 target and its trained 2-layer drafter). GPU tests skip (with the reason) without CuPy
and a CUDA GPU; the CLI device checks at the end run anywhere.

Tolerance (DRAFT_TOL): the GPU rounds activations to fp16 on their way into every matmul and keeps the context
K/V in fp16, the NumPy drafter is f32 throughout, and the features come from the GPU target (host copies) on both
sides. DRAFT_TOL = 0.05 is tests/test_gpu_backend.py's LOGIT_TOL for the target (this drafter's logits span about
+-20); the device run prints the measured maximum. Top-k ids must be equal wherever the NumPy log-probabilities
of neighbouring ranks are more than 2 * DRAFT_TOL apart (closer pairs may swap).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from kernels import loader

DRAFT_TOL = 0.05     # measured on an H100 (2026-11-21): 0.012 at most over the cases below
# replay vs eager: the attention's K splits differ (S bucket vs S) and split-K matmuls add in another order.
# Measured on an H100 (2026-11-21): 0.0071 (full layers); 0.02 keeps ~3x headroom, 2.5x below DRAFT_TOL.
GRAPH_TOL = 0.02
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"

_REASON = loader.unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU drafter tests skipped: {_REASON}")


@functools.lru_cache(maxsize=1)
def models():
    """(GPU target, NumPy target, drafter path, prompt ids)."""
    from services.engine.default_model import default_model_paths
    from services.engine.loader import load_target
    from services.engine.models.qwen35_gpu import load_gpu_target

    target_path, draft_path = default_model_paths()
    cpu = load_target(target_path)
    gpu = load_gpu_target(target_path, 0, with_tokenizer=False)
    return gpu.model, cpu.model, draft_path, cpu.tokenizer.encode(PROMPT)


def _pair(sliding_window: int | None = None):
    """(NumPy drafter on the CPU target, GPU drafter on the GPU target) from one file; with sliding_window, the
    first layer is made a sliding layer of that window (same weights: exercises the windowed attention)."""
    from services.engine.models.dflash import DFlashDrafter, read_drafter
    from services.engine.models.dflash_gpu import DFlashGpuDrafter

    gpu, cpu, draft_path, _ = models()
    cfg, tensors, src = read_drafter(draft_path, gpu.cfg.n_layer)
    if sliding_window is not None:
        causal = [True] + [False] * (cfg.n_layer - 1)
        cfg = dataclasses.replace(cfg, layer_causal=causal, sliding_window=sliding_window)
    return DFlashDrafter(cfg, tensors, cpu, source=src), DFlashGpuDrafter(cfg, tensors, gpu, source=src)


def _features(n: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Target features (host float32, (n, K, E)) of the prompt plus random tokens, from the GPU target."""
    gpu, _, draft_path, ids = models()
    from services.engine.models.dflash import read_drafter

    layer_ids = read_drafter(draft_path, gpu.cfg.n_layer)[0].target_layer_ids
    toks = list(ids) + list(np.random.default_rng(seed).integers(0, gpu.cfg.n_vocab, max(0, n - len(ids))))
    st = gpu.new_state(len(toks) + 8)
    out = gpu.forward(st, toks[:n], capture=layer_ids, logits="none")
    return np.asarray(out.captured, np.float32), toks[:n]


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _assert_topk_match(ref_logits: np.ndarray, ids: np.ndarray, logp: np.ndarray) -> None:
    from services.engine.ddtree import topk_logprobs

    r_ids, r_lp = topk_logprobs(ref_logits, ids.shape[1])
    assert _max_diff(r_lp, logp) <= DRAFT_TOL
    gaps = np.abs(np.diff(r_lp, axis=1))                       # (rows, k-1) gaps between neighbouring ranks
    clear = np.ones_like(r_ids, dtype=bool)
    clear[:, :-1] &= gaps > 2 * DRAFT_TOL
    clear[:, 1:] &= gaps > 2 * DRAFT_TOL
    clear[:, -1] = False                                        # the k+1-th rank is unknown here
    assert np.array_equal(r_ids[clear], ids[clear]), "top-k ids differ where the NumPy ranks are not tied"


@needs_gpu
@pytest.mark.parametrize("window, n_ctx", [(None, 40), (128, 40), (24, 40), (8, 40)])
def test_block_logits_and_drafts_match_numpy(window, n_ctx):
    """Full layers; a sliding layer whose window covers the context (causal mask); windows of 24 and 8 over 40+
    rows (the windowed attention: rows every query sees, edge rows; 8 < block: edge rows only). One prompt
    append, then three drafts that append 1..5 rows each."""
    ref, dr = _pair(window)
    feats, toks = _features(n_ctx + 12)
    rs, gs = ref.new_session(), dr.new_session()
    ref.append_context(rs, feats[:n_ctx], n_ctx)
    dr.append_context(gs, feats[:n_ctx], n_ctx)
    assert _max_diff(rs.k[0][:n_ctx], gs.context_kv(0)[0]) <= DRAFT_TOL
    block = np.full(dr.block_size, dr.mask_token_id)
    block[0] = toks[n_ctx - 1]
    worst = _max_diff(ref.block_logits(rs, block, n_ctx), dr.block_logits(gs, block, n_ctx))
    start = n_ctx
    for j, n in enumerate((1, 5, 3)):
        new = feats[start:start + n]
        start += n
        want = ref.draft(rs, new, toks[start - 1], start)
        if j == 1:
            ids, logp = dr.draft_topk(gs, new, toks[start - 1], start, 8)
            _assert_topk_match(want, ids, logp)
            continue
        got = dr.draft(gs, new, toks[start - 1], start)
        assert got.shape == want.shape == (dr.block_size - 1, dr.n_vocab)
        worst = max(worst, _max_diff(want, got))
    assert gs.n_ctx == rs.n_ctx == start
    print(f"GPU vs NumPy drafter, window {window}: max |logit difference| {worst:.4g}")
    assert worst <= DRAFT_TOL, f"max |GPU - NumPy| draft logit difference {worst:.4g} > {DRAFT_TOL}"


@needs_gpu
def test_gpu_drafter_for_a_cpu_target_matches_numpy():
    """The drafter service's case (`specsplit drafter --device cuda:N`): the target is the NumPy model (only its
    token table and LM head are used), so the GPU drafter holds device copies of them; drafts match the NumPy
    drafter's as with a GPU target."""
    from services.engine.models.dflash import DFlashDrafter, read_drafter
    from services.engine.models.dflash_gpu import DFlashGpuDrafter

    gpu, cpu, draft_path, _ = models()
    cfg, tensors, src = read_drafter(draft_path, cpu.cfg.n_layer)
    ref, dr = DFlashDrafter(cfg, tensors, cpu, source=src), DFlashGpuDrafter(cfg, tensors, cpu, source=src)
    assert dr.output is not gpu.output and dr.be.name == "cuda"
    feats, toks = _features(40)
    rs, gs = ref.new_session(), dr.new_session()
    start = 0
    for n in (30, 1, 4, 5):     # a prompt's rows (an eager append), then drafts appending a few rows each
        start += n
        want = ref.draft(rs, feats[start - n:start], toks[start - 1], start)
        ids, logp = dr.draft_topk(gs, feats[start - n:start], toks[start - 1], start, 8)
        _assert_topk_match(want, ids, logp)
    assert gs.n_ctx == rs.n_ctx == start


@needs_gpu
def test_host_f16_features_widen_on_the_device_to_the_same_drafts():
    """A drafter service's f16 rows (takes_f16_features: uploaded as f16, widened on the device) draft exactly what
    the same values as float32 draft: a prompt's append, then drafts appending a few rows each."""
    _, dr = _pair()
    assert dr.takes_f16_features
    feats, toks = _features(40)
    f16 = feats.reshape(len(feats), -1).astype(np.float16)
    dr.use_graphs = False                  # eager both ways: the same launches, so the same bits
    outs = []
    for rows in (f16.astype(np.float32), f16):
        s = dr.new_session()
        dr.append_context(s, rows[:30], 30)
        start, got = 30, []
        for n in (1, 4, 3, 2):
            start += n
            got.append(dr.draft_topk(s, rows[start - n:start], toks[start - 1], start, 8))
        outs.append(got)
    for (i32, l32), (i16, l16) in zip(*outs):
        assert np.array_equal(i32, i16) and np.array_equal(l32, l16)


@needs_gpu
@pytest.mark.parametrize("window", [None, 8])
def test_graph_replay_equals_eager(window):
    """The same drafts on two sessions, captured passes (replayed from the second of each shape) vs eager."""
    _, dr = _pair(window)
    feats, toks = _features(64)
    sessions = {}
    outs: dict[bool, list[np.ndarray]] = {}
    for graphs in (False, True):
        dr.use_graphs = graphs
        s = sessions[graphs] = dr.new_session()
        dr.append_context(s, feats[:20], 20)
        start, outs[graphs] = 20, []
        for n in (2, 2, 3, 2, 3):            # shapes repeat: replays of the captured passes
            start += n
            outs[graphs].append(dr.draft(s, feats[start - n:start], toks[start - 1], start))
    assert dr.graph_stats["replays"] >= 3 and dr.graph_stats["failed"] == 0, dr.graph_stats
    worst = max(_max_diff(a, b) for a, b in zip(outs[False], outs[True]))
    print(f"drafter graph replay vs eager, window {window}: max |logit difference| {worst:.4g}, {dr.graph_stats}")
    assert worst <= GRAPH_TOL, f"graph replay vs eager: {worst:.4g} > {GRAPH_TOL}"


@needs_gpu
def test_captured_passes_serve_every_append_a_step_makes():
    """capture_passes captures a pooled session's pass of each append of 0..graph_append rows (a step's accepted
    tokens); longer appends (a prompt, the plain steps of a drafter pause) run eagerly first, then the captured pass
    with nothing to append: no capture during the drafts, and the NumPy drafter's drafts."""
    ref, dr = _pair(None)
    dr.reserve_sessions(1, 256)
    made = dr.capture_passes()
    assert made == dr.graph_append + 1 == dr.block_size + 2, dr.graph_stats
    feats, toks = _features(120, seed=3)
    s = dr.acquire_session()
    rs = ref.new_session()
    start, worst = 0, 0.0
    for n in (30, 1, 17, 5, 40, 2):            # a prompt, steps, a pause's rows, ...
        start += n
        got = dr.draft(s, feats[start - n:start], toks[start - 1], start)
        want = ref.draft(rs, feats[start - n:start], toks[start - 1], start)
        worst = max(worst, _max_diff(got, want))
    dr.release_session(s)
    assert dr.graph_stats["captures"] == made and dr.graph_stats["replays"] >= 6, dr.graph_stats
    print(f"captured passes vs NumPy drafter: max |logit difference| {worst:.4g}, {dr.graph_stats}")
    assert worst <= DRAFT_TOL


@needs_gpu
@pytest.mark.parametrize("budget", [None, 22])
def test_speculative_greedy_with_gpu_drafter_equals_plain_greedy(budget):
    from services.engine.generate import generate
    from services.engine.models.dflash_gpu import GpuProposer, load_gpu_drafter
    from services.engine.speculative import SpecConfig, speculative_generate

    gpu, _, draft_path, ids = models()
    drafter = load_gpu_drafter(draft_path, gpu)
    assert drafter.tok_embd is gpu.tok_embd and drafter.output is gpu.output     # shared, not copied
    plain = generate(gpu, ids, 40).token_ids
    res = speculative_generate(gpu, GpuProposer(drafter), ids, 40, spec=SpecConfig(budget=budget))
    assert res.token_ids == plain
    assert res.spec["mean_acceptance_length"] > 1.0          # the trained drafter gets tokens accepted


@needs_gpu
def test_a_prompts_features_go_to_the_gpu_drafter_on_the_device():
    """A 300-token prompt in the GPU target's 64-token graph steps: its features gathered on the device and
    appended to the drafter's context 256 rows at once as the chunks commit (speculative.PROMPT_APPEND_ROWS), the
    last 44 with the first draft; greedy output equals plain decoding, as with the features through the host."""
    from services.engine.generate import generate
    from services.engine.models.dflash_gpu import GpuProposer, load_gpu_drafter
    from services.engine.models.qwen35_gpu import DeviceRows
    from services.engine.speculative import SpecConfig, speculative_generate

    gpu, _, draft_path, ids = models()
    drafter = load_gpu_drafter(draft_path, gpu)
    prompt = list(ids) + np.random.default_rng(4).integers(0, gpu.cfg.n_vocab, 300 - len(ids)).tolist()
    assert gpu.prompt_chunk(gpu.new_state(320), 512) == 64
    plain = generate(gpu, prompt, 24).token_ids
    seen = []

    class Logged(GpuProposer):
        def append_features(self, new_features, start):
            seen.append((type(new_features), len(new_features), start))
            super().append_features(new_features, start)

        def propose_begin(self, new_features, last_token, start, k):
            if not seen or seen[-1][0] != "draft":
                seen.append(("draft", 0 if new_features is None else len(new_features), start))
            return super().propose_begin(new_features, last_token, start, k)

    class HostOnly:     # the same drafter without appends ahead of a draft: prefill gathers features on the host
        def __init__(self, inner):
            self.inner, self.block_size, self.target_layer_ids = inner, inner.block_size, inner.target_layer_ids

        def propose(self, *a):
            return self.inner.propose(*a)

        def close(self):
            self.inner.close()

    res = speculative_generate(gpu, Logged(drafter), prompt, 24, spec=SpecConfig(budget=22))
    assert res.token_ids == plain and res.spec["fallback"] is False
    assert seen[:2] == [(DeviceRows, 256, 256), ("draft", 44, 300)], seen[:3]
    host = speculative_generate(gpu, HostOnly(GpuProposer(drafter)), prompt, 24, spec=SpecConfig(budget=22))
    assert host.token_ids == plain and host.spec["fallback"] is False
    print("prompt appends on the device:", seen[:2], "accepted", res.spec["accepted"], "vs through the host",
          host.spec["accepted"])


@needs_gpu
def test_second_request_reuses_pooled_sessions_and_graphs():
    """A finished request's target state and drafter session (with their captured graphs) serve the next
    request: the same request again captures nothing and gives the same tokens; the pools stay bounded and
    hand a session to one thread at a time."""
    import threading

    from services.engine.models.dflash_gpu import GpuProposer, load_gpu_drafter
    from services.engine.speculative import SpecConfig, speculative_generate

    gpu, _, draft_path, ids = models()
    drafter = load_gpu_drafter(draft_path, gpu)
    spec = SpecConfig(budget=22)
    first = speculative_generate(gpu, GpuProposer(drafter), ids, 32, spec=spec)
    captures = (gpu.graph_stats["captures"], drafter.graph_stats["captures"])
    reused = (gpu.pool_stats["reused"], drafter.pool_stats["reused"])
    second = speculative_generate(gpu, GpuProposer(drafter), ids, 32, spec=spec)
    assert second.token_ids == first.token_ids
    assert (gpu.graph_stats["captures"], drafter.graph_stats["captures"]) == captures   # replays only
    assert gpu.pool_stats["reused"] == reused[0] + 1 and drafter.pool_stats["reused"] == reused[1] + 1
    print("pooled second request: target", gpu.graph_stats, gpu.pool_stats, "drafter", drafter.graph_stats,
          drafter.pool_stats)

    # several threads at once: each gets its own session; at most session_pool_size come back to the pool
    drafter.session_pool_size = 2
    got, lock = [], threading.Lock()

    def take():
        s = drafter.acquire_session()
        with lock:
            got.append(s)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 4
    for s in got:
        drafter.release_session(s)
    drafter.release_session(got[0])           # released twice: kept once
    assert len(drafter._pool) == 2


def test_draft_device_checks(capsys):
    """--draft-device: a GPU drafter on another GPU, or beside a CPU target, is a clear error before loading."""
    pytest.importorskip("grpc_health", reason="services.cli registers the gRPC services")
    from services.cli import main

    for argv, says in ((["--device", "cuda:0", "--draft-device", "cuda:1"], "specsplit drafter --device cuda:1"),
                       (["--device", "cpu", "--draft-device", "cuda:0"], "needs its target on the same GPU")):
        rc = main(["generate", *argv, "--prompt", "x", "--max-tokens", "2"])
        assert rc == 2
        assert says in capsys.readouterr().err
