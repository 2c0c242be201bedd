"""The qwen35 target on the GPU (models/qwen35_gpu.py on CupyBackend) against the NumPy engine, on the embedded
default model. GPU tests skip (with the reason) without CuPy and a CUDA GPU; the last test runs on the CPU.

Tolerance (LOGIT_TOL): the GPU rounds activations to fp16 on their way into every matmul (f32 accumulation)
and keeps K/V in fp16, the NumPy path is f32 throughout: logits differ by ~5e-3 after 8 layers (the logits
of this model span about +-13), LOGIT_TOL allows 10x that; greedy tokens must be identical.

TQ3_0 KV (TQ3_TOL, TQ3_PATH_TOL): 3-bit codes amplify those roundings. A K or V value within rounding of a
centroid midpoint gets the neighbouring code on one side (a step of ~0.1 in that value), so two runs that
differ by fp16 rounding differ by a few codes per token. Measured on an H100 (2026-11-21): GPU vs NumPy
engine, both tq3_0/tq3_0 (q8_0/tq3_0), max |logit difference| 0.137 (0.240) over prefill + 16 decode steps,
0.147 (0.130) on a 65-node tree, 0.042 (0.064) after its commit; tree + commit vs plain decode on the GPU 0.344
(0.016). The CPU stand-in of the kernels (NumPy twins, fp16-rounded matmul inputs) gives the same sizes. For
scale: TQ3_0 itself moves the NumPy logits by up to 1.44 (1.11) from f32 KV, and a commit that leaves the KV
rows unmoved gives 6.6.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kernels import loader

LOGIT_TOL = 0.05    # max |GPU - NumPy| over a logits row (measured on an H200: 0.005, logits within +-12.6)
PATH_TOL = 0.05     # tree forward + commit vs plain decode, both on the GPU (other widths: not bitwise equal)
# replayed graph vs eager launches of the same steps: the same kernels, except that a graph's attention takes its
# K splits from S's bucket (eager: from S) and split-K matmuls add with atomics, so sums round in another order.
# Measured on an H200 (2026-11-21): 0.0044 over the script's 17 outputs (a first guess of 2e-3 failed there); on an
# H100 (2026-11-26, the same in three runs, so the launches' rounding is deterministic): 0.0091, and 0.0109 with a
# DeltaNet walk that formed every token's output from the state before its update (same math, other roundings; only
# read-only leaves do that now). 0.02: ~2x the largest measured, 2.5x below LOGIT_TOL (GPU vs NumPy); a graph
# replaying stale positions or lengths is O(1) off.
GRAPH_TOL = 0.02
TQ3_TOL = 0.8       # GPU vs NumPy, same TQ3_0 KV types (see above: 3.3x the 0.240 measured, below TQ3 vs f32)
TQ3_PATH_TOL = 1.0  # tree + commit vs plain decode with TQ3_0 KV (2.9x the 0.344 measured; a broken commit: 6.6)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"

_REASON = loader.unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU engine tests skipped: {_REASON}")


@functools.lru_cache(maxsize=1)
def models():
    """(NumPy target, GPU target, prompt ids, drafter path) for the embedded default model."""
    from services.engine.default_model import default_model_paths
    from services.engine.loader import load_target
    from services.engine.models.qwen35_gpu import load_gpu_target

    target_path, draft_path = default_model_paths()
    cpu = load_target(target_path)
    gpu = load_gpu_target(target_path, 0, with_tokenizer=False)
    ids = cpu.tokenizer.encode(PROMPT)
    return cpu.model, gpu.model, ids, draft_path


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@needs_gpu
def test_prefill_and_decode_logits_match_numpy():
    cpu, gpu, ids, _ = models()
    cs, gs = cpu.new_state(256), gpu.new_state(256)
    rc, rg = cpu.forward(cs, ids, logits="all"), gpu.forward(gs, ids, logits="all")
    cs.commit(range(len(ids)))
    gs.commit(range(len(ids)))
    worst = _max_diff(rc.logits, rg.logits)
    tok = int(np.argmax(rc.logits[-1]))
    for _ in range(16):                       # teacher-forced by the NumPy tokens: both see the same inputs
        rc, rg = cpu.forward(cs, [tok], logits="last"), gpu.forward(gs, [tok], logits="last")
        cs.commit([0])
        gs.commit([0])
        worst = max(worst, _max_diff(rc.logits, rg.logits))
        tok = int(np.argmax(rc.logits[-1]))
    assert worst <= LOGIT_TOL, f"max |GPU - NumPy| logit difference {worst:.4g} > {LOGIT_TOL}"


@needs_gpu
@pytest.mark.parametrize("n", [5, 40, 64, 100, 150])
def test_prompt_chunks_as_graph_steps_match_numpy_and_eager_chunks(n, monkeypatch):
    """generate.prefill on a state of the widest steps: whole 64-token chunks as a chain's graph, the last one padded
    to the next PROMPT_LADDER width as a checkpointed chain's graph and committed to the prompt's tokens. The last
    row's logits and 8 teacher-forced decode steps after it (they read the committed KV rows, DeltaNet states and
    conv windows) within LOGIT_TOL of the NumPy engine and GRAPH_TOL of eager 512-token chunks; graph steps ran."""
    from services.engine.generate import prefill
    from services.engine.models import qwen35_gpu as QG

    cpu, gpu, _, _ = models()
    gpu.use_graphs = True
    monkeypatch.setattr(gpu, "max_tree", QG.MAX_TREE)        # (a test before may have planned a narrower server)
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, gpu.cfg.n_vocab, n)]

    def run(model, st):
        out = [np.asarray(prefill(model, st, prompt)[0])]
        tok = int(np.argmax(out[0]))
        for _ in range(8):
            out.append(np.asarray(model.forward(st, [tok], logits="last").logits[-1]))
            st.commit([0])
            tok = int(np.argmax(out[-1]))
        return out

    want = run(cpu, cpu.new_state(256))
    replays = gpu.graph_stats["replays"] + gpu.graph_stats["captures"]
    eager_before = gpu.graph_stats["eager"]
    got = run(gpu, gpu.new_state(256))
    assert gpu.graph_stats["eager"] == eager_before          # every chunk and step a graph's
    assert gpu.graph_stats["replays"] + gpu.graph_stats["captures"] - replays == -(-n // 64) + 8
    monkeypatch.setattr(QG, "PROMPT_GRAPHS", False)
    eager = run(gpu, gpu.new_state(256))
    worst, drift = max(map(_max_diff, want, got)), max(map(_max_diff, eager, got))
    print(f"prompt of {n} as graph steps: max |GPU - NumPy| {worst:.4g}, |graphs - eager chunks| {drift:.4g}")
    assert worst <= LOGIT_TOL, f"{worst:.4g} > {LOGIT_TOL}"
    assert drift <= GRAPH_TOL, f"{drift:.4g} > {GRAPH_TOL}"


@needs_gpu
def test_greedy_64_tokens_identical():
    from services.engine.generate import generate

    cpu, gpu, ids, _ = models()
    a = generate(cpu, ids, 64).token_ids
    b = generate(gpu, ids, 64).token_ids
    if a != b:  # say whether a near-tie broke it: the NumPy margin between its top two at the first divergence
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        s = cpu.new_state(len(ids) + j + 1)
        lg = cpu.forward(s, list(ids) + a[:j], logits="last").logits[-1]
        top = np.sort(lg)[-2:]
        pytest.fail(f"greedy tokens differ first at {j}: NumPy {a[j]}, GPU {b[j]}; NumPy top-2 margin "
                    f"{top[1] - top[0]:.4g} (a near-tie if below {LOGIT_TOL})")


@needs_gpu
def test_plain_requests_reuse_pooled_states():
    """Plain decoding takes its state from the target's pool too: the same request again captures no graph and
    gives the same tokens."""
    from services.engine.generate import generate

    _, gpu, ids, _ = models()
    a = generate(gpu, ids, 24).token_ids
    captures, reused = gpu.graph_stats["captures"], gpu.pool_stats["reused"]
    assert generate(gpu, ids, 24).token_ids == a
    assert gpu.graph_stats["captures"] == captures and gpu.pool_stats["reused"] == reused + 1


@needs_gpu
def test_budget_calibration_leaves_every_slot_the_verify_graphs_it_may_choose():
    """`--budget auto` measures its verify widths as the speculative loop runs them (capturing the drafter's
    feature layers) on every pooled state of a serving process (its slots): each state then holds those graphs and
    their commits' (one per step shape, whichever path a commit accepts), and speculative requests capture no
    verify or commit graph of a width the tuner may choose (a capture cost ~10 ms a width on this pair,
    mid-request), nor a drafter pass (reserve_serving captured those of every append a step makes)."""
    from services.engine.budget import BudgetTuner
    from services.engine.default_model import default_model_paths
    from services.engine.models.qwen35_gpu import load_gpu_target
    from services.engine.placement import load_drafter_on, reserve_serving
    from services.engine.speculative import AUTO_MAX_BUDGET, SpecConfig, speculative_generate

    _, _, ids, draft_path = models()
    gpu = load_gpu_target(default_model_paths()[0], 0, with_tokenizer=False).model   # its own pool and graphs
    placed = load_drafter_on(draft_path, gpu, "cuda:0")
    layers = tuple(placed.drafter.target_layer_ids)
    width = reserve_serving(gpu, placed.drafter, 2, 512, AUTO_MAX_BUDGET, True, len(layers), "cuda:0")
    tuner = BudgetTuner.measure(gpu, min(AUTO_MAX_BUDGET, width - 1), capture=layers, states=2)
    widths = set(tuner.verify_costs)

    def verify_graphs(st):   # widths of the state's graphs of checkpointed steps capturing the drafter's layers
        return {k[0] for k in st.graphs if k[2] and k[4] == layers}

    def commit_graphs(st):   # widths of the state's commits of checkpointed steps
        return {k[0] for k in st.commit_graphs if k[2]}

    pool = list(gpu._state_pool)
    assert len(pool) == 2 and all(verify_graphs(st) >= widths for st in pool)
    assert all(commit_graphs(st) >= widths - {1} for st in pool), [sorted(commit_graphs(st)) for st in pool]
    before = {id(st): set(st.graphs) for st in pool}
    commits_before = {id(st): set(st.commit_graphs) for st in pool}
    # reserve_serving also captured each pooled drafter session's passes (a step's appends of 0..block + 1 rows)
    drafts_before = placed.drafter.graph_stats["captures"]
    sessions = list(placed.drafter._pool)
    assert len(sessions) == 2 and all({k[0] for k in s.graphs} == set(range(placed.drafter.graph_append + 1))
                                      for s in sessions), [sorted(s.graphs) for s in sessions]
    spec = SpecConfig.auto(tuner)
    for n in (24, 40):
        out = speculative_generate(gpu, placed.new_proposer(), ids, n, spec=spec)
        assert out.spec["steps"] >= 1
    assert placed.drafter.graph_stats["captures"] == drafts_before, placed.drafter.graph_stats
    for st in gpu._state_pool:
        new = set(st.graphs) - before[id(st)]
        assert not {k for k in new if k[2] and k[4] == layers and k[0] in widths}, new
        new_commits = set(st.commit_graphs) - commits_before[id(st)]
        assert not {k for k in new_commits if k[2] and k[0] in widths}, new_commits


@needs_gpu
def test_chunk_wider_than_the_planned_width_matches_numpy():
    """A prompt chunk wider than a state's planned width (plain decoding plans 1 token, budget 22 plans 23) but of at
    most 64 tokens runs eagerly, outside the graphs, and reads its ancestor mask from the state like every step the
    attention kernel takes: the mask must be this chunk's, not zeros (a new state) nor what an earlier step left
    there (a pooled state: reset() keeps the buffers). Same logits as the NumPy engine, and bit for bit the same
    again on the reset state after a graph decode step wrote its one-token mask."""
    from services.engine.models.qwen35_gpu import GpuSequenceState

    cpu, gpu, ids, _ = models()
    assert 1 < len(ids) <= 64
    st = GpuSequenceState(gpu.cfg, 256, "f16", "f16", max_tree=1, host_rows=gpu._host_table)
    want = cpu.forward(cpu.new_state(256), ids, logits="all").logits
    got = np.asarray(gpu.forward(st, ids, logits="all").logits)
    st.commit(range(len(ids)))
    gpu.forward(st, [5], logits="last")
    st.commit([0])
    st.reset()
    again = np.asarray(gpu.forward(st, ids, logits="all").logits)
    worst = _max_diff(want, got)
    print(f"eager chunk of {len(ids)} tokens on a width-1 state: max |GPU - NumPy| {worst:.4g}")
    assert worst <= LOGIT_TOL, f"{worst:.4g} > {LOGIT_TOL}"
    assert np.array_equal(again, got), _max_diff(again, got)


@needs_gpu
@pytest.mark.parametrize("parents, path", [
    ([-1, 0, 0, 1, 2, 3, 3, 5, 2], [0, 2, 4]),
    ([-1, 0, 1, 2, 0, 4, 5, 6, 7], [0, 4, 5, 6, 7, 8]),       # a deep second branch: KV rows move, conv gathers
])
def test_tree_forward_and_commit_equal_plain_decode(parents, path):
    cpu, gpu, ids, _ = models()
    rng = np.random.default_rng(len(path))
    tokens = rng.integers(0, gpu.cfg.n_vocab, size=len(parents))
    nxt = int(rng.integers(0, gpu.cfg.n_vocab))
    tree, plain = gpu.new_state(128), gpu.new_state(128)
    for st in (tree, plain):
        gpu.forward(st, ids, logits="none")
        st.commit(range(len(ids)))
    out = gpu.forward(tree, tokens, parents, checkpoints=True, logits="all")
    tree.commit(path)
    after_tree = gpu.forward(tree, [nxt], logits="last").logits[-1]
    along = []
    for i in path:
        along.append(gpu.forward(plain, [int(tokens[i])], logits="last").logits[-1])
        plain.commit([0])
    after_plain = gpu.forward(plain, [nxt], logits="last").logits[-1]
    assert tree.n_past == plain.n_past == len(ids) + len(path)
    assert _max_diff(out.logits[path], np.stack(along)) <= PATH_TOL
    assert _max_diff(after_tree, after_plain) <= PATH_TOL
    # and the tree's logits match the NumPy engine's tree forward
    cs = cpu.new_state(128)
    cpu.forward(cs, ids, logits="none")
    cs.commit(range(len(ids)))
    assert _max_diff(cpu.forward(cs, tokens, parents, checkpoints=True).logits, out.logits) <= LOGIT_TOL


@needs_gpu
def test_wide_tree_and_long_chain_match_numpy():
    """65 tree nodes (past the attention kernel's 64-token mask: the CuPy fallback) and a 150-token chain
    (attention in blocks of 64), both against the NumPy engine, then a commit of a deep path."""
    cpu, gpu, ids, _ = models()
    rng = np.random.default_rng(5)
    long_ids = rng.integers(0, gpu.cfg.n_vocab, size=150)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 65)]
    tokens = rng.integers(0, gpu.cfg.n_vocab, size=65)
    cs, gs = cpu.new_state(400), gpu.new_state(400)
    a, b = cpu.forward(cs, long_ids, logits="all"), gpu.forward(gs, long_ids, logits="all")
    assert _max_diff(a.logits, b.logits) <= LOGIT_TOL
    cs.commit(range(150))
    gs.commit(range(150))
    a = cpu.forward(cs, tokens, parents, checkpoints=True, capture=[1, 5])
    b = gpu.forward(gs, tokens, parents, checkpoints=True, capture=[1, 5])
    assert _max_diff(a.logits, b.logits) <= LOGIT_TOL
    assert b.captured.shape == (65, 2, gpu.cfg.n_embd)
    assert _max_diff(a.captured, b.captured) <= LOGIT_TOL
    _commit_path_and_compare(cpu, gpu, cs, gs, parents, 64)


def _commit_path_and_compare(cpu, gpu, cs, gs, parents, node: int) -> None:
    """Commit the root -> node path of a tree step on both engines; the next token's logits then agree."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    cs.commit(path)
    gs.commit(path)
    assert _max_diff(cpu.forward(cs, [7], logits="last").logits, gpu.forward(gs, [7], logits="last").logits) \
        <= LOGIT_TOL


@needs_gpu
def test_speculative_greedy_equals_plain_greedy_on_gpu():
    from services.engine.backend import NumpyBackend
    from services.engine.generate import generate
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    _, gpu, ids, draft_path = models()
    plain = generate(gpu, ids, 40).token_ids
    for budget in (None, 22, 64):
        drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
        res = speculative_generate(gpu, LocalProposer(drafter), ids, 40, spec=SpecConfig(budget=budget))
        assert res.token_ids == plain, f"budget {budget}"
        assert res.spec["steps"] > 0


def _graph_script(gpu, ids, use_graphs: bool) -> list[np.ndarray]:
    """Prefill, decode steps (S grows by one each), two different trees of one width with different commits,
    a chain verify with captured layers, more decode: every logits row, with graphs on or off."""
    gpu.use_graphs = use_graphs
    rng = np.random.default_rng(11)
    st = gpu.new_state(256)
    out = [gpu.forward(st, ids, logits="all").logits]
    st.commit(range(len(ids)))
    tok = int(np.argmax(out[-1][-1]))
    for _ in range(6):
        out.append(gpu.forward(st, [tok], logits="last").logits)
        st.commit([0])
        tok = int(np.argmax(out[-1][-1]))
    for parents, path in (([-1, 0, 0, 1, 2, 3, 3, 5, 2], [0, 2, 4]), ([-1, 0, 1, 2, 0, 4, 5, 6, 7], [0, 4, 5, 6])):
        toks = rng.integers(0, gpu.cfg.n_vocab, size=len(parents))
        out.append(gpu.forward(st, toks, parents, checkpoints=True, logits="all").logits)
        st.commit(path)
    for _ in range(2):  # the same chain shape twice: the second is a replay
        r = gpu.forward(st, rng.integers(0, gpu.cfg.n_vocab, size=5), checkpoints=True, capture=[1, 3])
        out += [r.logits, r.captured.reshape(5, -1)]
        st.commit([0, 1])
    for _ in range(4):
        out.append(gpu.forward(st, [tok], logits="last").logits)
        st.commit([0])
        tok = int(np.argmax(out[-1][-1]))
    return out


@needs_gpu
def test_graph_replay_equals_eager_launches():
    cpu, gpu, ids, _ = models()
    before = dict(gpu.graph_stats)
    try:
        eager = _graph_script(gpu, ids, False)
        graphed = _graph_script(gpu, ids, True)
    finally:
        gpu.use_graphs = True
    after = gpu.graph_stats
    assert gpu.graph_blocker is None, gpu.graph_blocker
    assert after["failed"] == before["failed"]
    # shapes: decode, tree 9, chain 5 + capture: 3 captures (the prompt, with every row's logits, runs eagerly: not a
    # prompt chunk of PROMPT_GRAPHS); replays: 9 decode, 1 tree, 1 chain
    assert after["captures"] - before["captures"] == 3
    assert after["replays"] - before["replays"] == 11
    # every result is kept, and a graph step writes its results into the state's output buffers: each of the 13
    # graph steps after the first decode step finds the previous step's logits held and copies them (the eager
    # prompt's are its own), and the two steps after a chain step also its captured rows (still held by `r`)
    assert after["detached"] - before["detached"] == 15
    worst = max(_max_diff(a, b) for a, b in zip(eager, graphed))
    print(f"graph vs eager: max |difference| {worst:.3g} over {len(eager)} outputs")
    assert worst <= GRAPH_TOL, f"max |graph - eager| {worst:.3g} > {GRAPH_TOL}"


@needs_gpu
def test_graphs_greedy_and_speculative_equal_numpy():
    from services.engine.backend import NumpyBackend
    from services.engine.generate import generate
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    cpu, gpu, ids, draft_path = models()
    gpu.use_graphs = True
    replays = gpu.graph_stats["replays"]
    want = generate(cpu, ids, 48).token_ids
    assert generate(gpu, ids, 48).token_ids == want
    drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
    res = speculative_generate(gpu, LocalProposer(drafter), ids, 48, spec=SpecConfig(budget=22))
    assert res.token_ids == want
    assert gpu.graph_stats["replays"] - replays >= 48, "graphs were not replayed"
    assert gpu.graph_blocker is None, gpu.graph_blocker


def test_graph_heap_places_and_frees_like_its_warm_up():
    """The arena allocator (CPU only: a fake CuPy memory API): a measuring pass and a placing pass of one
    allocation sequence give the same offsets, freed blocks are reused and coalesced, overflow is an error (not an
    out-of-memory one: a capture that allocates unlike its warm-up is a bug)."""
    import types

    from services.engine.models.qwen35_gpu import GraphArenaOverflow, _GraphHeap

    class Mem:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self.owner = ptr, size, owner

    class Ptr:
        def __init__(self, mem, off):
            self.mem, self.ptr = mem, mem.ptr + off

    pool = types.SimpleNamespace(malloc=lambda n: types.SimpleNamespace(ptr=7 << 40))
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(UnownedMemory=Mem, MemoryPointer=Ptr,
                                                          Device=lambda: types.SimpleNamespace(id=0)),
                               get_default_memory_pool=lambda: pool)

    def run(heap):
        a, b = heap.malloc(1000), heap.malloc(100)
        del a                                   # 1024 bytes free at offset 0
        c = heap.malloc(512)                    # reuses offset 0
        d = heap.malloc(2048)                   # does not fit the hole: after b
        offs = [c.ptr, d.ptr, b.ptr]
        del b, c, d
        return offs

    probe = _GraphHeap(cp, None)
    run(probe)
    assert probe.peak == 1024 + 512 + 2048
    assert probe.free == [(0, 1 << 62)]         # everything returned and coalesced
    base = types.SimpleNamespace(nbytes=probe.peak, data=types.SimpleNamespace(ptr=1 << 20))
    heap = _GraphHeap(cp, base)
    assert run(heap) == [(1 << 20) + 0, (1 << 20) + 1536, (1 << 20) + 1024]
    keep = heap.malloc(probe.peak)
    with pytest.raises(GraphArenaOverflow):
        heap.malloc(1)
    del keep
    assert heap.free == [(0, probe.peak)]


def test_device_cuda_without_gpu_backend_is_a_clear_error(capsys):
    if _REASON is None:
        pytest.skip("a GPU backend is available here")
    from services.cli import main

    rc = main(["generate", "--device", "cuda:0", "--prompt", "x", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "GPU backend not available" in err and "--device cpu" in err
    assert _REASON.split(" ")[0] in err


# -- logits left on the device (DeviceLogits) -----------------------------------------------------------------


@needs_gpu
def test_device_logits_rows_and_argmax():
    """forward keeps the rows on the device: argmax_rows is np.argmax of the fetched rows, indexing copies what it
    names, and a result still held when its graph replays keeps its own rows."""
    from services.engine.models.qwen35_gpu import DeviceLogits

    cpu, gpu, ids, _ = models()
    gpu.use_graphs = True
    rng = np.random.default_rng(21)
    parents = [-1, 0, 0, 1, 2, 3, 3, 5, 2]
    st = gpu.new_state(128)
    gpu.forward(st, ids, logits="none")
    st.commit(range(len(ids)))
    held = []
    for _ in range(3):   # eager warm-up + capture, then two replays of the same shape
        r = gpu.forward(st, rng.integers(0, gpu.cfg.n_vocab, size=9), parents, checkpoints=True)
        st.commit([0, 2])
        held.append((r.logits, np.asarray(r.logits)))
    for lg, host in held:
        assert isinstance(lg, DeviceLogits) and lg.shape == host.shape == (9, gpu.cfg.n_vocab) and len(lg) == 9
        assert np.array_equal(np.asarray(lg), host), "a held result changed when its graph replayed"
        best = lg.argmax_rows()
        assert best.dtype == np.int64 and np.array_equal(best, np.argmax(host, axis=-1))
        assert np.array_equal(np.argmax(lg, axis=-1), best)
        assert np.array_equal(lg[-1], host[-1]) and lg[3].dtype == np.float32
        assert np.array_equal(lg[[0, 4, 2]], host[[0, 4, 2]]) and np.array_equal(lg[1:3], host[1:3])
    last = gpu.forward(st, [5], logits="last").logits
    assert last.shape == (1, gpu.cfg.n_vocab) and last.argmax_rows()[0] == int(np.argmax(last[0]))


@needs_gpu
def test_sampled_speculative_runs_on_gpu():
    """A sampled request walks the tree on rows fetched one at a time; same seed, same tokens, twice."""
    from services.engine.backend import NumpyBackend
    from services.engine.models.dflash import load_drafter
    from services.engine.sampling import SamplingParams
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    _, gpu, ids, draft_path = models()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
        res = speculative_generate(gpu, LocalProposer(drafter), ids, 32, params, spec=SpecConfig(budget=22))
        assert res.spec["steps"] > 0 and len(res.token_ids) == 32
        assert all(0 <= t < gpu.cfg.n_vocab for t in res.token_ids)
        runs.append(res.token_ids)
    assert runs[0] == runs[1]


def test_greedy_reads_device_argmax_and_sampling_draws_on_the_device(monkeypatch):
    """sample_row / walk_tree on a DeviceLogits over a NumPy stand-in for the device: greedy follows argmax_rows
    and copies no row; a sampled walk draws through sample_rows (here the NumPy twin in place of the kernels),
    copies no row either, and draws what the host rows would."""
    import types

    from kernels import loader as kl
    from services.engine.ddtree import build_chain
    from services.engine.models import qwen35_gpu
    from services.engine.models.qwen35_gpu import DeviceLogits
    from services.engine.sampling import SamplingParams, greedy_tokens, sample_row
    from services.engine.speculative import walk_tree
    from tests.sampling_twin import twin_draw_rows

    copies = []
    dev = types.SimpleNamespace(asarray=np.asarray, asnumpy=lambda a: copies.append(np.shape(a)) or np.array(a))
    monkeypatch.setattr(kl, "require", lambda: dev)
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((6, 50)).astype(np.float32)
    chain = np.argmax(rows, axis=-1)[:5]                      # a chain the greedy target accepts whole
    tree = build_chain(chain[:, None], np.zeros((5, 1)), 5)
    lg = DeviceLogits(rows, np.argmax(rows, axis=-1).astype(np.int32))
    greedy = SamplingParams()
    want = ([0, 1, 2, 3, 4, 5], int(np.argmax(rows[5])))
    assert walk_tree(tree, lg, greedy, rng) == walk_tree(tree, rows, greedy, rng) == want
    assert sample_row(lg, -1, greedy, rng) == int(np.argmax(rows[-1])) and copies == []
    assert np.array_equal(greedy_tokens(lg), np.argmax(rows, axis=-1)) and copies == []
    # a marked argmax shows which source greedy read
    assert sample_row(DeviceLogits(rows, np.full(6, 7, np.int32)), 2, greedy, rng) == 7
    monkeypatch.setattr(qwen35_gpu, "draw_rows", twin_draw_rows)
    hot = SamplingParams(temperature=1.0, seed=3)
    a = walk_tree(tree, lg, hot, np.random.default_rng(9))
    assert a == walk_tree(tree, rows, hot, np.random.default_rng(9))
    assert copies == []


# -- TQ3_0 KV on the GPU ------------------------------------------------------------------------------------------


def test_decode_rows_match_the_numpy_twins():
    """The wide-tree fallback's row decoder (written for CuPy, run here on NumPy) against the engine's twins."""
    from services.engine.models.qwen35_gpu import _decode_rows
    from services.engine.quants import legacy, tq3

    rng = np.random.default_rng(3)
    for d in (64, 128, 256):
        x = rng.standard_normal((2, 5, d)).astype(np.float32)            # (Hkv, n, head_dim)
        packed = tq3.quantize_tq3_0(x).reshape(2, 5, -1)
        want = tq3.dequantize_tq3_0(tq3.quantize_tq3_0(x))
        assert np.allclose(_decode_rows(np, packed, "tq3_0", d), want, rtol=0, atol=1e-6)
        q8 = legacy.quantize_q8_0(x.reshape(-1, 32)).reshape(2, 5, -1)
        want = legacy.dequantize_q8_0(q8.reshape(-1, 34)).reshape(x.shape)
        assert np.array_equal(_decode_rows(np, q8, "q8_0", d), want)
        f16 = x.astype(np.float16).view(np.uint8).reshape(2, 5, -1)
        assert np.array_equal(_decode_rows(np, f16, "f16", d), x.astype(np.float16).astype(np.float32))


def test_kv_types_and_memory_plan_match_the_gpu_allocation():
    """K and V kinds are independent on the GPU (auto as on the CPU, f32 kept as f16), and the memory plan counts
    the bytes a GpuSequenceState allocates: KVCacheLayer's rows per kind, whole 32-row tiles (allocated for real
    when there is a GPU)."""
    from kernels import attention as att
    from services.engine.default_model import default_model_paths
    from services.engine.formats import open_model_file
    from services.engine.kvcache import resolve_cache_types
    from services.engine.loader import config_of
    from services.engine.memory_plan import kv_cache_bytes
    from services.engine.models.qwen35_gpu import gpu_kv_type

    cfg = config_of(open_model_file(default_model_paths()[0]))
    n_attn = sum(1 for r in cfg.recurrent_layers if not r)
    assert [gpu_kv_type(t) for t in ("f32", "f16", "q8_0", "tq3_0")] == ["f16", "f16", "q8_0", "tq3_0"]
    auto = resolve_cache_types(cfg)
    for k, v in (("tq3_0", "tq3_0"), ("q8_0", "tq3_0"), ("tq3_0", "f16"), ("f32", "q8_0"), auto):
        for ctx in (100, 256):
            gk, gv = gpu_kv_type(k), gpu_kv_type(v)
            rows = -(-ctx // att.KT) * att.KT
            want = n_attn * cfg.n_head_kv * rows * (att.row_bytes(gk, cfg.head_dim) + att.row_bytes(gv, cfg.head_dim))
            assert kv_cache_bytes(cfg, k, v, ctx, "cuda") == want, (k, v, ctx)
            if _REASON is None:
                st = models()[1].new_state(ctx, k, v)
                assert st.kv_types == (gk, gv)
                assert sum(c.nbytes for c in st.kv.values()) == want
    # the DeltaNet buffers: per node and layer a conv output row and g, beta (the commit replays the accepted path)
    # for the planned state width (a verify of budget 22 is 23 nodes, a prompt's graph steps 64) and the walk plan;
    # the committed state and a chain step's final state; the conv window with a prefill chunk's raw rows
    from services.engine.memory_plan import GPU_PROMPT_STEP, GPU_RAW_ROWS, Device, PlanSettings, WeightBytes, build_plan

    n_rec = sum(1 for r in cfg.recurrent_layers if r)
    full = build_plan(cfg, WeightBytes.of({}), PlanSettings(max_ctx=256, device=Device("cuda", 0), budget=22), None,
                      free={"cuda:0": (1 << 40, 1 << 40)}, sms=132)  # fmt: skip
    plan, nodes = full.devices[0], GPU_PROMPT_STEP
    assert full.width == 23 and full.state_width == nodes == 64
    replay = n_rec * nodes * (cfg.ssm_conv_dim + 2 * cfg.ssm_n_v_heads) * 4 + nodes * 4
    state = n_rec * cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim * 4
    conv = n_rec * (cfg.ssm_conv_kernel - 1 + GPU_RAW_ROWS) * cfg.ssm_conv_dim * 4
    assert plan.get("recurrent replay inputs") == replay and plan.get("recurrent state") == 2 * state
    assert plan.get("recurrent checkpoints") == 0 and plan.get("conv windows") == conv
    if _REASON is None:
        from services.engine.models.qwen35_gpu import GpuSequenceState

        st = GpuSequenceState(cfg, 256, "f16", "f16", max_tree=nodes)
        assert st.mixed.nbytes + st.gates.nbytes + st.plan.nbytes == replay
        assert st.ssm.nbytes + st.ssm_final.nbytes == 2 * state
        assert st.conv.nbytes + st.raw.nbytes == conv
    if _REASON is None:
        gpu = models()[1]
        try:
            assert gpu.set_kv_cache_types() == tuple(gpu_kv_type(t) for t in auto)
            assert gpu.set_kv_cache_types("q8_0", "tq3_0") == ("q8_0", "tq3_0")
        finally:
            gpu.set_kv_cache_types("f16", "f16")


TQ3_KINDS = [("tq3_0", "tq3_0"), ("q8_0", "tq3_0")]


@needs_gpu
@pytest.mark.parametrize("kind_k, kind_v", TQ3_KINDS)
def test_tq3_kv_logits_match_numpy(kind_k, kind_v):
    """GPU vs NumPy engine with the same quantized KV types: prefill, 16 teacher-forced decode steps, then a
    65-node tree (the CuPy fallback decodes the TQ3_0 rows) and the decode after a deep commit."""
    import cupy

    from services.engine.models.qwen35_gpu import _decode_rows

    cpu, gpu, ids, _ = models()
    cs, gs = cpu.new_state(256, kind_k, kind_v), gpu.new_state(256, kind_k, kind_v)
    rc, rg = cpu.forward(cs, ids, logits="all"), gpu.forward(gs, ids, logits="all")
    cs.commit(range(len(ids)))
    gs.commit(range(len(ids)))
    worst = _max_diff(rc.logits, rg.logits)
    tok = int(np.argmax(rc.logits[-1]))
    for _ in range(16):
        rc, rg = cpu.forward(cs, [tok], logits="last"), gpu.forward(gs, [tok], logits="last")
        cs.commit([0])
        gs.commit([0])
        worst = max(worst, _max_diff(rc.logits, rg.logits))
        tok = int(np.argmax(rc.logits[-1]))
    # the fallback's CuPy decoder reads what the store kernel wrote as the host decoder does
    c = next(iter(gs.kv.values()))
    n = gs.n_past
    for buf, rb, kind, host in ((c.k, c.row_bytes, c.kind, c.rows(n)[0]), (c.v, c.row_bytes_v, c.kind_v, c.rows(n)[1])):
        dev = _decode_rows(cupy, buf.reshape(c.n_kv_heads, c.ctx, rb)[:, :n], kind, c.head_dim)
        assert np.allclose(cupy.asnumpy(dev).transpose(1, 0, 2), host, rtol=0, atol=1e-5)
    rng = np.random.default_rng(5)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 65)]
    tokens = rng.integers(0, gpu.cfg.n_vocab, size=65)
    a = cpu.forward(cs, tokens, parents, checkpoints=True)
    b = gpu.forward(gs, tokens, parents, checkpoints=True)
    wide = _max_diff(a.logits, b.logits)
    node, path = 64, []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    cs.commit(path)
    gs.commit(path)
    after = _max_diff(cpu.forward(cs, [7], logits="last").logits, gpu.forward(gs, [7], logits="last").logits)
    print(f"{kind_k}/{kind_v}: max |GPU - NumPy| decode {worst:.4g}, 65-node tree {wide:.4g}, after commit {after:.4g}")
    assert max(worst, wide, after) <= TQ3_TOL, f"{worst:.4g} / {wide:.4g} / {after:.4g} > {TQ3_TOL}"


@needs_gpu
@pytest.mark.parametrize("kind_k, kind_v", TQ3_KINDS)
def test_tq3_tree_commit_equals_plain_decode_with_graphs(kind_k, kind_v):
    """Two trees of one shape (the second a graph replay) committed along branches that move KV rows, against
    plain decoding of the same tokens (replayed too), both with TQ3_0 KV on the GPU."""
    cpu, gpu, ids, _ = models()
    gpu.use_graphs = True
    replays = gpu.graph_stats["replays"]
    rng = np.random.default_rng(17)
    parents = [-1, 0, 1, 2, 0, 4, 5, 6, 7]
    tree, plain = gpu.new_state(128, kind_k, kind_v), gpu.new_state(128, kind_k, kind_v)
    for st in (tree, plain):
        gpu.forward(st, ids, logits="none")
        st.commit(range(len(ids)))
    worst = 0.0
    for path in ([0, 4, 5, 6, 7, 8], [0, 1, 2]):
        tokens = rng.integers(0, gpu.cfg.n_vocab, size=len(parents))
        out = gpu.forward(tree, tokens, parents, checkpoints=True, logits="all")
        tree.commit(path)
        along = []
        for i in path:
            along.append(gpu.forward(plain, [int(tokens[i])], logits="last").logits[-1])
            plain.commit([0])
        worst = max(worst, _max_diff(out.logits[path], np.stack(along)))
    nxt = int(rng.integers(0, gpu.cfg.n_vocab))
    worst = max(worst, _max_diff(gpu.forward(tree, [nxt], logits="last").logits,
                                 gpu.forward(plain, [nxt], logits="last").logits))
    assert tree.n_past == plain.n_past == len(ids) + 9
    assert gpu.graph_stats["replays"] - replays >= 8 and gpu.graph_blocker is None, gpu.graph_blocker
    print(f"{kind_k}/{kind_v}: tree + commit vs plain decode, max |difference| {worst:.4g}")
    assert worst <= TQ3_PATH_TOL, f"{worst:.4g} > {TQ3_PATH_TOL}"


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 3, 23])
def test_mixed_type_stack_equals_separate_products(tokens):
    """A GpuStack of mixed storage types (the DeltaNet input stack's shape: Q6_K | Q4_K x3, then a Q8_0) runs one
    product per run of consecutive same-type members, each written into its columns of the stacked output: the
    same values as separate products side by side (to fp32 summation order: a run's launch shape may differ from
    its members'), accumulate adds into out, and a column slice of a wider output works as out."""
    import cupy

    from kernels import quant_matmul as qm
    from services.engine.backend import CupyBackend, GpuMatrix, GpuStack
    from tests.quant_twins import dequantize, random_weights, rel_error

    rng = np.random.default_rng(tokens)
    k = 512
    spec = [(qm.Q6_K, 96, "qkv"), (qm.Q4_K, 64, "gate"), (qm.Q4_K, 48, "beta"), (qm.Q4_K, 48, "alpha"),
            (qm.Q8_0, 40, "extra")]
    raws = [(q, random_weights(q, n, k, rng), n, name) for q, n, name in spec]
    be = CupyBackend()
    stack = be.stack([GpuMatrix(q, raw, (n, k), name) for q, raw, n, name in raws])
    assert isinstance(stack, GpuStack) and len(stack.mats) == 3, "consecutive Q4_K members share one matrix"
    assert [m.shape[0] for m in stack.mats] == [96, 160, 40] and stack.shape == (296, k)
    separate = [GpuMatrix(q, raw, (n, k), name).upload() for q, raw, n, name in raws]
    x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16))
    y = cupy.asnumpy(stack.upload().matmul(x))
    want = np.concatenate([cupy.asnumpy(m.matmul(x)) for m in separate], axis=1)
    assert rel_error(y, want) < 1e-5
    w64 = np.concatenate([dequantize(q, raw, n, k) for q, raw, n, _ in raws])
    assert rel_error(y, cupy.asnumpy(x).astype(np.float64) @ w64.T) < 2e-3
    y0 = cupy.asarray(rng.standard_normal((tokens, stack.shape[0])).astype(np.float32))
    acc = y0.copy()
    assert stack.matmul(qm.pack_activations(x), out=acc, accumulate=True) is acc
    assert rel_error(cupy.asnumpy(acc), cupy.asnumpy(y0) + y) < 1e-5
    wide = cupy.full((tokens, stack.shape[0] + 24), 7.25, cupy.float32)
    stack.matmul(x, out=wide[:, 8:8 + stack.shape[0]])
    host = cupy.asnumpy(wide)
    assert rel_error(host[:, 8:8 + stack.shape[0]], y) < 1e-5
    assert (host[:, :8] == 7.25).all() and (host[:, 8 + stack.shape[0]:] == 7.25).all()


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_mixed_type_stack_in_a_graph_runs_later_products_on_a_side_stream(tokens, monkeypatch):
    """Captured into a CUDA graph, a stack whose runs are all gemv ring launches puts its later runs on a side stream
    (a fork and a join in the graph): replays on new inputs equal eager products of the same inputs bit for bit."""
    import cupy

    from kernels import quant_matmul as qm
    from services.engine import backend as B
    from tests.quant_twins import random_weights

    rng = np.random.default_rng(40 + tokens)
    k = 1024
    raws = [(qm.Q6_K, random_weights(qm.Q6_K, 96, k, rng), 96), (qm.Q4_K, random_weights(qm.Q4_K, 160, k, rng), 160)]
    stack = B.CupyBackend().stack([B.GpuMatrix(q, raw, (n, k), f"m{i}") for i, (q, raw, n) in enumerate(raws)])
    assert isinstance(stack, B.GpuStack) and len(stack.mats) == 2
    stack.upload()
    sides = []
    real = B.GpuStack._side_stream
    monkeypatch.setattr(B.GpuStack, "_side_stream", lambda self, cp, px: sides.append(real(self, cp, px)) or sides[-1])
    x = cupy.zeros((tokens, k), cupy.float32)
    y = cupy.zeros((tokens, stack.shape[0]), cupy.float32)
    keep = []

    def step():
        px = qm.pack_activations(x)
        stack.matmul(px, out=y)
        keep.append(px)     # the pack's buffers live as long as the graph

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()              # eager: makes the device's side stream
        stream.synchronize()
        assert sides[-1] is None
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    assert sides[-1] is not None, "the capture ran the stack's later run on the side stream"
    for _ in range(3):
        x0 = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float32))
        cupy.cuda.Device().synchronize()
        with stream:
            x[...] = x0
            graph.launch(stream)
            stream.synchronize()
        got = cupy.asnumpy(y)
        want = cupy.asnumpy(stack.matmul(qm.pack_activations(x0)))
        assert np.array_equal(got, want)


def _step_by_step(gpu, st, tok: int, n: int) -> list[int]:
    """n greedy tokens after tok by forward + commit, the host reading each token before the next step."""
    out = []
    for _ in range(n):
        r = gpu.forward(st, [tok], logits="last")
        st.commit([0])
        tok = int(r.logits.argmax_rows()[0])
        out.append(tok)
    return out


def _prefilled(gpu, ids, max_ctx: int):
    st = gpu.new_state(max_ctx)
    tok = int(gpu.forward(st, ids, logits="last").logits.argmax_rows()[-1])
    st.commit(range(len(ids)))
    return st, tok


@needs_gpu
@pytest.mark.parametrize("prompt_len, n, stop_after", [(None, 40, None), (None, 40, 7), (500, 30, None)],
                         ids=["whole", "closed-early", "across-a-graph-bucket"])
def test_decode_ahead_equals_decoding_step_by_step(prompt_len, n, stop_after):
    """decode_ahead (one graph a step: the step, its commit and the next step's values written on the device; each
    step enqueued before the host reads the token before it) gives the tokens of forward + commit one at a time, and
    leaves the state as they do: the same length and committed half, and the same logits for the next token. A
    generator closed early has also run and committed the step after the last token read. The 500-token prompt
    crosses S's first graph bucket (512) mid-run: a capture among replays."""
    _, gpu, ids, _ = models()
    if prompt_len is not None:
        ids = list(np.random.default_rng(3).integers(0, gpu.cfg.n_vocab, size=prompt_len))
    sa, tok = _prefilled(gpu, ids, 1024)
    sb, tok_b = _prefilled(gpu, ids, 1024)
    assert tok == tok_b
    k = n if stop_after is None else stop_after
    gen = gpu.decode_ahead(sb, tok, n)
    got = [next(gen) for _ in range(k)] if stop_after is not None else list(gen)
    gen.close()
    fed = k if stop_after is None else k + 1   # closed early: the step feeding got[-1] ran too
    want = _step_by_step(gpu, sa, tok, fed)    # feeds tok and want[:fed - 1]
    assert got == want[:k]
    assert (sb.n_past, sb.parity, sb.pending) == (sa.n_past, sa.parity, None)
    ra, rb = gpu.forward(sa, [want[-1]], logits="last"), gpu.forward(sb, [want[-1]], logits="last")
    assert _max_diff(ra.logits, rb.logits) <= 1e-5


@needs_gpu
def test_decode_ahead_stops_at_the_context_end_and_serves_generate(monkeypatch):
    """generate() and the speculative loop without a drafter decode ahead when greedy (the NumPy engine's tokens),
    one graph replay a token once warm; a stop id ends the request (the step after it runs), and the pooled state
    serves the next request alike; a full context ends decoding like the step-by-step loop."""
    from services.engine.generate import generate
    from services.engine.speculative import speculative_generate

    cpu, gpu, ids, _ = models()
    calls = []
    real = gpu.decode_ahead
    monkeypatch.setattr(gpu, "decode_ahead", lambda *a: calls.append(a[2]) or real(*a))
    want = generate(cpu, ids, 30).token_ids
    assert generate(gpu, ids, 30).token_ids == want and calls == [29]
    replays, captures = gpu.graph_stats["replays"], gpu.graph_stats["captures"]
    assert generate(gpu, ids, 30).token_ids == want and gpu.graph_stats["captures"] == captures
    assert gpu.graph_stats["replays"] - replays == 30       # the prompt's chunk (PROMPT_GRAPHS), 29 decode steps
    assert speculative_generate(gpu, None, ids, 30).token_ids == want and calls[-1] == 29
    stop = want[12]
    first = want.index(stop)
    res = generate(gpu, ids, 30, stop_ids=[stop])
    assert res.token_ids == want[:first + 1] and res.finish_reason == "stop"
    assert generate(gpu, ids, 30).token_ids == want
    ctx = len(ids) + 9
    full = generate(cpu, ids, 30, max_ctx=ctx)
    res = generate(gpu, ids, 30, max_ctx=ctx)
    assert res.token_ids == full.token_ids and res.finish_reason == full.finish_reason == "length"
    gpu.decode_ahead_on = False
    try:
        n = len(calls)
        assert generate(gpu, ids, 30).token_ids == want and len(calls) == n
    finally:
        gpu.decode_ahead_on = True


@needs_gpu
def test_verify_widths_on_the_wgmma_build_match_numpy(monkeypatch):
    """Where the device has the wgmma build (sm_90a), a tree step of WG_FROM..64 tokens packs x in its order and runs
    the wide products of those packs on it (counted; the embedded model's Q8_0 matrices take the wide kernel from
    quant_wide.CROSSOVER, below which their packs keep the mma order: quant_wide.wg_pack); the logits match the NumPy
    engine and the mma build's step within LOGIT_TOL, and a commit of a path on top decodes as the NumPy engine does."""
    from kernels import quant_matmul as qm
    from kernels import quant_wide as qw

    cpu, gpu, ids, _ = models()
    if not loader.arch_specific_available():
        pytest.skip("the wgmma build needs an sm_90 CUDA device (the sm_90a target)")
    assert gpu.wgmma and gpu.pack_order(qw.WG_FROM) == 1 and gpu.pack_order(qw.WG_FROM - 1) == 0
    calls, wg_from = [], qw.WG_FROM
    real = qw.launch_shape
    monkeypatch.setattr(qw, "launch_shape", lambda *a, **kw: calls.append(bool(kw.get("wg"))) or real(*a, **kw))
    rng = np.random.default_rng(23)
    for T in sorted({qw.WG_FROM, qw.CROSSOVER[qm.Q8_0], 41, 64}):
        parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, T)]
        tokens = rng.integers(0, gpu.cfg.n_vocab, size=T)
        cs, gs, gm = cpu.new_state(200), gpu.new_state(200), gpu.new_state(200)
        cpu.forward(cs, ids, logits="last")  # three fresh sequences with the same prompt
        gpu.forward(gs, ids, logits="last")
        gpu.forward(gm, ids, logits="last")
        cs.commit(range(len(ids)))
        gs.commit(range(len(ids)))
        gm.commit(range(len(ids)))
        calls.clear()
        a = cpu.forward(cs, tokens, parents, checkpoints=True)
        b = gpu.forward(gs, tokens, parents, checkpoints=True)
        # (every layer's input and ffn_down packs at least, where those products are wide)
        if qw.prefer_wide(qm.Q8_0, T, order=1):
            assert sum(calls) >= 2 * len(gpu.layers), f"T={T}: the step's wide products ran {calls}"
        else:
            assert not any(calls), f"T={T}: a product on the wgmma build where v2 runs the step's products"
        monkeypatch.setattr(qw, "WG_FROM", 0)
        calls.clear()
        c = gpu.forward(gm, tokens, parents, checkpoints=True)
        assert not any(calls)
        monkeypatch.setattr(qw, "WG_FROM", wg_from)
        assert _max_diff(a.logits, b.logits) <= LOGIT_TOL, f"T={T}"
        assert _max_diff(b.logits, c.logits) <= LOGIT_TOL, f"T={T}"
        _commit_path_and_compare(cpu, gpu, cs, gs, parents, T - 1)
