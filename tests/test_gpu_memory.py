"""The GPU engine's memory against the memory plan (services/engine/memory_plan.py).

On the CPU (a NumPy stand-in for CuPy's allocation calls): a GpuSequenceState and a GpuDraftSession hold exactly the
bytes the plan counts per slot, the shared graph arena grows and drops the graphs over it, allocation failures are
recognised, the constants the planner mirrors match the engine's. With a GPU (skipped otherwise): after requests of
many widths and lengths the CuPy pool, the arena and the states stay within the plan (bench/memory_check.py in a
fresh process), and a real CuPy allocation failure mid-request fails that request alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from kernels import loader
from services.engine import faults
from services.engine import memory_plan as M
from services.engine import synthetic as S
from services.engine.errors import DeviceMemoryError, is_out_of_memory
from tests.fake_cupy import fake_cupy

ROOT = Path(__file__).resolve().parents[1]
_REASON = loader.unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU memory tests skipped: {_REASON}")


@pytest.fixture
def fake_cp(monkeypatch):
    from services.engine.models import qwen35_gpu as QG

    cp = fake_cupy()
    monkeypatch.setattr(loader, "require", lambda: cp)
    monkeypatch.setattr(QG, "_arenas", {})
    return cp


def _configs():
    """The tiny synthetic shape and a 4-layer Qwen3.6-27B (3 DeltaNet layers, 1 attention layer)."""
    return [S.get_shape("tiny"), S.get_shape("qwen3.6-27b", layers=4)]


@pytest.mark.parametrize("max_ctx, kinds, max_tree, n_capture, host_rows", [
    (100, ("f16", "f16"), 65, 0, False),
    (1000, ("q8_0", "tq3_0"), 23, 5, False),
    (4096, ("tq3_0", "f16"), 16, 2, True),
    (513, ("f32", "q8_0"), 1, 0, True),
])
def test_gpu_state_holds_what_the_plan_counts(fake_cp, max_ctx, kinds, max_tree, n_capture, host_rows):
    from services.engine.models.qwen35_gpu import GpuSequenceState, gpu_kv_type

    for shape in _configs():
        cfg = shape.target
        k, v = (gpu_kv_type(t) for t in kinds)
        st = GpuSequenceState(cfg, max_ctx, k, v, max_tree=max_tree, host_rows=host_rows, n_capture=n_capture)
        planned = M.gpu_state_bytes(cfg, max_ctx, *kinds, max_tree, n_capture, host_rows)
        assert st.nbytes == sum(planned.values()), (cfg.name, planned)
        assert sum(c.nbytes for c in st.kv.values()) == planned["KV cache"]
        assert st.raw.shape[1] == max(max_tree, M.GPU_RAW_ROWS)
        if not n_capture:      # the captured layers' buffer comes with the first capture list
            st.ensure_capture(3)
            assert st.nbytes == sum(M.gpu_state_bytes(cfg, max_ctx, *kinds, max_tree, 3, host_rows).values())


@pytest.mark.parametrize("rows, host_rows", [(4096 + 16, False), (1000, True), (40, False)])
def test_gpu_draft_session_holds_what_the_plan_counts(fake_cp, rows, host_rows):
    from services.engine.models.dflash_gpu import GpuDraftSession

    for shape in _configs():
        dc = shape.drafter
        s = GpuDraftSession(dc, rows, max_rows=rows, host_rows=host_rows)
        planned = M.gpu_session_bytes(M.drafter_shape_of(dc), rows, host_rows)
        assert s.nbytes == sum(planned.values()), (shape.size_label, planned)
        assert s.capacity == rows


def test_graph_arena_is_shared_and_drops_graphs_when_it_grows(fake_cp):
    from services.engine.models import qwen35_gpu as QG

    class Owner:
        def __init__(self):
            self.dropped = 0

        def drop_graphs(self):
            self.dropped += 1

    arena = QG.graph_arena(fake_cp)
    assert QG.graph_arena(fake_cp) is arena and arena.nbytes == 0
    a, b = Owner(), Owner()
    arena.register(a)
    arena.register(b)
    heap = arena.heap_for(10 << 20)                       # the first capture: the arena is made
    need = (10 << 20) + (10 << 20) // 8 + QG.ARENA_SLACK
    assert arena.need == need and arena.nbytes == -(-need // (1 << 20)) << 20 and arena.grown == 1
    assert heap.base is arena.base and (a.dropped, b.dropped) == (1, 1)
    arena.heap_for(1 << 20)                               # a smaller capture fits: nothing is dropped
    assert arena.grown == 1 and (a.dropped, b.dropped) == (1, 1)
    del b                                                 # owners are held weakly
    arena.reserve(64 << 20)                               # the verifier's planned size, at start-up
    assert arena.nbytes == 64 << 20 and arena.grown == 2 and a.dropped == 2
    arena.reserve(32 << 20)
    assert arena.nbytes == 64 << 20 and arena.grown == 2
    arena.reserve(30 << 20, exact=True)                   # the verifier's planned size, exactly
    assert arena.nbytes == 30 << 20 and arena.grown == 3 and a.dropped == 3


def test_state_output_buffers_and_detach(fake_cp):
    """A graph step's results live in the state's output buffers; before the next graph step the results still held
    are given their own copies (and ones let go are not copied)."""
    from services.engine.models.qwen35_gpu import DeviceLogits, DeviceRows, GpuSequenceState

    cfg = S.get_shape("tiny").target
    st = GpuSequenceState(cfg, 64, "f16", "f16", max_tree=8, n_capture=2)
    st.out_logits[:3] = 1.0
    held = DeviceLogits(st.out_logits[:3], np.zeros(3, np.int32))
    rows = DeviceRows(st.out_captured[:3])
    gone = DeviceLogits(st.out_logits[:1], np.zeros(1, np.int32))
    import weakref

    st.handed = [weakref.ref(held), weakref.ref(rows), weakref.ref(gone)]
    del gone
    assert st.detach_results() == 2 and st.handed == []
    st.out_logits[:3] = 2.0
    assert float(held._rows[0, 0]) == 1.0 and not np.shares_memory(held._rows, st.out_logits)
    assert not np.shares_memory(rows.rows, st.out_captured)


def test_captured_layers_buffer_drops_only_the_graphs_over_it(fake_cp):
    """The captured layers' output buffer is made with the first capture list without dropping a graph (graphs without
    captured layers never held its address); remade for another number of layers, it drops only the graphs that
    write into the old one."""
    from services.engine.models.qwen35_gpu import GpuSequenceState

    cfg = S.get_shape("tiny").target
    st = GpuSequenceState(cfg, 64, "f16", "f16", max_tree=8)
    plain, two = types.SimpleNamespace(captured=None), types.SimpleNamespace(captured="rows")
    st.graphs = {"decode": plain, "failed": None}
    buf = st.ensure_capture(2)
    assert buf.shape == (8, 2, cfg.n_embd) and st.graphs == {"decode": plain, "failed": None}
    st.graphs["chain"] = two
    assert st.ensure_capture(2) is buf and "chain" in st.graphs
    assert st.ensure_capture(3).shape == (8, 3, cfg.n_embd)
    assert st.graphs == {"decode": plain, "failed": None}


def test_an_eager_chunk_wider_than_the_state_reads_its_own_mask(fake_cp):
    """forward() writes the ancestor mask of every step the attention kernel takes (up to 64 tokens) into the state's
    step values, also for an eager chunk wider than the state's planned width (a prompt of width + 1 .. 64 tokens),
    which reads it there like a graph step: not the mask an earlier step left in a pooled state."""
    from services.engine.models.qwen35_gpu import CHAIN_MASKS, GpuSequenceState, Qwen35GpuModel

    cfg = S.get_shape("tiny").target
    seen = []

    def launches(state, step, logits, capture, x0=None, into_state=False):
        seen.append(np.array(state.mask[:step.T]))
        return None, None, None

    model = types.SimpleNamespace(be=types.SimpleNamespace(xp=fake_cp), cfg=cfg, _host_table=False, use_graphs=False,
                                  graph_blocker=None, graph_stats={"eager": 0}, device_embed=lambda ids: ids,
                                  _launches=launches)
    model._enqueue = lambda *a, **kw: Qwen35GpuModel._enqueue(model, *a, **kw)
    model._stage_values = lambda *a: Qwen35GpuModel._stage_values(model, *a)
    model._prompt_pad = lambda *a: Qwen35GpuModel._prompt_pad(model, *a)
    model._prompt_top = lambda st: Qwen35GpuModel._prompt_top(model, st)
    st = GpuSequenceState(cfg, 256, "f16", "f16", max_tree=1)
    Qwen35GpuModel.forward(model, st, [3], logits="none")          # a decode step: its one-token mask
    st.pending, st.n_past = None, 1
    Qwen35GpuModel.forward(model, st, [1, 2, 3, 4, 5], logits="none")
    Qwen35GpuModel.forward(model, st, list(range(64)), logits="none")
    assert [m.tolist() for m in seen] == [CHAIN_MASKS[:1].tolist(), CHAIN_MASKS[:5].tolist(),
                                          CHAIN_MASKS[:64].tolist()]
    assert model.graph_stats["eager"] == 3


def test_planner_constants_mirror_the_engine():
    from kernels import attention as att
    from services.engine import generate
    from services.engine.models import dflash_gpu as DG
    from services.engine.models import qwen35_gpu as QG

    assert QG.RAW_ROWS == M.GPU_RAW_ROWS == generate.PREFILL_CHUNK == M.PREFILL_CHUNK
    assert QG.GRAPHS_PER_STATE == M.GPU_GRAPHS_PER_STATE and DG.GRAPHS_PER_SESSION == M.GPU_GRAPHS_PER_SESSION
    assert QG.ARENA_SLACK == M.GPU_ARENA_SLACK and QG.ATTN_TOKENS == M.GPU_ATTN_TOKENS == M.GPU_MAX_WIDTH
    assert DG.MAX_APPEND == M.GPU_MAX_APPEND and DG.TOPK == M.GPU_TOPK and att.KT == M.CUDA_KV_TILE
    assert sorted(QG.STACKS.values()) == sorted(M.GPU_TARGET_STACKS)
    assert sorted(DG.STACKS.values()) == sorted(M.GPU_DRAFTER_STACKS)
    assert M.serving_width(True, 22, 16, "cuda") == 23 and M.serving_width(True, 64, 16, "cuda") == 64
    assert M.serving_width(True, 64, 16, "numpy") == 65 and M.serving_width(True, None, 16, "cuda") == 16
    assert M.serving_width(True, 3, 16, "numpy") == 16 and M.serving_width(False, 22, 16, "cuda") == 1
    # a GPU state holds a prompt's graph steps (qwen35_gpu._prompt_top: min(ATTN_TOKENS, max_tree)) whatever the verify
    assert M.GPU_PROMPT_STEP == QG.ATTN_TOKENS and QG.PROMPT_MIN_WIDTH <= M.GPU_PROMPT_STEP
    from services.engine import speculative

    assert speculative.PROMPT_APPEND_ROWS == M.GPU_PROMPT_APPEND
    assert M.state_width(False, None, 1, "cuda") == M.state_width(True, None, 16, "cuda") == M.GPU_PROMPT_STEP
    assert M.state_width(True, 64, 16, "cuda") == 64 and M.state_width(False, None, 1, "numpy") == 1
    assert M.state_width(True, 22, 16, "numpy") == 23


def test_warm_chunks_cover_every_launch_width_class():
    """warm_prefill's chunks fetch what any prompt launches: every token-tile class (8 tokens a tile) of a fused step
    up to 64 tokens and of the last 64-token slice of a longer chunk (the raw-x products of those run in the mma
    order, which the fused steps of that class may not launch: the wgmma build takes them there), each at the class's
    top width, and a whole prefill chunk. (test_requests_load_no_kernel_and_capture_no_graph_after_start_up checks
    the fetches themselves on a GPU.)"""
    from services.engine import generate
    from services.engine.models import qwen35_gpu as QG

    fused = {n for n in QG.WARM_CHUNKS if n <= QG.ATTN_TOKENS}
    tails = {n - 64 * ((n - 1) // 64) for n in QG.WARM_CHUNKS if 64 < n <= generate.PREFILL_CHUNK}
    assert fused == tails == set(range(8, 65, 8)) and generate.PREFILL_CHUNK in QG.WARM_CHUNKS


def test_out_of_memory_errors_are_recognised():
    def raised(module: str, name: str, **attrs) -> Exception:
        cls = type(name, (Exception,), {"__module__": module})
        e = cls("cudaErrorMemoryAllocation: out of memory")
        for k, v in attrs.items():
            setattr(e, k, v)
        return e

    assert is_out_of_memory(raised("cupy.cuda.memory", "OutOfMemoryError"))
    assert is_out_of_memory(raised("cupy_backends.cuda.api.runtime", "CUDARuntimeError", status=2))
    assert is_out_of_memory(raised("cupy_backends.cuda.api.driver", "CUDADriverError", status=2))
    assert not is_out_of_memory(raised("cupy_backends.cuda.api.driver", "CUDADriverError", status=700))
    assert is_out_of_memory(MemoryError("numpy"))
    assert is_out_of_memory(DeviceMemoryError("x"))
    assert not is_out_of_memory(ValueError("out of memory"))            # only allocation errors count
    assert not is_out_of_memory(raised("cupy.cuda.compiler", "CompileException"))
    from services.engine.models.qwen35_gpu import GraphArenaOverflow

    assert not is_out_of_memory(GraphArenaOverflow("a capture that differs from its warm-up is a bug"))


def test_fault_injection_fires_once_at_the_nth_call(monkeypatch):
    with pytest.raises(ValueError, match="SPECSPLIT_INJECT_OOM"):
        faults.parse("forward:0")
    with pytest.raises(ValueError):
        faults.parse("commit:2")
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.arm() is None
    try:
        assert faults.arm("forward:2") == "forward:2"
        faults.check("forward")
        with pytest.raises(MemoryError, match="injected allocation failure"):
            faults.check("forward")
        faults.check("forward")           # once only
    finally:
        faults.disarm()


def test_gateway_answers_429_out_of_memory():
    import grpc

    from services.gateway.errors import from_grpc

    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "out of memory on cuda:0 after 3 generated tokens (...)"

    e = from_grpc(Err())
    assert e.status == 429 and e.message.startswith("server out of memory") and e.retry_after


# ------------------------------------------------------------------------------------------------ on a GPU


MEMORY_RUNS = {
    # two slots, every step shape a speculative request can bring, then verify steps of every width 1..23
    "speculative": (["--slots", "2", "--budget", "22", "--requests", "12", "--widths", "1-23"], 2, 2),
    # a plain server: verify width 1, states of 64-token steps (a prompt's graph replays), then steps up to 64
    "plain": (["--no-draft", "--slots", "1", "--requests", "9", "--widths", "1,2,8,23,64"], 1, 0),
}


@needs_gpu
@pytest.mark.parametrize("run", list(MEMORY_RUNS))
def test_memory_stays_within_the_plan_over_many_requests(tmp_path, run):
    """bench/memory_check.py on the embedded default pair (or its target alone), in a fresh process (the CuPy pool
    holds only its model): every step shape a request can bring (plain, chains, trees of 1..22 nodes, prompts up to
    a prefill chunk and a half), then steps of the widths a state holds. Measured: the pool (weights, states,
    sessions, arena, transients) within the planned bytes it holds; the arena reserved once at its planned size
    and never grown; each pooled state and session exactly its planned bytes; no more graphs than counted."""
    args, n_states, n_sessions = MEMORY_RUNS[run]
    out = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_check.py"), "--default-model",
                           "--max-ctx", "1024", *args, "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    r = json.loads(out.read_text())
    print(done.stdout[-3000:])
    assert r["settings"]["state_width"] == M.GPU_PROMPT_STEP and r["width"] == (23 if n_sessions else 1)
    assert r["arena"]["grown_while_serving"] == 0 and r["arena"]["bytes"] == r["planned"]["graph arena"]
    assert r["arena"]["need"] <= r["planned"]["graph arena"]
    assert r["states"]["bytes_each"] == r["states"]["planned_each"] and r["states"]["count"] == n_states
    assert r["sessions"]["bytes_each"] == r["sessions"]["planned_each"] and r["sessions"]["count"] == n_sessions
    assert r["pool"]["max_total"] <= r["planned"]["pool_resident"], r["pool"]
    assert r["graphs"]["step_max_per_state"] <= M.GPU_GRAPHS_PER_STATE
    assert r["graph_stats"]["failed"] == 0 and r["graph_stats"]["replays"] > 0


@needs_gpu
def test_requests_load_no_kernel_and_capture_no_graph_after_start_up(tmp_path):
    """A fresh process set up as the verifier starts (reserve_serving, the auto calibration, its warm-up), then
    requests whose prompts cover every token-tile class, one past 64 tokens and one past a prefill chunk, decoded
    plainly and with auto: no kernel is fetched, built or read from CuPy's cache during the requests (an NVRTC build
    is 0.4-0.5 s mid-request on a cold cache), and none within the first 512-token context bucket captures a graph
    (bench/warm_check.py)."""
    out = tmp_path / "warm.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "warm_check.py"), "--max-ctx", "1024", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-3000:])
    assert out.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    r = json.loads(out.read_text())
    assert [x["prompt"] for x in r["requests"]] == [5, 37, 53, 100, 300, 700]
    assert r["loaded_during_requests"] == [] and all(x["modules"] == 0 for x in r["requests"]), r
    # graphs are per power-of-two bucket of the context (it fixes the attention's splits): start-up captures the
    # first bucket's, so only the 700-token prompt (the 1024 bucket) may capture
    assert all(x["captures"] == [0, 0, 0] for x in r["requests"] if x["prompt"] + 40 <= 512), r
    assert done.returncode == 0


@needs_gpu
def test_gpu_matrices_are_the_planned_ones():
    """The matrices the GPU models hold (placement.gpu_matrices: what the split scratch is reserved for; stacks
    uploaded as one matrix per run of a storage type) are the ones memory_plan.WeightBytes counts from the files."""
    from services.engine.default_model import default_model_paths
    from services.engine.models.dflash import canonical_tensor_names
    from services.engine.placement import gpu_matrices, load_drafter_on, load_target_on

    target_path, draft_path = default_model_paths()
    model = load_target_on(target_path, "cuda:0", with_tokenizer=False).model
    drafter = load_drafter_on(draft_path, model, "cuda:0").drafter
    wt = M.WeightBytes.of(M.read_model_header(target_path)[1])
    wd = M.WeightBytes.of(canonical_tensor_names(M.read_model_header(draft_path)[1]))
    assert gpu_matrices(model) == wt.mats
    assert gpu_matrices(drafter) == wd.mats | wt.head_mats()     # the drafter multiplies by the target's head


@needs_gpu
def test_cuda_allocation_failure_fails_the_request_alone(monkeypatch):
    """A real CuPy allocation failure mid-request (the pool limited to what it holds, then a long prompt whose eager
    prefill needs more): the request raises an error the verifier maps to RESOURCE_EXHAUSTED, CUDA graphs stay on,
    the state goes back to the pool, and with the limit lifted the pooled state behaves exactly like a new one.

    Plain decoding (reserve_serving without a drafter: verify width 1, states of 64-token steps): a prompt within
    the first context bucket runs as graph replays captured at start-up and allocates nothing, so under the same
    limit it succeeds; the failing one runs in eager 512-token chunks (PROMPT_GRAPHS off, as a state narrower than
    PROMPT_MIN_WIDTH would). The short request runs on the fresh model, again on the pooled state (all replays),
    then after the failure; the long one after the failure against a fresh model's (tests/test_gpu_backend.py checks
    eager chunks and graph-step chunks against the NumPy engine)."""
    import cupy

    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.models import qwen35_gpu as QG
    from services.engine.placement import load_target_on, reserve_serving

    path = default_model_paths()[0]

    def fresh():
        m = load_target_on(path, "cuda:0", with_tokenizer=False).model
        assert reserve_serving(m, None, 1, 1024, None, False, 0, "cuda:0") == 1 and m.max_tree == M.GPU_PROMPT_STEP
        return m

    model = fresh()
    ids = [int(i) % model.cfg.n_vocab for i in range(3, 3 + 700)]
    first = generate(model, ids[:5], 4).token_ids        # the pooled state: its first decode step captured
    replayed = generate(model, ids[:5], 4).token_ids     # every step a replay
    assert model.pool_stats["reused"] >= 1
    assert replayed == first
    mid = generate(model, ids[:300], 4).token_ids        # 4 whole 64-token chunks + 44 padded to 64: replays
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    # no room above what the pool holds: the eager prefill's first new temporary fails (with a margin of 1 MB the
    # request no longer failed on the H100 in session 27: what the prefill allocates anew fit in it)
    pool.set_limit(size=pool.total_bytes())
    try:
        assert generate(model, ids[:300], 4).token_ids == mid      # graph replays only: nothing new allocated
        monkeypatch.setattr(QG, "PROMPT_GRAPHS", False)
        with pytest.raises(Exception) as e:
            generate(model, ids, 4)
        assert is_out_of_memory(e.value), repr(e.value)
    finally:
        pool.set_limit(size=0)
    assert model.graph_blocker is None and model._states_out == 0 and len(model._state_pool) == 1
    assert generate(model, ids[:5], 4).token_ids == replayed
    long = generate(model, ids, 4).token_ids
    other = fresh()
    assert len(long) == 4 and long == generate(other, ids, 4).token_ids
