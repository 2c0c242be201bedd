"""Qwen3.5 / Qwen3.6 (`qwen35`) on the GPU: models/qwen35.py's forward, block for block, on the kernels in kernels/.

Same contract as TargetModel.forward (token trees by parent list, positions n_past + depth, captured layer
outputs, any node committable after a tree or checkpointed step, logits rows all / last / none) and the same
commit(path) semantics as state.SequenceState, with every per-sequence array on the device (GpuSequenceState).
The DeltaNet layers keep no per-node states: a tree step keeps each node's conv output row and gates, and the
commit recomputes the accepted node's state from the committed one along the path (kernels/deltanet.py
commit_replay; docs/gpu_deltanet.md has the trade). Per-step values
(positions, parents, the ancestor mask, the committed length S) are written into device buffers of the state
before the launches, so that a captured CUDA graph replays the same launches for every step of its shape.

Logits stay on the device (DeviceLogits): the step also computes each row's argmax there (kernels/sampling.py),
and forward copies only those T ids to the host; sampled draws run there too (DeviceLogits.sample_rows), so a
full row crosses only when a caller indexes it.
At a 248k vocabulary that saves a 40-64 MB copy to pageable memory per verify (11-17 ms of a 40-60 ms step).
KV types: f16, q8_0 or tq3_0, K and V chosen independently (f32 is kept as f16, the kernel's widest).

CUDA graphs (default on; SPECSPLIT_CUDA_GRAPHS=0 or `model.use_graphs = False`: eager launches): the first
step of a shape on a state (width T <= 64, chain or tree, checkpoints, logits rows, captured layers, and a
power-of-two bucket of S that fixes the attention's K splits; decode steps, trees and checkpointed chains, and a
prompt's chunks: whole ones of the state's widest width, the last one padded to a ladder width as a checkpointed
chain, PROMPT_GRAPHS; any other chain without checkpoints runs eagerly) runs eagerly while its allocations are measured,
then the same launches are captured on a side stream with every temporary taken from the device's one graph
arena (GraphArena, shared by every captured graph: steps and commits of all states, the GPU drafter's passes);
later steps of that shape write their values (token ids, positions, parents, mask, S) into the state's device
buffers and replay. Nothing in the captured launches reads the host or syncs. What outlives a replay (logits
rows, argmax ids, captured layers) is written into the state's own output buffers, never into the arena.

Host work per step is kept to what must run there (the speculative loop's time outside the graph replays): the per-step
values go up in one copy from pinned memory (_StepValues), the captured layers stay on the device (DeviceRows: the GPU
drafter reads them there), a Q4_K token table is decoded on the device inside the step (one launch:
quant_matmul.embed_rows; other host-only tables go through host_head_embed's row cache), and a commit (accepted node, KV
rows to move and their number: one upload; the rows move in one kernels.attention.KVRowMover launch) replays the
captured graph of its step's shape, whichever path it accepts (budget.py's calibration commits each width once, so a
pooled state holds them before the first request). Greedy plain decoding has no host work between steps at all
(decode_ahead): each step is one graph that commits itself and writes the next step's values on the device, and it is
put in the stream before the host reads the token before it. States outlive a request: acquire_state / release_state
keep up to state_pool_size of them (buffers and captured graphs) for the next requests; reserve_states makes them at
start-up, so that serving allocates no state (what services/engine/memory_plan.py counts per slot:
GpuSequenceState.nbytes).

Pieces done with plain CuPy ops instead of a kernel (each marked FALLBACK below): attention of a tree wider than 64
tokens (the attention kernel's mask is one uint64 per token; it decodes Q8_0 / TQ3_0 rows with CuPy), the residual adds
of steps wider than 64 tokens (narrower steps fold norms, SwiGLU and residual adds into the matmuls' activation packing
and epilogue).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from bisect import insort
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels import attention as att
from kernels import deltanet as dn
from kernels import norm_rope as nr
from kernels import quant_matmul as qm
from kernels import quant_wide as qw
from kernels import sampling as smp

from .. import faults
from ..backend import (
    CupyBackend,
    HostRowCache,
    can_fuse_swiglu,
    can_stage_norm,
    can_wide_swiglu,
    device_ids,
    reads_staging,
)
from ..config import ModelConfig
from ..device_sampling import draw_rows
from ..errors import ContextOverflowError, is_out_of_memory
from ..formats import RawTensor
from ..kvcache import resolve_cache_types
from ..logprobs import TokenLogprob
from ..quants import tq3
from ..sampling import SamplingParams
from ..state import check_commit_path
from .base import ForwardResult, TargetModel, check_step

MAX_TREE = 65            # nodes of a tree (or checkpointed chain) step: a 64-node budget plus the root
ATTN_TOKENS = att.MAX_TOKENS


HOST_ROW_CACHE_BYTES = 64 << 20   # host_head_embed's cache of dequantized token rows (27B: ~3300 rows)
GRAPH_MIN_BUCKET = 512   # smallest S bucket of a graph (K splits chosen for S + T up to it)
GRAPHS_PER_STATE = 64    # captured shapes kept per state, steps and commits each (oldest dropped first: an
                         # instantiated graph keeps device memory per node; memory_plan counts them)
# matrices of a layer that read the same input, uploaded as one (CupyBackend.stack: one product per run of a storage
# type); memory_plan.GPU_TARGET_STACKS counts their bytes so
STACKS = {"ffn_gate_up": ("ffn_gate", "ffn_up"), "ssm_in": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
          "attn_qkv": ("attn_q", "attn_k", "attn_v")}
# Steps of up to quant_matmul.Q16_TOKENS tokens: the product writing the residual stream (a mixer's output projection,
# ffn_down) stages the next RMSNorm for the ring gemv that reads it (quant_matmul.StagedNorm), so no pack launch
# runs between them (Qwen35GpuModel._norm_plan says where both products allow it). Off: a pack per norm.
# STAGE_UP_TO: the widest step (<= quant_matmul.Q16_TOKENS) at which each boundary stages; post: a mixer's output
# projection -> ffn_gate_up, next: ffn_down -> the next layer's input projection (or the LM head). H100, 27B Q4_K_M
# step replays (bench/gemv_ab.py --step-ab stagewhere, docs/gpu_quant_matmul.md "staged norms"): post / next / both
# 0.964 / 0.969 / 0.931 of the packs at one token, 0.985 / 0.986 / 0.968 at two, 1.018 / 0.995 / 1.009 at three
# (the post boundary loses there: not explained yet).
STAGE_NORMS = True
STAGE_UP_TO = {"post": 2, "next": 3}
# Steps of FUSE_SWIGLU_WIDTHS tokens (<= quant_matmul.Q16_TOKENS): ffn_gate_up's ring launch stages fp16(silu(gate) up)
# for ffn_down itself (QuantMatrix.swiglu: each block runs a gate tile and then its up tile), so neither the gate|up
# output nor the SwiGLU pack launch is there; bitwise the same step. H100, 27B Q4_K_M step replays against the pack
# (bench/gemv_ab.py --step-ab swiglu; docs/gpu_quant_matmul.md "gemv: SwiGLU staged by gate|up"): 1.0025 / 0.980 /
# 1.0055 at widths 1 / 2 / 3 with 3 ring stages (quant_gemv.SWIGLU_SHAPE), 1.0053 / 0.995 / 1.0016 with gate|up's 2.
# H200 (session 32, --step-ab swiglu1): 0.987 at one token with 3 stages (its 1088 tile-pair blocks of gate|up's 4
# warps make about one wave where gate|up's 2176 blocks make a wave and a bit), 1.001 with 2, 1.05-1.2 on 2 warps.
FUSE_SWIGLU_WIDTHS = (1, 2)
# Steps of SWIGLU_PAIR_WIDTHS tokens (<= quant_matmul.Q16_TOKENS) stage the SwiGLU with gate|up's own ring launch, each
# gate tile's block and its up tile's block a thread block cluster of two that meets at the end (QuantMatrix.swiglu(
# pair=True), sm_90; bitwise the same step); where clusters are missing, FUSE_SWIGLU_WIDTHS decides. H100, 27B Q4_K_M
# step replays against the shipped step (bench/gemv_ab.py --step-ab swiglupair, two calls): 1.030 / 1.036 at one
# token (against the pack), 0.991 / 0.991 at two (against the tile-pair blocks), 1.008 / 1.006 at three (the pack).
SWIGLU_PAIR_WIDTHS: tuple[int, ...] = (2,)
# Wider steps whose ffn_gate_up runs on the wide kernel (quant_wide.can_swiglu: from quant_matmul.Q16_TOKENS + 1 tokens
# where the dispatch takes it) run it as the SwiGLU launch (QuantMatrix.swiglu -> quant_wide.wide_swiglu): its writers
# put fp16(silu(gate) up) straight into ffn_down's packed x, so neither the [T, 2 F] f32 output nor the SwiGLU pack is
# there; the same step up to the rounding of split row blocks' sums (their pieces fall where the launch's own split
# puts them; deterministic either way). H100, 27B Q4_K_M step replays against the product and the pack
# (bench/gemv_ab.py --step-ab wswiglu / wswiglu3): 0.990 / 0.988 / 0.972 / 0.973 / 0.994 at widths 4 / 8 / 16 / 23 / 32.
FUSE_WIDE_SWIGLU = True
# Products of raw activations (attn_output after the attention, the LM head after the output norm) pack them in the
# wgmma order where the model's packs take it (pack_order) and the product then runs the wgmma build
# (QuantMatrix.matmul(wg_order=True)): the mma order elsewhere
RAW_WG_ORDER = True
# Steps of up to ATTN_STAGE_UP_TO tokens whose attn_output product is a ring gemv: the attention's combine kernel
# also writes o's int16 staging for it (kernels.attention.attention(q16=)), so no pack launch runs between them;
# bitwise the same step. H100, 27B Q4_K_M step replays (bench/gemv_ab.py --step-ab attnstage): 0.9996 / 0.9986 /
# 0.9992 of the pack at widths 1 / 2 / 3.
ATTN_STAGE_UP_TO = 3
# A DeltaNet layer's conv, q/k norm and gates in one launch (deltanet.conv_qk_norm_gate: the same bits as the two
# launches) in fused steps of FUSE_CONV_NORM_FROM..64 tokens; narrower ones: conv_silu then qk_norm_gate. H100, 27B
# Q4_K_M step replays (bench/gemv_ab.py --step-ab convnorm): 1.0025 / 0.993 / 0.996 of the two launches at widths
# 1 / 3 / 23 (the first version, which walked each channel's taps with a round trip each, lost 1.5 % at width 1).
FUSE_CONV_NORM_FROM = 2
# A one-token decode step's DeltaNet layer (a chain, no per-token data kept) in one launch: conv, q/k norm, gates and
# the state update (deltanet.decode_step, the same bits as the three launches). H100, synthetic Q4_K_M, width-1 step
# replays (bench/gemv_ab.py --step-ab dndecode): 6864 vs 6935 us, 0.990 of the three launches.
FUSE_DECODE_STEP = True
# decode_step's warps a block (8 state columns each; a column's arithmetic does not depend on them, so the same bits).
# H100, 27B Q4_K_M width-1 step replays (bench/gemv_ab.py --step-ab dnwarps, two calls): 4 / 8 / 16 warps 0.9954 /
# 0.9989 / 1.0004 and 0.9944 / 0.9981 / 0.9991 of 2 (192 / 96 / 48 blocks against 384).
DECODE_STEP_WARPS = 4
# ... and with FUSE_DECODE_NORM, where ssm_out's product is a ring gemv reading x's int16 staging, decode_step also
# computes the layer's output norm * silu(z) and writes that staging (deltanet.decode_step(q16=): a block per value
# head, dv / 8 warps; the bits of the norm pack it replaces), so no pack launch runs before ssm_out. H100, 27B Q4_K_M
# width-1 step replays (bench/gemv_ab.py --step-ab dnnorm): 6762 vs 6839 us, 0.9888 of the pack after 4-warp blocks
# (16-warp blocks with the pack: 1.0024).
FUSE_DECODE_NORM = True
# The SwiGLU pack writes only ffn_down's int16 staging where ffn_down is a ring gemv (backend.reads_staging), not the
# fp16 x that only other kernels read nor its padding rows (at one token 7 of 8): the same staging bits. H100, 27B
# Q4_K_M step replays (bench/gemv_ab.py --step-ab swigluonly): 0.9991 / 1.0001 / 0.9972 of the full pack at widths
# 1 / 2 / 3.
SWIGLU_STAGING_ONLY = True
# A one-token chain step's attention layer in one launch (attention.decode_attention: q/k norm + RoPE, the KV store
# and the attention on CUDA cores, with o's staging for attn_output) where its graph sees at most
# attention.DECODE_MAX_ROWS cache rows; replaces qk_norm_rope, store, attn_partial and attn_combine.
FUSE_DECODE_ATTN = True
# prompt chunks warm_prefill runs at start-up: every token-tile class of the matmuls up to 64 tokens (8 a tile), past
# 64 with a remainder of every class (a chunk over 64 tokens runs its products in 64-token slices of raw x, in the mma
# order where the fused steps of that width may have used the wgmma one: so not fetched by them) and a whole prefill
# chunk (generate.PREFILL_CHUNK)
WARM_CHUNKS = (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 512)
# Prompt chunks as captured steps: eager, a prompt is bound by the host's launches (512 tokens of the 27B in ~306 ms
# on an H200, the device idle most of it; as 64-token graph replays ~8 x 15 ms). generate.prefill then cuts a prompt
# into chunks of the state's widest step (prompt_chunk): a whole one replays a chain's graph, the last one (shorter)
# is padded to the next width of PROMPT_LADDER and replays a checkpointed chain's graph (a verify's), whose commit
# keeps its real tokens (the padding's KV rows lie past them, overwritten later; its DeltaNet states are never
# committed). Only chains whose logits are the last row's or none are a prompt's: a chain with every row's logits
# keeps its width (eager). States narrower than PROMPT_MIN_WIDTH keep eager chunks: their many passes would cost more.
PROMPT_GRAPHS = True
PROMPT_LADDER = (8, 16, 32)
PROMPT_MIN_WIDTH = 16
RAW_ROWS = 512           # pre-conv rows a state keeps: a prefill chunk's (generate.PREFILL_CHUNK), or the tree's
ARENA_SLACK = 4 << 20    # an arena holds a capture's measured peak + 1/8 + this (the capture repeats the warm-up)


def graphs_default() -> bool:
    """CUDA-graph replay unless SPECSPLIT_CUDA_GRAPHS=0. Also reads SPECSPLIT_PDL (kernels/loader.py), so that a bad
    value stops the model's load with its message instead of failing a request's first capture."""
    from kernels import loader

    loader.pdl_requested()
    return os.environ.get("SPECSPLIT_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")


GPU_KV_TYPES = ("f16", "q8_0", "tq3_0")   # what this model's KV paths (kernel, commit, wide-tree fallback) handle


def gpu_kv_type(kind: str) -> str:
    """The device KV type for an engine KV type: f32 is kept as f16 (the attention kernel's widest)."""
    if kind in GPU_KV_TYPES:
        return kind
    if kind == "f32":
        return "f16"
    raise ValueError(f"unknown KV cache type {kind!r}")


@dataclass
class GpuPending:
    n_tokens: int
    parents: np.ndarray
    per_token: bool          # any node committable: replay inputs kept (else a chain's final state only)
    is_chain: bool = False
    n_real: int = 0          # a padded prompt chunk's own tokens (committed whole), 0: every token is the step's


def _pinned(cp: Any, n: int, dtype: Any) -> np.ndarray:
    """A host array in page-locked memory (copies from and to it run asynchronously, in stream order)."""
    dt = np.dtype(dtype)
    return np.ndarray((int(n),), dt, buffer=cp.cuda.alloc_pinned_memory(max(1, int(n) * dt.itemsize)))


def _upload(cp: Any, dst: Any, src: np.ndarray) -> None:
    """src (host, pinned) -> dst (device, contiguous), asynchronously on the current stream."""
    if isinstance(dst, np.ndarray):          # a NumPy stand-in for CuPy (tests on machines without a GPU)
        dst[...] = src
    else:
        dst.set(src, stream=cp.cuda.get_current_stream())


Q4_K = 12   # GGML type id


class _StepValues:
    """A step's per-step values, laid out once in one device buffer and its pinned host twin, so that a step
    writes them on the host and uploads them with one copy (instead of one copy and one kernel per value):
    [tokens | positions | parents | s_len | swap | mask (uint64) | embedded rows, when the token table is on the
    host]; swap: which half of the ping-pong DeltaNet state is the committed one (GpuSequenceState.parity)."""

    ALIGN = 256

    def __init__(self, cp: Any, max_tree: int, n_embd: int, host_rows: bool):
        self.cp, self.max_tree, self.n_embd = cp, int(max_tree), int(n_embd)
        off = 0
        spans = {}
        for name, n, dt in (("tokens", max_tree, np.int32), ("positions", max_tree, np.int32),
                            ("parents", max_tree, np.int32), ("s_len", 1, np.int32), ("swap", 1, np.int32),
                            ("mask", ATTN_TOKENS, np.uint64)):
            spans[name] = (off, n, np.dtype(dt))
            off += -(-n * np.dtype(dt).itemsize // self.ALIGN) * self.ALIGN
        self.header_bytes = off
        total = off + (max_tree * n_embd * 4 if host_rows else 0)
        self.dev = cp.zeros(total, cp.uint8)
        self.host = _pinned(cp, total, np.uint8)
        self.host[...] = 0
        for name, (o, n, dt) in spans.items():
            setattr(self, name, self.dev[o:o + n * dt.itemsize].view(dt))
            setattr(self, "h_" + name, self.host[o:o + n * dt.itemsize].view(dt))
        self.h_parents[...] = -1
        self.x_in = self.h_rows = None
        if host_rows:
            self.x_in = self.dev[off:].view(np.float32).reshape(max_tree, n_embd)
            self.h_rows = self.host[off:].view(np.float32).reshape(max_tree, n_embd)

    def upload(self, rows: int = 0) -> None:
        """One host-to-device copy of the header (and of the first `rows` embedded rows)."""
        n = self.header_bytes + rows * self.n_embd * 4
        _upload(self.cp, self.dev[:n], self.host[:n])


class GpuSequenceState:
    """Device twin of state.SequenceState: KV per attention layer, DeltaNet state + conv windows, and what a
    commit of any node of the last step needs (KV rows in place, conv rows, the nodes' replay inputs)."""

    def __init__(self, cfg: ModelConfig, max_ctx: int, kv_k: str, kv_v: str, max_tree: int = MAX_TREE,
                 host_rows: bool = False, n_capture: int = 0):
        cp = nr.loader.require()
        self.cfg, self.max_ctx, self.max_tree = cfg, int(max_ctx), int(max_tree)
        self.n_past = 0
        self.pending: GpuPending | None = None
        self.kv_types = (kv_k, kv_v)
        self.attn_layers = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        self.rec_layers = [i for i, r in enumerate(cfg.recurrent_layers) if r]
        self.kv = {i: att.KVCacheLayer(cfg.n_head_kv, cfg.head_dim, self.max_ctx, kv_k, kv_v, decode_counters=True)
                   for i in self.attn_layers}
        # a tree step's commit moves the accepted path's KV rows of every layer in one launch
        self.mover = att.KVRowMover(list(self.kv.values())) if self.kv else None
        L = len(self.rec_layers)
        self.slot = {layer: j for j, layer in enumerate(self.rec_layers)}
        if L:
            hv, dk, dv, cd = cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim, cfg.ssm_conv_dim
            # the recurrent state as a ping-pong pair: half `parity` is the committed state, the other one takes a
            # chain step's final state, and that chain's commit flips `parity` instead of copying it back (151 MB a
            # token at 27B shapes); the kernels read the parity from the step's and the commit's device values, so
            # one captured launch serves both halves
            self.ssm_pair = cp.zeros((2, L, hv, dk, dv), cp.float32)
            self.parity = 0
            # a tree / checkpointed step's conv output rows (q | k | v, normalised) and gates (g, beta) per layer:
            # the tree step reads them, a commit replays the accepted path's k / v / g / beta from them
            # (~40 KB a node and layer at 27B shapes, against 3.1 MB for a per-node state)
            self.mixed = cp.zeros((L, max_tree, cd), cp.float32)
            self.gates = cp.zeros((L, 2, max_tree, hv), cp.float32)
            self.plan = cp.zeros(max_tree, cp.int32)    # the tree walk of the step (dn.tree_plan), all layers'
            self.conv = cp.zeros((L, cfg.ssm_conv_kernel - 1, cd), cp.float32)
            # pre-conv rows of a step (what commit() gathers): a whole prefill chunk's, so that no prompt grows it
            self.raw = cp.zeros((L, max(max_tree, RAW_ROWS), cd), cp.float32)
        # per-step values in device buffers (what a captured graph will read): views into one staging buffer
        # (_StepValues) that a step fills from pinned host memory with a single copy
        self.stage = _StepValues(cp, self.max_tree, cfg.n_embd, host_rows)
        self.positions, self.parents, self.tokens = self.stage.positions, self.stage.parents, self.stage.tokens
        self.mask, self.s_len = self.stage.mask, self.stage.s_len
        # commits: accepted node and KV rows to move (one upload), the captured commits by shape
        self.commit_stage = _CommitValues(cp, self.max_tree)
        self.accepted = self.commit_stage.accepted
        self.commit_graphs: dict[tuple, Any] = {}
        self._commit_stream = None
        self.graph_commits = graphs_default()   # off after a failed commit capture
        self.graphs_on = True                    # the model's choice, set by each forward
        # argmax ids of a step's rows land here (pinned: the copy is asynchronous); forward copies them out
        self.argmax_host = _pinned(cp, max_tree, np.int32)
        # a graph step's results (what outlives its replay; the device's graph arena holds only temporaries):
        # logits rows, their argmax ids and maxima, the captured layers (made for the first capture list)
        self.out_logits = cp.empty((max_tree, cfg.n_vocab), cp.float32)
        self.out_ids = cp.empty(max_tree, cp.int32)
        self.out_max = cp.empty(max_tree, cp.float32)
        self.out_captured = None
        self.handed: list[Any] = []   # weakrefs to the DeviceLogits / DeviceRows last returned over out_*
        self.ahead: tuple[np.ndarray, list[Any]] | None = None   # decode_ahead's pinned ids and events
        # captured steps of this state by shape (see Qwen35GpuModel.forward); they hold the addresses of the
        # buffers above, so replacing a buffer drops them; the graph arena drops them when it grows
        self.graphs: dict[tuple, _StepGraph | None] = {}
        if n_capture:
            self.ensure_capture(n_capture)
        graph_arena(cp).register(self)

    @property
    def ssm(self):
        """The committed DeltaNet state, (L, Hv, dk, dv) float32 on the device: the pair's half `parity`."""
        return self.ssm_pair[self.parity]

    @property
    def ssm_final(self):
        """The other half: where a chain step without checkpoints writes its final state (committed by a flip)."""
        return self.ssm_pair[1 - self.parity]

    def drop_graphs(self) -> None:
        """Forget every captured step and commit (their addresses are no longer valid)."""
        self.graphs.clear()
        self.commit_graphs.clear()

    def ensure_capture(self, n_capture: int) -> Any:
        """The (max_tree, n_capture, n_embd) buffer of a graph step's captured layers, made for the first capture
        list; remade for another number of layers, dropping only the graphs that write into the old one (graphs
        without captured layers never held its address)."""
        buf = self.out_captured
        if buf is None or int(buf.shape[1]) != int(n_capture):
            cp = nr.loader.require()
            if buf is not None:
                self.detach_results()
                self.graphs = {k: g for k, g in self.graphs.items() if g is None or g.captured is None}
                self.out_captured = buf = None     # freed before the new one is taken
            self.out_captured = buf = cp.empty((self.max_tree, int(n_capture), self.cfg.n_embd), cp.float32)
        return buf

    def detach_results(self) -> int:
        """Give the results still held over the output buffers their own copies (the next graph step rewrites
        the buffers); returns how many were copied."""
        n = 0
        for ref in self.handed:
            res = ref()
            if res is not None:
                res._detach()
                n += 1
        self.handed = []
        return n

    @property
    def nbytes(self) -> int:
        """Device bytes this state holds (what memory_plan.gpu_state_bytes counts per slot)."""
        arrays = [c.k for c in self.kv.values()] + [c.v for c in self.kv.values()]
        arrays += [c.counters for c in self.kv.values()]
        arrays += [self.stage.dev, self.commit_stage.dev, self.out_logits, self.out_ids, self.out_max]
        if self.rec_layers:
            arrays += [self.ssm_pair, self.mixed, self.gates, self.plan, self.conv, self.raw]
        if self.out_captured is not None:
            arrays.append(self.out_captured)
        if self.mover is not None:
            arrays += [self.mover.bases, self.mover.units]
        return sum(int(a.nbytes) for a in arrays)

    @property
    def x_in(self):
        return self.stage.x_in

    def embedded(self, n_embd: int):
        """(max_tree, n_embd) float32 buffer for a step's embedded rows when the token table is on the host."""
        return self.stage.x_in

    def reset(self) -> None:
        """An empty sequence again (a pooled state handed to the next request): nothing committed, recurrent
        state and conv windows zeroed; buffers and captured graphs kept (their addresses do not change)."""
        self.n_past = 0
        self.pending = None
        if self.rec_layers:
            self.parity = 0
            self.ssm.fill(0)
            self.conv.fill(0)

    def check_room(self, n_new: int) -> None:
        if self.n_past + n_new > self.max_ctx:
            raise ContextOverflowError(self.n_past + n_new, self.max_ctx)

    def raw_rows(self, T: int):
        """(L, >= T, conv_dim) buffer for this step's pre-conv rows (grown for a chunk longer than RAW_ROWS: a
        direct forward() of a long prompt; generate.prefill's chunks fit)."""
        if T > self.raw.shape[1]:
            cp = nr.loader.require()
            self.drop_graphs()
            self.raw = cp.zeros((self.raw.shape[0], T, self.raw.shape[2]), cp.float32)
        return self.raw

    def commit(self, path) -> None:
        """state.SequenceState.commit on the device: KV rows compacted, recurrent state recomputed along the
        path from the committed one (the DeltaNet recurrence only, from the step's kept k / v / g / beta: no
        target pass), conv window gathered along the path. The launches read the accepted node and the rows to
        move from device buffers (one upload), so every commit of a step's shape (its width, chain or tree,
        checkpoints or not) replays one captured graph, whichever path it accepts (_commit_launches)."""
        p = self.pending
        if p is None:
            raise RuntimeError("commit() without a pending forward pass")
        path = check_commit_path(path, p.parents)
        if p.n_real and path and path != list(range(p.n_real)):
            raise ValueError(f"a prompt chunk (a chain forward without checkpoints) can only be committed whole: "
                             f"its {p.n_real} tokens")
        if path:
            cp = nr.loader.require()
            first = next((d for d, i in enumerate(path) if i != d), None)
            moved = 0 if first is None else len(path) - first
            whole = path == list(range(p.n_tokens))
            if self.rec_layers and not p.per_token and not whole:
                raise ValueError("a chain forward without checkpoints can only be committed whole")
            cs = self.commit_stage
            # (swap is read by the per-token replay only: a chain's commit sends 0, so that consecutive one-token
            # commits repeat their values and they go up once)
            cs.stage(path[-1], self.parity if p.per_token else 0, moved)
            if moved:   # rows before `first` are already in place; from there on the path's rows move down
                base = self.n_past
                cs.h_dst[:moved] = np.arange(base + first, base + len(path))
                cs.h_src[:moved] = [base + i for i in path[first:]]
            cs.upload()
            key = (p.n_tokens, p.is_chain, p.per_token)
            launches = lambda: self._commit_launches(p)  # noqa: E731
            g = self.commit_graphs.get(key)
            if g is not None:
                g.launch(cp.cuda.get_current_stream())
            elif not (self.graph_commits and self.graphs_on) or (p.n_tokens > 1 and not p.per_token):
                launches()     # graphs off, or a prompt chunk (a one-off shape)
            else:
                self._capture_commit(key, launches)
            if self.rec_layers and not p.per_token:   # the chain's final state is the committed one now
                self.parity ^= 1
            self.n_past += len(path)
        self.pending = None

    def _commit_launches(self, p: GpuPending) -> tuple:
        """The commit's device work, reading only device buffers (graph-safe)."""
        cs = self.commit_stage
        if self.mover is not None and not p.is_chain:
            # KV rows of the branch into place (a chain's path is a prefix: nothing moves). A token's row is
            # quantized on its own (a Q8_0 block or TQ3_0 rotation group never spans two tokens), so moving its
            # bytes moves the token
            self.mover(cs.dst, cs.src, cs.moved)
        if self.rec_layers:
            n, kd = p.n_tokens, self.cfg.ssm_key_dim
            parents = None if p.is_chain else self.parents[:n]
            if p.per_token:   # (a chain without checkpoints wrote its final state into the other half: no work)
                dn.commit_replay(self.accepted, parents, self.mixed[:, :n, kd:2 * kd], self.mixed[:, :n, 2 * kd:],
                                 self.gates[:, 0, :n], self.gates[:, 1, :n], self.ssm_pair[0], alt=self.ssm_pair[1],
                                 swap=self.commit_stage.swap)
            dn.commit_conv(self.accepted, parents, self.raw[:, :n], self.conv)
        return ()

    def _capture_commit(self, key: tuple, launches: Any) -> None:
        """Run the commit eagerly (this step's), then capture it for the next commits of this shape; a failed
        capture leaves commits eager for this state."""
        cp = nr.loader.require()
        probe = _GraphHeap(cp, None)
        with cp.cuda.using_allocator(probe.malloc):
            launches()
        try:
            heap = graph_arena(cp).heap_for(probe.peak)
            if self._commit_stream is None:
                self._commit_stream = cp.cuda.Stream(non_blocking=True)
            graph, _ = _record(self._commit_stream, heap, launches)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager commits, and say why
            if is_out_of_memory(e):   # no memory for the arena: this request fails, commit graphs stay on
                raise
            self.graph_commits = False
            warnings.warn(f"commit graphs off for this state: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            return
        while len(self.commit_graphs) >= GRAPHS_PER_STATE:
            del self.commit_graphs[next(iter(self.commit_graphs))]
        self.commit_graphs[key] = graph


class _CommitValues:
    """A commit's device values and their pinned twin, uploaded in one copy: the accepted node (int32, what
    the recurrent commit kernels read), the committed half of the ping-pong DeltaNet state (swap, int32) and the KV
    rows to move (their number, int32; int64 destination and source rows)."""

    def __init__(self, cp: Any, max_tree: int):
        self.cp = cp
        n = 16 + 2 * 8 * max_tree
        self.dev = cp.zeros(n, cp.uint8)
        self.host = _pinned(cp, n, np.uint8)
        self.host[...] = 0
        self.accepted, self.h_accepted = self.dev[:4].view(np.int32), self.host[:4].view(np.int32)
        self.swap, self.h_swap = self.dev[4:8].view(np.int32), self.host[4:8].view(np.int32)
        self.moved, self.h_moved = self.dev[8:12].view(np.int32), self.host[8:12].view(np.int32)
        self.dst = self.dev[16:16 + 8 * max_tree].view(np.int64)
        self.h_dst = self.host[16:16 + 8 * max_tree].view(np.int64)
        self.src = self.dev[16 + 8 * max_tree:].view(np.int64)
        self.h_src = self.host[16 + 8 * max_tree:].view(np.int64)
        self._sent: tuple[int, int, int] | None = None   # (accepted, swap, moved) the device holds, when no rows move
        self._due = True

    def stage(self, accepted: int, swap: int, moved: int) -> None:
        """Write a commit's values (rows to move: h_dst / h_src, by the caller); upload() sends them unless the device
        holds these already (a commit that moves no rows, after one with the same values)."""
        vals = (int(accepted), int(swap), int(moved))
        self._due = moved > 0 or vals != self._sent
        if self._due:
            self.h_accepted[0], self.h_swap[0], self.h_moved[0] = vals
        self._sent = vals if moved == 0 else None

    def upload(self) -> None:
        if self._due:
            _upload(self.cp, self.dev, self.host)
        self._due = False


class DeviceLogits:
    """The logits rows of a GPU forward, left on the device, with each row's argmax (computed on the device in
    the same step) already on the host. Reads like the (rows, n_vocab) float32 array of the NumPy engine where
    a caller needs one: `x[i]` (a row; any NumPy index) and np.asarray(x) copy from the device, each call a
    fresh host array; argmax_rows(), np.argmax(x, axis=-1) and sample_rows() (sampled draws) copy no row."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, rows: Any, argmax: np.ndarray):
        self._rows = rows          # device (rows, n_vocab) float32
        self._argmax = argmax      # host int32 (rows,), pinned; written by the copy forward() waited for

    @property
    def shape(self) -> tuple[int, int]:
        return int(self._rows.shape[0]), int(self._rows.shape[1])

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __repr__(self) -> str:
        return f"DeviceLogits(shape={self.shape})"

    def argmax_rows(self) -> np.ndarray:
        """int64 (rows,): each row's argmax, lowest id on ties (np.argmax's choice)."""
        return self._argmax.astype(np.int64)

    def sample_rows(self, rows: Sequence[int], params: SamplingParams, us: Sequence[float],
                    history: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """int64: a token drawn on the device from each row rows[i] with uniform us[i] (device_sampling.draw_rows);
        only the token ids cross to the host."""
        return draw_rows(self._rows, rows, params, us, history, paths)

    def logprobs(self, rows: Sequence[int], tokens: Sequence[int], n: int) -> list[TokenLogprob]:
        """logprobs.row_logprobs on the device: tokens[i]'s log-probability in row rows[i] and the row's n best
        (sampling.token_logprobs, a launch pair per run of consecutive rows, so that no gather kernel is needed);
        three small arrays cross to the host, no row does."""
        cp = nr.loader.require()
        idx = [int(r) % len(self) for r in rows]
        toks = np.asarray(tokens, dtype=np.int32)
        if toks.size and not (0 <= toks.min() and toks.max() < self.shape[1]):
            raise ValueError(f"token ids {toks.tolist()} outside the vocabulary of {self.shape[1]}")
        k = min(smp.LOGPROB_K, self.shape[1])
        m = len(idx)
        tok_lp, ids, lp = cp.empty((m,), cp.float32), cp.empty((m, k), cp.int32), cp.empty((m, k), cp.float32)
        dev_toks = cp.asarray(toks)
        i = 0
        while i < m:
            j = i + 1
            while j < m and idx[j] == idx[j - 1] + 1:
                j += 1
            smp.token_logprobs(self._rows[idx[i]:idx[i] + j - i], dev_toks[i:j],
                               out=(tok_lp[i:j], ids[i:j], lp[i:j]))
            i = j
        # whole arrays: a strided slice would be made contiguous by a CuPy copy kernel first
        tok_lp, ids, lp = cp.asnumpy(tok_lp), cp.asnumpy(ids)[:, :n], cp.asnumpy(lp)[:, :n]
        return [TokenLogprob(int(t), float(tok_lp[i]), tuple(zip(ids[i].tolist(), lp[i].astype(float).tolist())))
                for i, t in enumerate(toks.tolist())]

    def argmax(self, axis: int | None = None, out: np.ndarray | None = None, keepdims: bool = False) -> Any:
        """ndarray.argmax; along the rows (what np.argmax(x, axis=-1) asks) without copying the rows."""
        if axis in (-1, 1) and out is None and not keepdims:
            return self.argmax_rows()
        return np.asarray(self).argmax(axis=axis, out=out, keepdims=keepdims)

    def __getitem__(self, key: Any) -> np.ndarray:
        cp = nr.loader.require()
        if isinstance(key, (list, np.ndarray)):   # fancy index: gather on the device, copy only those rows
            key = np.asarray(key)
            key = cp.asarray(key if key.dtype.kind in "biu" else key.astype(np.int64))
        return cp.asnumpy(self._rows[key])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = nr.loader.require().asnumpy(self._rows)
        return host if dtype is None else host.astype(dtype, copy=False)

    def _detach(self) -> None:
        """Own a copy of the rows (the graph they belong to is about to replay over them); in stream order."""
        self._rows = self._rows.copy()


F16_MAX = float(np.finfo(np.float16).max)   # DeviceRows.to_host saturates f16 here
_saturating_f16: Any = None


def saturating_f16(rows: Any) -> Any:
    """float32 device rows as float16, saturated at +-F16_MAX (NaN stays NaN), in one launch where clip then astype
    took two (the f16 wire's cast: ~0.03 ms a step less on an H200 host, session 43)."""
    global _saturating_f16
    cp = nr.loader.require()
    if _saturating_f16 is None:
        _saturating_f16 = cp.ElementwiseKernel(
            "float32 x", "float16 y", "y = (float16)((x != x) ? x : fminf(fmaxf(x, -65504.0f), 65504.0f))",
            "specsplit_saturating_f16")
    return _saturating_f16(rows)


class DeviceRows:
    """Captured layer outputs (T, len(capture), n_embd) float32 left on the device: the GPU drafter beside the
    target reads them there; np.asarray(x) (and reshape) copies them to the host, as the NumPy engine's array
    would be. x[key] gathers rows on the device (a fresh array, not tied to any graph)."""

    ndim = 3
    dtype = np.dtype(np.float32)

    def __init__(self, rows: Any):
        self.rows = rows           # device (T, K, n_embd) float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.rows.shape)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __repr__(self) -> str:
        return f"DeviceRows(shape={self.shape})"

    def __getitem__(self, key: Any) -> DeviceRows:
        if isinstance(key, (list, np.ndarray)):
            idx = [int(i) for i in np.asarray(key).reshape(-1)]
            n = len(idx)
            if n and idx == list(range(idx[0], idx[0] + n)):    # a run of rows (a chain's path): one slice
                return DeviceRows(self.rows[idx[0]:idx[0] + n].copy())
            cp = nr.loader.require()
            return DeviceRows(self.rows[cp.asarray(np.asarray(idx, dtype=np.int64))])
        return DeviceRows(self.rows[key].copy())

    def concat(self, other: Any) -> DeviceRows:
        """These rows, then `other`'s (device rows or host rows), as one device array."""
        cp = nr.loader.require()
        o = other.rows if isinstance(other, DeviceRows) else cp.asarray(np.asarray(other, np.float32))
        return DeviceRows(cp.concatenate([self.rows, o.reshape(o.shape[0], *self.rows.shape[1:])], axis=0))

    def reshape(self, *shape: Any) -> np.ndarray:
        return np.asarray(self).reshape(*shape)

    def to_host(self, dtype: Any = np.float32) -> np.ndarray:
        """A host copy in `dtype`; float16 is cast on the device first (half the bytes cross the bus), saturating
        at +-65504 rather than overflowing (a drafter service's f16 wire: services/drafter/client.wire_array)."""
        cp = nr.loader.require()
        rows = self.rows
        if np.dtype(dtype) == np.float16:
            rows = saturating_f16(rows)
        return cp.asnumpy(rows).astype(dtype, copy=False)

    def copy_into(self, dst: np.ndarray) -> None:
        """The rows into the host array `dst` ((T, K * n_embd) float32 or float16, cast on the device as to_host
        casts), with one copy in stream order: into page-locked memory (a drafter stream's registered segment,
        services/drafter/client) the device writes it directly."""
        cp = nr.loader.require()
        rows = self.rows.reshape(self.rows.shape[0], -1)
        if dst.shape != rows.shape or not dst.flags.c_contiguous:
            raise ValueError(f"rows {tuple(rows.shape)} do not fit a host array {dst.shape} (C-contiguous)")
        if dst.dtype == np.float16:
            rows = saturating_f16(rows)
        elif dst.dtype != np.float32:
            raise ValueError(f"feature rows go to the host as float32 or float16, not {dst.dtype}")
        rows = cp.ascontiguousarray(rows)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(dst.ctypes.data, rows.data.ptr, rows.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                    stream.ptr)
        stream.synchronize()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self.to_host(np.float32 if dtype is None else dtype)

    def _detach(self) -> None:
        """Own a copy of the rows (the graph they belong to is about to replay over them); in stream order."""
        self.rows = self.rows.copy()


def _chain_masks() -> np.ndarray:
    bits = np.zeros(ATTN_TOKENS, dtype=np.uint64)
    acc = 0
    for i in range(ATTN_TOKENS):
        acc |= 1 << i
        bits[i] = acc
    return bits


CHAIN_MASKS = _chain_masks()   # att.tree_mask of a chain of 64: row t sees tokens 0..t


def _tree_shape(par: np.ndarray, is_chain: bool, T: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(depth of each token, the attention's ancestor mask or None past ATTN_TOKENS): att.tree_mask's bits,
    from a precomputed table for a chain and one pass over Python ints for a tree."""
    if is_chain:
        return np.arange(T, dtype=np.int64), (CHAIN_MASKS[:T] if T <= ATTN_TOKENS else None)
    depth = [0] * T
    bits = [0] * T
    for i, p in enumerate(par.tolist()):
        if p >= 0:
            depth[i] = depth[p] + 1
            bits[i] = bits[p] | (1 << i)
        else:
            bits[i] = 1 << i
    return np.array(depth, dtype=np.int64), (np.array(bits, dtype=np.uint64) if T <= ATTN_TOKENS else None)


class Qwen35GpuModel(TargetModel):
    """The qwen35 target on CupyBackend; `forward` reads like models/qwen35.py with kernel calls."""

    arch = "qwen35"
    kv_cache_types: tuple[str, str] = ("f16", "f16")
    # verify widths `--budget auto` keeps to (budget.BudgetTuner.widths): every distinct width is a CUDA graph of its
    # own in each pooled state, and a tuner free to pick any of 64 sizes made short requests pay a capture per new
    # size (the embedded pair: auto 0.58x plain against DDTree-22's 1.08x, H100, 2026-11-26)
    verify_widths: tuple[int, ...] = (2, 4, 8, 12, 16, 20, 24, 32, 48, 64)

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, RawTensor | np.ndarray],
                 backend: CupyBackend | None = None, source: str = "<model>"):
        if cfg.arch != "qwen35":
            raise ValueError(f"the GPU forward runs qwen35 models, not {cfg.arch!r}")
        be = backend or CupyBackend()
        out = tensors.get("output.weight")
        # host copies of what a CPU drafter shares with its target (token table, lm head)
        self._host_embd = tensors.get("token_embd.weight")
        self._host_out = out if out is not None else self._host_embd
        super().__init__(cfg, tensors, be, source)
        self.output.upload()
        for w in self.layers:
            for v in w.values():
                if hasattr(v, "upload"):
                    v.upload()
        # matrices whose storage type the matmul kernel lacks, uploaded as F16 (see backend.GpuMatrix)
        mats = [self.output] + [v for w in self.layers for v in w.values()]
        self.fallback_weights = sorted(v.name for v in mats if getattr(v, "fallback", False))
        # whether packs of quant_wide.WG_FROM tokens or more may be written in the wide kernel's wgmma order, for
        # products on its wgmma build (pack_order; kernels/quant_wide.py WGMMA): where the device and every matrix can
        self.wgmma = qw.wg_capable([v.q for v in mats if getattr(v, "q", None) is not None])
        self.use_graphs = graphs_default()
        # norms, SwiGLU and residual adds folded into the matmuls' activation packing / epilogue (steps of <= 64
        # tokens); SPECSPLIT_FUSED_LAUNCHES=0 or `model.fused_launches = False`: the separate launches
        self.fused_launches = os.environ.get("SPECSPLIT_FUSED_LAUNCHES", "1").strip().lower() not in (
            "0", "false", "no", "off")
        # why steps cannot be captured on this model (None: they can)
        self.graph_blocker: str | None = None
        # greedy plain decoding a step ahead of the host (decode_ahead); SPECSPLIT_DECODE_AHEAD=0 or
        # `model.decode_ahead_on = False`: one step at a time, the host reading each token before the next step
        self.decode_ahead_on = os.environ.get("SPECSPLIT_DECODE_AHEAD", "1").strip().lower() not in (
            "0", "false", "no", "off")
        # a token table whose type the device cannot decode (GpuEmbedding.on_host, e.g. Q4_K / Q6_K): the step's
        # rows are dequantized on the host and written to state.x_in before the launches, like the token ids
        self._host_table = bool(getattr(self.tok_embd, "on_host", False))
        # a Q4_K table (llama.cpp's Q4_K_M files) goes to the device packed after all (the memory plan counts
        # every stored byte there) and the step's rows are decoded inside the step (qm.embed_rows): the host
        # dequantization and upload of T rows cost ~0.5 ms of a 27B verify, the drafter's row ~0.4 ms more
        self._embd_dev = None
        if self._host_table and int(getattr(self.tok_embd, "qtype", -1)) == Q4_K and os.environ.get(
                "SPECSPLIT_DEVICE_EMBD", "1").strip().lower() not in ("0", "false", "no", "off"):
            host = self.tok_embd.host
            data = np.asarray(host.data if isinstance(host, RawTensor) else host).reshape(-1).view(np.uint8)
            self._embd_dev = be.xp.asarray(data).reshape(int(self.tok_embd.shape[0]), -1)
            self._host_table = False
        # host_head_embed's dequantized rows (a table the device does not decode)
        self._row_cache = (HostRowCache(self.tok_embd.host, cfg.n_embd, HOST_ROW_CACHE_BYTES)
                           if getattr(self.tok_embd, "on_host", False) else None)
        # detached: replays that first copied the rows of a still-held result of the same graph (DeviceLogits)
        self.graph_stats = {"captures": 0, "replays": 0, "eager": 0, "failed": 0, "detached": 0}
        self._capture_stream = None
        self._norm_plans: dict[tuple, tuple] = {}   # _norm_plan's, by width and logits rows
        # finished requests' states kept for the next ones (acquire_state / release_state): a state's graphs
        # are captured per shape, so a new state per request would capture them all again. Bounded: the
        # verifier sets the size to its slots (what the memory plan counts); 1 for one request at a time.
        self.state_pool_size = 1
        self._state_pool: list[GpuSequenceState] = []
        self._pool_lock = threading.Lock()
        self._states_out = 0         # acquired and not yet released
        self.pool_stats = {"new": 0, "reused": 0}
        # tree nodes (with recurrent checkpoints) a new state holds: the widest verify or prompt step; the verifier
        # sets the planned width (memory_plan.state_width), which also bounds the graph steps' logits rows
        self.max_tree = MAX_TREE
        if self.use_graphs:   # the arena this model's captures can need (memory_plan): none of them grows it
            graph_arena(be.xp).reserve(self.arena_bound())

    def arena_bound(self, drafter: Any = None) -> int:
        """The planned graph arena for this model's steps up to max_tree tokens (and a drafter's passes)."""
        from .. import memory_plan as mp

        shape = mp.drafter_shape_of(drafter) if drafter is not None else None
        return mp.graph_arena_bytes(self.cfg, self.max_tree, "f16", "f16", shape, mp.device_sms(
            mp.Device("cuda", self.be.device)))

    def _load_layer(self, i: int) -> dict:
        p, c, be = f"blk.{i}.", self.cfg, self.be
        arr = lambda n: be.array(self._need(p + n))  # noqa: E731
        mat = lambda n: be.weight(self._need(p + n + ".weight"))  # noqa: E731
        w = {"attn_norm": arr("attn_norm.weight"), "post_attention_norm": arr("post_attention_norm.weight"),
             "ffn_gate_up": be.stack([mat(n) for n in STACKS["ffn_gate_up"]]), "ffn_down": mat("ffn_down")}
        if c.recurrent_layers[i]:
            w["ssm_in"] = be.stack([mat(n) for n in STACKS["ssm_in"]])
            w["ssm_out"] = mat("ssm_out")
            w["ssm_conv1d"] = arr("ssm_conv1d.weight")
            w["ssm_norm"] = arr("ssm_norm.weight")
            w["ssm_a"] = arr("ssm_a")
            w["ssm_dt"] = arr("ssm_dt.bias")
        else:
            w["attn_qkv"] = be.stack([mat(n) for n in STACKS["attn_qkv"]])
            w["attn_output"] = mat("attn_output")
            w["attn_q_norm"] = arr("attn_q_norm.weight")
            w["attn_k_norm"] = arr("attn_k_norm.weight")
        return w

    # -- state ----------------------------------------------------------------------------------------
    def set_kv_cache_types(self, cache_type_k: str = "auto", cache_type_v: str = "auto") -> tuple[str, str]:
        """Resolve like the CPU engine (`auto` included), then map to what the attention kernel stores
        (gpu_kv_type: only f32 changes, to f16); K and V independent."""
        k, v = resolve_cache_types(self.cfg, cache_type_k, cache_type_v)
        self.kv_cache_types = (gpu_kv_type(k), gpu_kv_type(v))
        return self.kv_cache_types

    def new_state(self, max_ctx: int | None = None, cache_type_k: str | None = None,
                  cache_type_v: str | None = None) -> GpuSequenceState:
        k, v = resolve_cache_types(self.cfg, cache_type_k or self.kv_cache_types[0],
                                   cache_type_v or self.kv_cache_types[1])
        return GpuSequenceState(self.cfg, max_ctx or self.cfg.context_length, gpu_kv_type(k), gpu_kv_type(v),
                                max_tree=self.max_tree, host_rows=self._host_table)

    def reserve_states(self, n: int, max_ctx: int, n_capture: int = 0) -> None:
        """Make the pool `n` states of max_ctx rows (with room for n_capture captured layers) now, at start-up,
        so that requests of up to max_ctx tokens take a pooled state and allocate none: the bytes the memory
        plan counts per slot are all taken before the first request."""
        with self._pool_lock:
            self.state_pool_size = int(n)
            self._state_pool.clear()
        made = []
        for _ in range(int(n)):
            st = self.new_state(max_ctx)
            if n_capture:
                st.ensure_capture(n_capture)
            made.append(st)
        with self._pool_lock:
            self._state_pool.extend(made)

    def pooled_ctx(self) -> int | None:
        """Rows of the largest pooled state (None: no pool yet): what a measurement on pooled states may use."""
        with self._pool_lock:
            return max((st.max_ctx for st in self._state_pool), default=None)

    def warm_prefill(self, capture: Sequence[int] = (), chunks: Sequence[int] = WARM_CHUNKS,
                     prompt_captures: Sequence[Sequence[int]] | None = None) -> int:
        """Run and commit a prompt chunk of each width in `chunks` that fits a pooled state (as generate.prefill
        does, capturing `capture`), then a plain decode step and two of decode_ahead, so that every kernel a prompt
        may launch is fetched now (an NVRTC build is 0.4-0.5 s on a cold cache) and not during a request, and the
        plain steps' graphs are on that state. Where prompt chunks are graph steps (prompt_chunk), their graphs in
        the first context bucket are captured too, on every pooled state, for each layer set of `prompt_captures`
        (default: `capture`'s; a plain request captures none, a speculative one its drafter's). Returns how many
        kernels were fetched."""
        room = self.pooled_ctx() or 0
        sizes = [int(n) for n in chunks if int(n) < room]
        if not sizes:
            return 0
        before = nr.loader.functions_loaded()
        st = self.acquire_state(max(sizes))
        try:
            for n in sizes:
                st.reset()
                res = self.forward(st, np.arange(n) % self.cfg.n_vocab, capture=capture, logits="last")
                if capture and n >= 3:   # the features of a path off the drafter's chain: a gather (CuPy's take)
                    _ = res.captured[[0, 2]]
                if capture and n == sizes[0]:   # and their f16 host copy (a drafter service's wire: CuPy's clip, cast)
                    res.captured[:1].to_host(np.float16)
                res = None
                st.commit(range(n))
            # and a plain decode step in the first context bucket (a request without a drafter: no layers
            # captured), its graph and its commit's
            st.reset()
            self.forward(st, [0], logits="last")
            st.commit([0])
            if self.can_decode_ahead(st):   # and greedy plain decoding's graph (decode_ahead)
                for _ in self.decode_ahead(st, 0, 2):
                    pass
        finally:
            st.reset()
            self.release_state(st)
        self._warm_prompt_graphs(prompt_captures if prompt_captures is not None else (capture,))
        return nr.loader.functions_loaded() - before

    def _warm_prompt_graphs(self, captures: Sequence[Sequence[int]]) -> None:
        """Capture on every pooled state the graphs of a prompt's chunks in the first context bucket: a whole chunk
        (no logits) and a last chunk at every width it is padded to, for each layer set in `captures`."""
        with self._pool_lock:
            states = list(self._state_pool)
            self._state_pool.clear()
            self._states_out += len(states)
        try:
            for st in states:
                top = self._prompt_top(st)
                for cap in captures if top else ():
                    for n, lg in [(top, "none")] + [(w, "last") for w in self._prompt_widths(top)]:
                        if n < st.max_ctx:
                            st.reset()
                            self.forward(st, np.arange(n) % self.cfg.n_vocab, capture=list(cap), logits=lg)
                            st.commit(range(n))
        finally:
            for st in states:
                st.reset()
                self.release_state(st)

    def acquire_state(self, n_ctx: int, limit: int | None = None) -> GpuSequenceState:
        """A state for a request of up to n_ctx tokens, from the pool when one fits (its captured graphs come
        with it: a request of shapes seen before replays instead of capturing), else a new one of n_ctx
        rounded up to GRAPH_MIN_BUCKET rows (at most `limit`), so that later requests fit it too. Hand it back
        with release_state()."""
        limit = int(limit or self.cfg.context_length)
        kv = tuple(gpu_kv_type(t) for t in resolve_cache_types(self.cfg, *self.kv_cache_types))
        with self._pool_lock:
            fits = [st for st in self._state_pool if n_ctx <= st.max_ctx <= limit and st.kv_types == kv]
            self._states_out += 1
            if fits:
                st = min(fits, key=lambda x: x.max_ctx)
                self._state_pool.remove(st)
                self.pool_stats["reused"] += 1
                st.reset()
                return st
            # none fits: free idle ones first, so that states in use plus idle ones stay within the pool size
            # (the slots the memory plan counts)
            self._state_pool.sort(key=lambda x: -x.max_ctx)
            while self._state_pool and len(self._state_pool) + self._states_out > self.state_pool_size:
                self._state_pool.pop()
        self.pool_stats["new"] += 1
        rounded = -(-int(n_ctx) // GRAPH_MIN_BUCKET) * GRAPH_MIN_BUCKET
        return self.new_state(max(int(n_ctx), min(rounded, limit)))

    def release_state(self, state: Any) -> None:
        """Keep a finished request's state (buffers and graphs) for the next one; at most `state_pool_size`
        are kept (the largest), the rest are freed. Idle pooled states take what the memory plan counts for
        that many slots (KV cache, recurrent state and replay inputs per slot)."""
        if not isinstance(state, GpuSequenceState):
            return
        state.pending = None
        with self._pool_lock:
            if any(st is state for st in self._state_pool):
                return
            self._states_out = max(0, self._states_out - 1)
            self._state_pool.append(state)
            self._state_pool.sort(key=lambda x: -x.max_ctx)
            del self._state_pool[max(0, int(self.state_pool_size)):]

    def clear_pools(self) -> None:
        """Free the pooled states (their buffers and captured graphs)."""
        with self._pool_lock:
            self._state_pool.clear()

    def memory_in_use(self) -> dict[str, int]:
        """Device bytes by holder (tests and bench/memory_check.py compare them with the memory plan): the CuPy
        pool (everything but the split-K scratch; `pool_total` counts its cached free blocks too), the graph arena
        inside it, the pooled states, and quant_gemv's split-K scratch (allocated beside the pool)."""
        from kernels import quant_gemv

        cp = self.be.xp
        pool = cp.get_default_memory_pool()
        with self._pool_lock:
            states = sum(st.nbytes for st in self._state_pool)
            graphs = sum(len(st.graphs) for st in self._state_pool)
            commits = sum(len(st.commit_graphs) for st in self._state_pool)
        arena = graph_arena(cp)
        return {"pool_used": int(pool.used_bytes()), "pool_total": int(pool.total_bytes()),
                "arena": arena.nbytes, "arena_need": arena.need, "pooled_states": states,
                "step_graphs": graphs, "commit_graphs": commits, "split_scratch": quant_gemv.split_scratch_bytes()}

    def release_cached_memory(self) -> None:
        """Return the CuPy pool's cached free blocks to the device (after a failed allocation)."""
        self.be.xp.get_default_memory_pool().free_all_blocks()

    @property
    def embeds_on_device(self) -> bool:
        """Whether device_embed() decodes rows on the device (graph-safe: no host work)."""
        return not self._host_table

    def device_embed(self, ids: Any) -> Any:
        """float32 rows (len(ids), n_embd) of device token ids, decoded on the device (not for a host table)."""
        if self._embd_dev is not None:
            return qm.embed_rows(self._embd_dev, Q4_K, self.cfg.n_embd, device_ids(ids))
        return self.be.embed(self.tok_embd, ids)

    def host_head_embed(self, tokens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float32 rows of a token table kept on the host (GpuEmbedding.on_host), into `out` when given, through a
        bounded LRU cache (backend.HostRowCache, HOST_ROW_CACHE_BYTES): ~0.1-0.2 ms a row dequantized, about a tenth
        of a 27B verify step for 23 rows, and a request's tokens repeat."""
        if self._row_cache is None:
            raise ValueError("this model's token table is not kept on the host")
        return self._row_cache.lookup(tokens, out)

    @property
    def row_cache_stats(self) -> dict[str, int]:
        return self._row_cache.stats if self._row_cache is not None else {"hits": 0, "misses": 0}

    def host_head(self) -> HostHead:
        """What a CPU drafter needs from this target: cfg, token table and lm head on the host (NumPy)."""
        return HostHead(self.cfg, self._host_embd, self._host_out)

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, state: GpuSequenceState, tokens: Sequence[int], parents: Sequence[int] | None = None,
                capture: Sequence[int] = (), checkpoints: bool = False, logits: str = "all") -> ForwardResult:
        """TargetModel.forward on the device. The logits stay there (DeviceLogits: each row's argmax is already
        on the host, a row is copied when indexed); so do the captured features (DeviceRows: np.asarray copies
        them). Per-step values go up in one copy from pinned memory. Returns when the step has run (callers
        read the result next, and their timings stay honest)."""
        cp = self.be.xp
        if logits not in ("all", "last", "none", "rows"):
            raise ValueError(f"logits must be 'all', 'last', 'none' or 'rows', not {logits!r}")
        # a chain asking for "rows" without checkpoints is a scored prompt's chunk (generate.prefill with
        # prompt_logprobs): padded to a prompt graph step like any prompt chunk, every row kept
        pad = self._prompt_pad(state, tokens, parents, checkpoints, logits)
        if logits == "rows":    # DeviceLogits already copies a row to the host only when it is read
            logits = "all"
        if pad:   # a prompt chunk as a wider checkpointed chain's graph step (PROMPT_GRAPHS)
            n_real = len(tokens)
            padded = np.concatenate([np.asarray(tokens, np.int64), np.full(pad - n_real, int(tokens[-1]), np.int64)])
            lg, amax, cap, graph = self._enqueue(state, padded, None, capture, True, "none" if logits == "none"
                                                 else "all")
            state.pending.n_real = n_real
            rows = slice(n_real - 1, n_real) if logits == "last" else slice(0, n_real)
            if lg is not None:
                lg, amax = lg[rows], amax[rows]
            if cap is not None:
                cap = cap[:n_real]
            T = n_real
        else:
            lg, amax, cap, graph = self._enqueue(state, tokens, parents, capture, checkpoints, logits)
            T = state.pending.n_tokens
        rows_idx = {"all": np.arange(T), "last": np.array([T - 1]), "none": np.array([], dtype=np.int64)}[logits]
        out = None
        n_ids = len(rows_idx)
        if lg is not None:
            ids = state.argmax_host[:n_ids] if n_ids <= state.argmax_host.size else _pinned(cp, n_ids, np.int32)
            cp.asnumpy(amax, out=ids, blocking=False)    # T ids into pinned memory, in stream order
        # the captured rows stay on the device (the drafter beside the target reads them there; np.asarray
        # copies them to the host)
        captured = DeviceRows(cap) if cap is not None else None
        cp.cuda.get_current_stream().synchronize()
        if lg is not None:
            out = DeviceLogits(lg, ids.copy())           # the pinned buffer is the next step's
        if graph:   # over the state's output buffers, which the next graph step rewrites: it copies them first
            state.handed = [weakref.ref(r) for r in (out, captured) if r is not None]
        return ForwardResult(logits=out, logit_rows=rows_idx, captured=captured)

    def prompt_chunk(self, state: GpuSequenceState, default: int) -> int:
        """generate.prefill's chunk length on this state: its widest graph step when prompt chunks run as graph
        replays (PROMPT_GRAPHS), else `default` (eager chunks)."""
        return self._prompt_top(state) or int(default)

    def _prompt_top(self, state: GpuSequenceState) -> int:
        """The width of a prompt's whole chunks as graph steps on this state (0: prompt chunks run eagerly)."""
        if not (PROMPT_GRAPHS and self.use_graphs and self.graph_blocker is None):
            return 0
        top = min(ATTN_TOKENS, state.max_tree)
        return top if top >= PROMPT_MIN_WIDTH else 0

    def _prompt_pad(self, state: GpuSequenceState, tokens: Sequence[int], parents: Sequence[int] | None,
                    checkpoints: bool, logits: str) -> int:
        """The checkpointed chain width a prompt chunk (a chain of 2+ tokens without checkpoints whose logits are
        the last row's, none, or every row's as "rows": a scored prompt's) is padded to, so that it replays a graph;
        0: it runs as it is (a whole chunk without logits is a graph step of its own; another chain asking for
        "all" is not a prompt's: eager, as before)."""
        top = self._prompt_top(state)
        T = len(tokens)
        if (not top or parents is not None or checkpoints or logits == "all" or not 2 <= T <= top
                or (T == top and logits == "none")):
            return 0
        room = state.max_ctx - state.n_past
        return next((w for w in self._prompt_widths(top) if T <= w <= room), 0)

    @staticmethod
    def _prompt_widths(top: int) -> list[int]:
        """The widths a prompt's last chunk is padded to, up to the whole chunks' `top`."""
        return sorted({w for w in PROMPT_LADDER if w < top} | {top})

    def _enqueue(self, state: GpuSequenceState, tokens: Sequence[int], parents: Sequence[int] | None,
                 capture: Sequence[int], checkpoints: bool, logits: str, ahead: int = 0) -> tuple[Any, Any, Any, bool]:
        """A step's work put in the stream (forward without the wait): per-step values, then the graph replay or the
        launches; the step becomes the state's pending one. ahead (decode_ahead's one-token steps, which commit
        themselves: _ahead_launches): 1, its values from the host; 2, the values the step before advanced on the
        device (`tokens` is not read). Returns (logits rows, their argmax, captured rows: device arrays or None;
        whether a graph ran it)."""
        tokens, par, is_chain = check_step(tokens, parents, self.cfg.n_vocab)
        faults.check("forward")
        T = len(tokens)
        if ahead and not (T == 1 and logits == "last" and not capture and not checkpoints and self.embeds_on_device):
            raise ValueError("a step ahead is a one-token decode step with its token row decoded on the device")
        per_token = checkpoints or not is_chain
        if per_token and T > state.max_tree:
            raise ValueError(f"a tree or checkpointed forward takes at most {state.max_tree} tokens on the GPU")
        state.check_room(T)
        capture = list(capture)
        for lid in capture:
            if not 0 <= lid < self.cfg.n_layer:
                raise ValueError(f"capture layer {lid} outside the model's {self.cfg.n_layer} layers")
        S = state.n_past
        small = T <= state.max_tree
        if ahead == 2:   # the step before wrote this step's values on the device: nothing to stage or upload
            positions, x0 = state.positions[:T], None
        else:
            positions, x0 = self._stage_values(state, tokens, par, is_chain)
        # graphs for the steps a request repeats (decode, verify trees and checkpointed chains, a prompt's whole
        # chunks: prompt_chunk); another chain of several tokens without checkpoints runs eagerly (forward pads a
        # prompt's last chunk to a checkpointed chain first, _prompt_pad): its length rarely comes again, and a
        # capture costs about twice an eager pass, mid-request, and a place among the state's GRAPHS_PER_STATE
        graph = (self.use_graphs and self.graph_blocker is None and small and T <= min(ATTN_TOKENS, state.max_tree)
                 and (T == 1 or per_token or (is_chain and logits == "none" and T == self._prompt_top(state))))
        # K splits of the attention: from S (eager), or from S's bucket (a graph serves every S up to it)
        s_hint = _s_bucket(S + T, state.max_ctx) - T if graph else S
        step = _Step(T=T, S=S, parents=par, is_chain=is_chain, per_token=per_token, positions=positions,
                     s_hint=s_hint)
        if graph:
            # this step writes its results into the state's output buffers: results of an earlier step still
            # held over them get their own copies first
            self.graph_stats["detached"] += state.detach_results()
            if capture:   # made (or remade) here, outside any measured or captured allocation
                state.ensure_capture(len(capture))
            key = (T, is_chain, per_token, logits, tuple(capture), s_hint) + (("ahead",) if ahead else ())
            lg, amax, cap = self._graph_step(state, step, key, logits, capture, ahead=bool(ahead))
        else:
            self.graph_stats["eager"] += 1
            lg, amax, cap = (self._ahead_launches(state, step) if ahead
                             else self._launches(state, step, logits, capture, x0))
        state.graphs_on = self.use_graphs and self.graph_blocker is None
        if ahead:   # committed by its own launches: what commit() does on the host
            state.n_past += 1
            if state.rec_layers:
                state.parity ^= 1
        else:
            state.pending = GpuPending(n_tokens=T, parents=par, per_token=per_token, is_chain=is_chain)
        return lg, amax, cap, graph

    def _stage_values(self, state: GpuSequenceState, tokens: np.ndarray, par: np.ndarray,
                      is_chain: bool) -> tuple[Any, Any]:
        """A step's values written into the state's pinned staging buffer, then one copy to the device. Returns
        (positions: a device view, x0: the embedded rows of a chunk wider than the state's width, else None)."""
        cp = self.be.xp
        T, S = len(tokens), state.n_past
        st = state.stage
        small = T <= state.max_tree
        depth, mask = _tree_shape(par, is_chain, T)
        st.h_s_len[0] = S
        st.h_swap[0] = state.parity
        if mask is not None:
            # every step of up to ATTN_TOKENS reads its ancestor mask from the state, an eager chunk wider than the
            # state's planned width too (a prompt of width + 1 .. 64 tokens): a mask left by an earlier step would
            # hide the chunk's own tokens from each other
            st.h_mask[:T] = mask
        if small:
            st.h_positions[:T] = S + depth
            st.h_tokens[:T] = tokens
            if not is_chain:
                st.h_parents[:T] = par
            positions = state.positions[:T]
        else:   # a long prefill chunk (a chain): its positions apart, eager launches
            positions = cp.arange(S, S + T, dtype=cp.int32)
        x0 = None
        rows = 0
        if self._host_table:
            if small:   # dequantized straight into the pinned staging rows
                self.host_head_embed(tokens, out=st.h_rows[:T])
                rows = T
            else:
                x0 = cp.asarray(self.host_head_embed(tokens))
        elif not small:
            x0 = self.device_embed(cp.asarray(tokens))
        st.upload(rows)
        return positions, x0

    def can_decode_ahead(self, state: Any) -> bool:
        """Whether greedy plain decoding on this state can run a step ahead of the host (decode_ahead): switched on
        (decode_ahead_on), a GPU state with nothing pending, steps replayed as graphs, token rows decoded on the
        device."""
        return (self.decode_ahead_on and isinstance(state, GpuSequenceState) and state.pending is None
                and not self._host_table and self.use_graphs and self.graph_blocker is None)

    def decode_ahead(self, state: GpuSequenceState, token: int, limit: int) -> Iterator[int]:
        """Greedy plain decoding from `token` (decided, not yet fed): yields up to `limit` tokens, each the argmax
        (lowest id on ties) after the one before, fewer when the context is full: the tokens and states that
        forward(state, [t], logits="last") + commit([0]) one token at a time give. Each step is one graph replay
        that also commits it and writes the next step's values on the device (its argmax as the token, S + 1,
        the other DeltaNet half: _ahead_launches), and step i + 1 is put in the stream before the host reads step
        i's token: the device does not wait for the host between steps (the per-token host work, the caller's
        included, runs while the step before does), and a step uploads nothing. A caller that stops early (a
        stop id) finds the step enqueued after the last token it read run and committed: the state then holds
        that token too (n_past one more than the step-by-step loop leaves)."""
        if not self.can_decode_ahead(state):
            raise ValueError("decode_ahead needs a GPU state with nothing pending, graphs on and the token rows "
                             "decoded on the device (can_decode_ahead)")
        n = int(limit)
        if n < 1:
            return
        cp = self.be.xp
        stream = cp.cuda.get_current_stream()
        if state.ahead is None:   # two pinned ids and two events: a step's and the one enqueued after it
            state.ahead = (_pinned(cp, 2, np.int32), [cp.cuda.Event(disable_timing=True) for _ in range(2)])
        ids, done = state.ahead
        # the step values and the commit's (accepted node 0: the conv windows' commit the steps run) go up from
        # pinned buffers that copies already in the stream may still read
        stream.synchronize()
        state.commit_stage.stage(0, 0, 0)
        state.commit_stage.upload()

        def enqueue(i: int) -> None:
            _, amax, _, _ = self._enqueue(state, [int(token) if i == 0 else 0], None, (), False, "last",
                                          ahead=1 if i == 0 else 2)
            cp.asnumpy(amax, out=ids[i % 2:i % 2 + 1], blocking=False)
            done[i % 2].record(stream)

        enqueue(0)
        try:
            for i in range(n):
                more = i + 1 < n and state.n_past + 1 <= state.max_ctx
                if more:
                    enqueue(i + 1)
                done[i % 2].synchronize()
                yield int(ids[i % 2])
                if not more:
                    return
        finally:
            stream.synchronize()   # (a step enqueued after the last token read ends before the state is handed on)

    def _ahead_launches(self, state: GpuSequenceState, step: _Step) -> tuple[Any, Any, Any]:
        """A decode_ahead step's launches: the one-token step, whose argmax also writes the next step's values
        (sampling.argmax(feed=): token, S + 1, position, DeltaNet half), then its commit (the conv windows; a chain
        step's final DeltaNet state is already in the half the advanced swap names)."""
        out = self._launches(state, step, "last", [], into_state=True, feed=True)
        state._commit_launches(GpuPending(n_tokens=1, parents=step.parents, per_token=False, is_chain=True))
        return out

    def _launches(self, state: GpuSequenceState, step: _Step, logits: str, capture: list[int],
                  x0: Any = None, into_state: bool = False, feed: bool = False) -> tuple[Any, Any, Any]:
        """Every launch of a step; without x0 (the embedded rows, given for long chunks) it reads the step's
        values only from the state's device buffers (what a graph captures). Returns (logits, argmax, captured)
        as device arrays (or None): the logits rows, each row's argmax (int32) and the captured layers; written
        into the state's output buffers with into_state (a graph step: its arena holds only temporaries), else
        fresh arrays."""
        cp = self.be.xp
        T = step.T
        captured = None
        if capture:
            captured = (state.ensure_capture(len(capture))[:T] if into_state
                        else cp.empty((T, len(capture), self.cfg.n_embd), cp.float32))
        if x0 is not None:
            x = x0
        elif self._host_table:
            x = state.embedded(self.cfg.n_embd)[:T]
        else:
            x = self.device_embed(state.tokens[:T])
        plan_tree_walk(state, step)
        plan = self._norm_plan(T, logits)
        h = None   # the next norm's input when the product before staged it
        for i, w in enumerate(self.layers):
            x, h = self._block(i, w, x, state, step, h, plan)
            for slot, lid in enumerate(capture):
                if lid == i:
                    captured[:, slot] = x
        out = amax = None
        if logits != "none":
            xr = x if logits == "all" else x[T - 1:]
            n = int(xr.shape[0])
            if h is None:   # (a staged output norm covers every row: n == T)
                h = nr.rms_norm(xr, self.output_norm, self.cfg.rms_eps)
            if into_state:
                out = self.output.matmul(h, out=state.out_logits[:n], wg_order=self.raw_wg_order(n))
                # greedy acceptance reads only these (lowest id on ties, as np.argmax)
                nxt = None
                if feed:   # (decode_ahead: the next step's values, written after every launch that reads them)
                    nxt = (state.tokens[:1], state.positions[:1], state.s_len,
                           state.stage.swap if state.rec_layers else None)
                amax, _ = smp.argmax(out, out=(state.out_ids[:n], state.out_max[:n]), feed=nxt)
            else:
                out = self.output.matmul(h, wg_order=self.raw_wg_order(n))
                amax, _ = smp.argmax(out)
        return out, amax, captured

    def _graph_step(self, state: GpuSequenceState, step: _Step, key: tuple, logits: str,
                    capture: list[int], ahead: bool = False) -> tuple[Any, Any, Any]:
        """Replay the state's graph for this shape; without one: eager warm-up (this step's results), then
        capture over the device's graph arena. A failed capture turns graphs off for the model (with a warning)
        and keeps the eager result; a failed allocation is raised (the request fails, graphs stay on). Returns
        (logits, argmax, captured), views of the state's output buffers."""
        cp = self.be.xp
        g = state.graphs.get(key)
        if g is not None:
            state.graphs[key] = state.graphs.pop(key)      # most recently used last (the LRU drops the first)
            g.graph.launch(cp.cuda.get_current_stream())
            g.replays += 1
            self.graph_stats["replays"] += 1
            return g.logits, g.argmax, g.captured
        # (decode_ahead enqueues a step while the one before runs: a capture may grow the arena, dropping the graphs
        # over the old one, so that one ends first; elsewhere the stream is idle here)
        cp.cuda.get_current_stream().synchronize()
        # warm-up: builds every kernel, fills every cache (nothing may load or upload while capturing) and
        # measures the arena the capture needs (the capture makes the same allocations in the same order)
        launches = ((lambda: self._ahead_launches(state, step)) if ahead  # noqa: E731
                    else lambda: self._launches(state, step, logits, capture, into_state=True))
        probe = _GraphHeap(cp, None)
        with cp.cuda.using_allocator(probe.malloc):
            out = launches()
        try:
            heap = graph_arena(cp).heap_for(probe.peak)
            if self._capture_stream is None:
                self._capture_stream = cp.cuda.Stream(non_blocking=True)
            graph, (lg, amax, cap) = _record(self._capture_stream, heap, launches)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from here on, and say why
            if is_out_of_memory(e):
                raise
            self.use_graphs = False
            self.graph_blocker = f"capture failed: {type(e).__name__}: {e}"
            self.graph_stats["failed"] += 1
            warnings.warn(f"CUDA graphs off for this model: {self.graph_blocker}", RuntimeWarning, stacklevel=3)
            return out
        while len(state.graphs) >= GRAPHS_PER_STATE:
            state.graphs.pop(next(iter(state.graphs)))
        state.graphs[key] = _StepGraph(graph=graph, logits=lg, argmax=amax, captured=cap)
        self.graph_stats["captures"] += 1
        return out

    def _norm_plan(self, T: int, logits: str) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[int, ...]]:
        """Where this step's norms are staged by the product before them (STAGE_NORMS): (post[i]: layer i's output
        projection stages its post-attention norm for ffn_gate_up; nxt[i]: its ffn_down stages the next layer's
        input norm, or the output norm when the logits cover every row; swi[i]: its ffn_gate_up stages SwiGLU for
        ffn_down, _swiglu_mode's 1 / 2, else 0). Layer 0's mixer keeps the pack: its stream is the step's input rows,
        which the staged path would add into in place."""
        key = (T, logits == "all" or T == 1, logits != "none", STAGE_NORMS, tuple(sorted(STAGE_UP_TO.items())),
               self.fused_launches, qm.Q16_TOKENS, tuple(sorted(qm.quant_gemv.RING_UP_TO.items())),
               tuple(FUSE_SWIGLU_WIDTHS), tuple(SWIGLU_PAIR_WIDTHS),
               tuple(sorted(qm.quant_gemv.SWIGLU_SHAPE.items())))  # (the knobs a bench
        # may turn between steps; SWIGLU_SHAPE's warps decide whether the SwiGLU ring can stage)
        plans = self._norm_plans
        if key not in plans:
            n = len(self.layers)
            post, nxt = [False] * n, [False] * n
            swi = tuple(self._swiglu_mode(w, T) for w in self.layers)
            if STAGE_NORMS and self.fused_launches and T <= qm.Q16_TOKENS:
                rec = self.cfg.recurrent_layers
                first = [w["ssm_in"] if rec[i] else w["attn_qkv"] for i, w in enumerate(self.layers)]
                for i, w in enumerate(self.layers):
                    out_proj = w["ssm_out"] if rec[i] else w["attn_output"]
                    post[i] = (T <= STAGE_UP_TO.get("post", 0) and i > 0
                               and can_stage_norm(out_proj, w["ffn_gate_up"], T))
                    if T > STAGE_UP_TO.get("next", 0):
                        continue
                    if i + 1 < n:
                        nxt[i] = can_stage_norm(w["ffn_down"], first[i + 1], T)
                    else:
                        nxt[i] = key[1] and key[2] and can_stage_norm(w["ffn_down"], self.output, T)
            plans[key] = (tuple(post), tuple(nxt), swi)
        return plans[key]

    def _swiglu_mode(self, w: dict, T: int) -> int:
        """How a layer's ffn_gate_up stages SwiGLU at T tokens: 2 its cluster pairs (SWIGLU_PAIR_WIDTHS, where the
        device has clusters), 1 a block per tile pair (FUSE_SWIGLU_WIDTHS), 0 not at all (the pack)."""
        if not (self.fused_launches and T <= qm.Q16_TOKENS):
            return 0
        if T in SWIGLU_PAIR_WIDTHS and can_fuse_swiglu(w["ffn_gate_up"], w["ffn_down"], T, pair=True):
            return 2
        return int(T in FUSE_SWIGLU_WIDTHS and can_fuse_swiglu(w["ffn_gate_up"], w["ffn_down"], T))

    def pack_order(self, tokens: int, *readers: Any) -> int:
        """PackedX.order of a pack of this width that `readers` (GpuMatrix / GpuStack) multiply: 1 (the wgmma
        build's) from quant_wide.WG_FROM tokens where the model can (wgmma) and their products run the wide kernel,
        on the wgmma build for one at least (quant_wide.wg_pack); else 0. No readers: whether the width may."""
        if not (self.wgmma and 0 < qw.WG_FROM <= tokens):
            return 0
        return int(not readers or qw.wg_pack([m.upload().q for r in readers for m in getattr(r, "mats", [r])], tokens))

    def raw_wg_order(self, tokens: int) -> bool:
        """Whether products of raw activations at this width may pack them in the wgmma order (RAW_WG_ORDER; each
        product then says where: QuantMatrix.matmul(wg_order=True))."""
        return RAW_WG_ORDER and self.pack_order(tokens) == 1

    def _block(self, i: int, w: dict, x, state: GpuSequenceState, step: _Step, h_in: Any = None,
               plan: tuple = ((), (), ())) -> tuple[Any, Any]:
        """One layer: (the new stream, the next norm's input when this layer's ffn_down staged it, else None).
        h_in: this layer's input norm when the layer before staged it."""
        eps = self.cfg.rms_eps
        mixer = self._deltanet if self.cfg.recurrent_layers[i] else self._gated_attention
        if not (self.fused_launches and step.T <= qm.MAX_TOKENS):
            h = nr.rms_norm(x, w["attn_norm"], eps)
            h, x = nr.rms_norm(mixer(i, w, h, state, step), w["post_attention_norm"], eps, residual=x)
            gu = w["ffn_gate_up"].matmul(h)
            f = gu.shape[1] // 2
            return x + w["ffn_down"].matmul(nr.silu_mul(gu[:, :f], gu[:, f:])), None   # residual add: FALLBACK
        # fused: each norm and the SwiGLU run in the packing of the matmul that reads them; the mixer's residual
        # add rides in the post-attention norm's pack (which writes the new stream), ffn_down's in its epilogue.
        # Staged (plan): the output projection adds into the stream and stages the norm ffn_gate_up reads, and
        # ffn_down stages the next layer's input norm (no pack launch for either).
        post, nxt, swi = plan
        mix_in = w["ssm_in"] if self.cfg.recurrent_layers[i] else w["attn_qkv"]
        h = h_in if h_in is not None else qm.pack_activations(x, rms_weight=w["attn_norm"], eps=eps,
                                                              order=self.pack_order(step.T, mix_in))
        if post and post[i]:
            px = qm.staged_norm(x, w["post_attention_norm"], eps)
            mixer(i, w, h, state, step, sink=(x, px))
        else:
            px = qm.pack_activations(mixer(i, w, h, state, step), rms_weight=w["post_attention_norm"], eps=eps,
                                     residual=x, order=self.pack_order(step.T, w["ffn_gate_up"]))
            x = px.residual
        if swi and swi[i]:  # the SwiGLU staged by the gate|up ring itself
            xd = w["ffn_gate_up"].swiglu(px, pair=swi[i] == 2)
        elif (FUSE_WIDE_SWIGLU and isinstance(px, qm.PackedX) and px.data is not None
              and can_wide_swiglu(w["ffn_gate_up"], w["ffn_down"], step.T, px.order)):  # ... or by the wide gate|up one
            xd = w["ffn_gate_up"].swiglu(px)
        else:
            gu = w["ffn_gate_up"].matmul(px)
            f = gu.shape[1] // 2
            # a ring ffn_down reads the staging alone: no fp16 x (nor its padding rows) to write
            only = SWIGLU_STAGING_ONLY and self.fused_launches and reads_staging(w["ffn_down"], step.T)
            xd = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:], staging_only=only,
                                     order=self.pack_order(step.T, w["ffn_down"]))
        staged = None
        if nxt and nxt[i]:
            norm = self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else self.output_norm
            staged = qm.staged_norm(x, norm, eps)
        w["ffn_down"].matmul(xd, out=x, accumulate=True, stage=staged)
        return x, staged

    @staticmethod
    def _out_proj(W: Any, o: Any, sink: tuple | None, wg_order: bool = False) -> Any:
        """A mixer's output projection: its product, or with sink (stream, StagedNorm) added into the stream with the
        post-attention norm staged (_block); wg_order: raw o may be packed in the wgmma order (raw_wg_order)."""
        if sink is None:
            return W.matmul(o, wg_order=wg_order)
        x, staged = sink
        W.matmul(o, out=x, accumulate=True, stage=staged, wg_order=wg_order)
        return x

    def _gated_attention(self, i: int, w: dict, h, state: GpuSequenceState, step: _Step, sink: tuple | None = None):
        c = self.cfg
        T, H, D, Hkv = step.T, c.n_head, c.head_dim, c.n_head_kv
        qkv = w["attn_qkv"].matmul(h)
        qg = qkv[:, :2 * H * D].reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = qkv[:, 2 * H * D:(2 * H + Hkv) * D].reshape(T, Hkv, D)
        v = qkv[:, (2 * H + Hkv) * D:].reshape(T, Hkv, D)
        cache = state.kv[i]
        if (self.fused_launches and FUSE_DECODE_ATTN and T == 1 and step.is_chain
                and att.decode_supported(cache, H, step.s_hint)):
            # one launch: the head norms and RoPE, the store and the attention of the one token
            q16 = None
            if ATTN_STAGE_UP_TO >= 1 and reads_staging(w["attn_output"], 1) and att.stages_output(H, D):
                q16 = self.be.xp.empty(qm.q16_words(H * D, 1), self.be.xp.uint32)
            o = att.decode_attention(q, k, v, cache, state.s_len, step.positions, w["attn_q_norm"], w["attn_k_norm"],
                                     c.n_rot, c.rope_theta, c.rms_eps, gate=gate, s_hint=step.s_hint, q16=q16)
            x = o.reshape(1, H * D) if q16 is None else qm.PackedX(None, 1, H * D, q16=q16)
            return self._out_proj(w["attn_output"], x, sink)
        q, k = nr.qk_norm_rope(q, k, w["attn_q_norm"], w["attn_k_norm"], step.positions, c.n_rot, c.rope_theta,
                               c.rms_eps)
        cache.store(k, v, state.s_len)
        q16 = None  # o's int16 staging for attn_output, written by the attention itself
        if (self.fused_launches and T <= min(ATTN_STAGE_UP_TO, ATTN_TOKENS)
                and reads_staging(w["attn_output"], T) and att.stages_output(H, D)):
            q16 = self.be.xp.empty(qm.q16_words(H * D, T), self.be.xp.uint32)
        if T <= ATTN_TOKENS:
            o = att.attention(q, cache, state.s_len, state.mask[:T], gate=gate, s_hint=step.s_hint, q16=q16)
        elif step.is_chain:
            # a long chain (prefill): blocks of 64 queries, each sees every earlier row and its own prefix
            cp = self.be.xp
            o = cp.empty((T, H, D), cp.float32)
            for j in range(0, T, ATTN_TOKENS):
                n = min(ATTN_TOKENS, T - j)
                o[j:j + n] = att.attention(q[j:j + n], cache, step.S + j, att.tree_mask(np.arange(-1, n - 1)),
                                           gate=gate[j:j + n])
        else:
            o = _tree_attention_fallback(q, cache, step, gate)
        x = o.reshape(T, H * D) if q16 is None else qm.PackedX(None, T, H * D, q16=q16)
        return self._out_proj(w["attn_output"], x, sink, self.raw_wg_order(T))

    def _deltanet(self, i: int, w: dict, h, state: GpuSequenceState, step: _Step, sink: tuple | None = None):

        c = self.cfg
        T = step.T
        Hk, Hv, dk, dv = c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_head_k_dim, c.ssm_head_v_dim
        cd, kd = c.ssm_conv_dim, c.ssm_key_dim
        L = state.slot[i]
        fused = self.fused_launches and T <= qm.MAX_TOKENS
        proj = w["ssm_in"].matmul(h)                                  # [qkv | z | beta | alpha]
        raw = state.raw_rows(T)[L, :T]                                # pre-conv rows: what commit() gathers
        z = proj[:, cd:cd + Hv * dv].reshape(T, Hv, dv)
        b = proj[:, cd + Hv * dv:cd + Hv * dv + Hv]
        alpha = proj[:, cd + Hv * dv + Hv:]
        parents = None if step.is_chain else state.parents[:T]
        # a committable step writes its conv output and gates where the commit's replay reads them
        keep = (state.mixed[L, :T], state.gates[L, 0, :T], state.gates[L, 1, :T]) if step.per_token else (None,) * 3
        pair = state.ssm_pair[:, L]   # [committed, other] when parity is 0, else swapped (the kernel reads swap)
        if fused and FUSE_DECODE_STEP and T == 1 and step.is_chain and not step.per_token:
            # one decode token: conv (keeping the raw row), q/k norm, gates and the state update in one launch, and
            # where ssm_out's gemv reads a staging, the output norm * silu(z) written as that staging by it too
            norm = (FUSE_DECODE_NORM and reads_staging(w["ssm_out"], 1) and dn.norm_stages(Hv, dv)
                    and int(w["ssm_norm"].size) == dv)
            q16 = self.be.xp.empty(qm.q16_words(Hv * dv, 1), self.be.xp.uint32) if norm else None
            o = dn.decode_step(proj[:, :cd], state.conv[L], w["ssm_conv1d"], alpha, b, w["ssm_a"], w["ssm_dt"],
                               pair[0], n_k_heads=Hk, final_state=pair[1], alt=pair[1], swap=state.stage.swap,
                               rows_out=raw, warps=dv // dn.DEFAULT_COLS if norm else DECODE_STEP_WARPS,
                               gate=proj[:, cd:cd + Hv * dv] if norm else None, norm_weight=w["ssm_norm"],
                               norm_eps=c.rms_eps, q16=q16)
            if norm:
                return self._out_proj(w["ssm_out"], qm.PackedX(None, 1, Hv * dv, q16=q16), sink)
        else:  # conv, q/k norm + gates and the walk as separate launches (any width)
            if fused and T >= FUSE_CONV_NORM_FROM:  # conv (reading the projection in place, keeping the raw
                # rows), q/k norm and gates in one launch
                mixed, g, beta = dn.conv_qk_norm_gate(proj[:, :cd], state.conv[L], w["ssm_conv1d"], alpha, b,
                                                      w["ssm_a"], w["ssm_dt"], n_k_heads=Hk, head_k_dim=dk,
                                                      parents=parents, rows_out=raw, out=keep[0], g=keep[1],
                                                      beta=keep[2])
            else:
                if fused:  # the conv reads the projection in place and keeps the raw rows itself
                    mixed = dn.conv_silu(proj[:, :cd], state.conv[L], w["ssm_conv1d"], parents=parents, rows_out=raw,
                                         out=keep[0])
                else:
                    raw[...] = proj[:, :cd]
                    mixed = dn.conv_silu(raw, state.conv[L], w["ssm_conv1d"], parents=parents, out=keep[0])
                g, beta = dn.qk_norm_gate(mixed, alpha, b, w["ssm_a"], w["ssm_dt"], n_k_heads=Hk, head_k_dim=dk,
                                          g=keep[1], beta=keep[2])
            # a tree walks the step's plan (_launches computed it), states it comes back to in shared memory; the
            # committed state is read only (a commit replays the accepted path), or a chain's final state is written
            o = dn.gated_delta_tree(mixed[:, :kd], mixed[:, kd:2 * kd], mixed[:, 2 * kd:], g, beta, pair[0],
                                    plan=None if step.is_chain else state.plan[:T],
                                    final_state=None if step.per_token else pair[1], alt=pair[1], swap=state.stage.swap)
        if fused:  # the output norm * silu(z) in ssm_out's pack
            return self._out_proj(w["ssm_out"], qm.pack_activations(o.reshape(T, Hv * dv), rms_weight=w["ssm_norm"],
                                                                    eps=c.rms_eps, gate=proj[:, cd:cd + Hv * dv],
                                                                    order=self.pack_order(T, w["ssm_out"])),
                                  sink)
        o = nr.norm_gate(o, z, w["ssm_norm"], c.rms_eps)
        return w["ssm_out"].matmul(o.reshape(T, Hv * dv))


def plan_tree_walk(state: GpuSequenceState, step: _Step) -> None:
    """A tree step's walk (dn.tree_plan from the parents in the state's device buffer), once for every DeltaNet
    layer's tree step; nothing for a chain."""
    if state.rec_layers and not step.is_chain:
        dn.tree_plan(state.parents[:step.T], out=state.plan[:step.T])


@dataclass
class _Step:
    T: int
    S: int
    parents: np.ndarray
    is_chain: bool
    per_token: bool
    positions: object
    s_hint: int = 0


def _s_bucket(n: int, max_ctx: int) -> int:
    """The S + T bucket of a graph: the next power of two from GRAPH_MIN_BUCKET, at most the context."""
    b = GRAPH_MIN_BUCKET
    while b < n:
        b *= 2
    return max(n, min(b, max_ctx))


@dataclass
class _StepGraph:
    graph: Any
    logits: Any        # views of the state's output buffers, rewritten by every replay (and every graph step)
    argmax: Any
    captured: Any
    replays: int = 0


def _record(stream: Any, heap: _GraphHeap, launches: Any) -> tuple[Any, Any]:
    """Capture `launches()` on `stream` with every allocation from `heap`: (graph, what launches returned)."""
    cp = heap.cp
    with stream:
        stream.begin_capture()
        try:
            with cp.cuda.using_allocator(heap.malloc):
                out = launches()
        except BaseException:
            stream.end_capture()   # leave capture mode before passing the error on
            raise
        graph = stream.end_capture()
    return graph, out


class GraphArenaOverflow(RuntimeError):
    """A capture allocated more than its warm-up measured (a bug: the launches must allocate alike)."""


class GraphArena:
    """The one arena a device's captured graphs take their temporaries from: every state's steps and commits,
    every GPU drafter session's passes.

    Graphs on a device replay one at a time, in stream order on one stream (the verifier runs steps under one
    engine lock, and a forward waits for its step before it returns), and a step's temporaries are dead when it
    ends: what outlives a replay (a step's logits rows, argmax ids, captured layers) is written into its state's
    output buffers, and a drafter pass's top-k is copied out before anything else runs. So one arena sized for the
    largest capture serves them all (memory_plan.graph_arena_bytes plans it), instead of an arena per graph.

    Each capture places its allocations from the start of the arena (a fresh _GraphHeap over it). A capture that
    needs more than the arena holds grows it: the graphs captured over the old one are dropped (their owners
    register here) and are captured again when next used. The verifier reserves the planned size at start-up, so
    that serving never grows it."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.base: Any = None
        self.need = 0            # the largest size a capture asked for (measured peak + slack)
        self.grown = 0           # times the arena was remade larger
        self._owners: weakref.WeakSet = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        return 0 if self.base is None else int(self.base.nbytes)

    def register(self, owner: Any) -> None:
        """An object holding graphs over this arena; owner.drop_graphs() is called when it grows."""
        self._owners.add(owner)

    def reserve(self, nbytes: int, exact: bool = False) -> None:
        """Hold at least nbytes now (a model's planned bound when it loads), or exactly nbytes (the verifier's
        planned size at start-up: graphs captured before are dropped)."""
        nbytes = _round_mib(nbytes)
        if nbytes > self.nbytes or (exact and nbytes != self.nbytes):
            self._grow(nbytes)

    def heap_for(self, peak: int) -> _GraphHeap:
        """A heap over the arena for a capture whose warm-up peaked at `peak` bytes (grown first if needed)."""
        need = int(peak) + int(peak) // 8 + ARENA_SLACK
        self.need = max(self.need, need)
        if need > self.nbytes:
            self._grow(need)
        return _GraphHeap(self.cp, self.base)

    def _grow(self, nbytes: int) -> None:
        for owner in list(self._owners):
            owner.drop_graphs()
        if self.base is not None:
            # the old arena goes back to the device before the new one is taken: left cached in CuPy's pool, a
            # smaller new arena would be carved out of it and the rest of its block held for good
            self.base = None
            pool = getattr(self.cp, "get_default_memory_pool", None)
            if pool is not None:
                pool().free_all_blocks()
        self.base = self.cp.empty(_round_mib(nbytes), self.cp.uint8)
        self.grown += 1


def _round_mib(n: int) -> int:
    return -(-int(n) // (1 << 20)) << 20


_arenas: dict[int, GraphArena] = {}
_arenas_lock = threading.Lock()


def graph_arena(cp: Any) -> GraphArena:
    """The graph arena of the current device."""
    dev = int(cp.cuda.Device().id)
    with _arenas_lock:
        arena = _arenas.get(dev)
        if arena is None:
            arena = _arenas[dev] = GraphArena(cp)
        return arena


class _GraphHeap:
    """First-fit allocator over the graph arena for the allocations of one capture.

    A graph replays fixed addresses, so its temporaries may not come from CuPy's pool (the pool would hand
    them to later eager code while the graph still writes there). Freed blocks are reused within the capture:
    the launches run in stream order, so a block freed by Python after its last launch is dead on the device
    too. With base=None the heap only measures: same placement, real memory from the default pool, `peak`
    = the arena size the same allocation sequence needs."""

    ALIGN = 512

    def __init__(self, cp: Any, base: Any):
        self.cp, self.base = cp, base
        size = (1 << 62) if base is None else int(base.nbytes)
        self.free: list[tuple[int, int]] = [(0, size)]   # (offset, bytes), sorted, coalesced
        self.peak = 0
        self.device = int(cp.cuda.Device().id)

    def malloc(self, nbytes: int) -> Any:
        n = max(self.ALIGN, -(-int(nbytes) // self.ALIGN) * self.ALIGN)
        j = next((i for i, (_, size) in enumerate(self.free) if size >= n), None)
        if j is None:
            raise GraphArenaOverflow(f"graph arena of {self.base.nbytes} bytes has no {n} bytes free (the capture "
                                     f"allocated differently from its warm-up)")
        off, size = self.free[j]
        if size == n:
            del self.free[j]
        else:
            self.free[j] = (off + n, size - n)
        self.peak = max(self.peak, off + n)
        if self.base is None:
            keep = self.cp.get_default_memory_pool().malloc(n)
            ptr = keep.ptr
        else:
            keep, ptr = self.base, self.base.data.ptr + off
        mem = self.cp.cuda.UnownedMemory(ptr, n, _HeapBlock(self, off, n, keep), self.device)
        return self.cp.cuda.MemoryPointer(mem, 0)

    def release(self, off: int, n: int) -> None:
        insort(self.free, (off, n))
        j = self.free.index((off, n))
        if j + 1 < len(self.free) and off + n == self.free[j + 1][0]:
            n += self.free.pop(j + 1)[1]
            self.free[j] = (off, n)
        if j > 0 and self.free[j - 1][0] + self.free[j - 1][1] == off:
            p_off, p_n = self.free[j - 1]
            self.free[j - 1] = (p_off, p_n + n)
            del self.free[j]


class _HeapBlock:
    """Owner of one heap block: returns it when CuPy drops the last array over it."""

    def __init__(self, heap: _GraphHeap, off: int, n: int, keep: Any):
        self.heap, self.off, self.n, self.keep = heap, off, n, keep

    def __del__(self) -> None:
        try:
            self.heap.release(self.off, self.n)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _tree_attention_fallback(q, cache: att.KVCacheLayer, step: _Step, gate):
    """FALLBACK (plain CuPy) for trees of more than 64 tokens: masked GQA attention over the cache rows,
    decoded to float32, as services.engine.layers.masked_attention computes it."""
    cp = nr.loader.require()
    T, H, D = (int(s) for s in q.shape)
    n = step.S + T
    kv = []
    for buf, rb, kind in ((cache.k, cache.row_bytes, cache.kind), (cache.v, cache.row_bytes_v, cache.kind_v)):
        kv.append(_decode_rows(cp, buf.reshape(cache.n_kv_heads, cache.ctx, rb)[:, :n], kind, D))
    k, v = kv
    anc = np.zeros((T, T), dtype=bool)
    for t in range(T):
        anc[t, t] = True
        if step.parents[t] >= 0:
            anc[t] |= anc[step.parents[t]]
    visible = cp.asarray(np.concatenate([np.ones((T, step.S), bool), anc], axis=1))
    g = H // cache.n_kv_heads
    qh = q.astype(cp.float32).reshape(T, cache.n_kv_heads, g, D).transpose(1, 2, 0, 3)
    s = cp.einsum("kgtd,ksd->kgts", qh, k) * np.float32(1.0 / np.sqrt(D))
    s = cp.where(visible[None, None], s, np.float32(-np.inf))
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = cp.einsum("kgts,ksd->kgtd", p, v).transpose(2, 0, 1, 3).reshape(T, H, D)
    return o * (1.0 / (1.0 + cp.exp(-gate.astype(cp.float32))))


def _decode_rows(cp: Any, rows: Any, kind: str, head_dim: int) -> Any:
    """FALLBACK (plain CuPy): (Hkv, n, row bytes) uint8 cache rows -> (Hkv, n, head_dim) float32 in the model's
    domain; TQ3_0 with services/engine/quants/tq3.py's math (centroid * group norm, then the inverse rotation)."""
    hkv, n = int(rows.shape[0]), int(rows.shape[1])
    rows = cp.ascontiguousarray(rows)
    if kind == "f16":
        return rows.view(cp.float16).astype(cp.float32).reshape(hkv, n, head_dim)
    if kind == "q8_0":
        blocks = rows.reshape(hkv, n, head_dim // 32, 34)
        d = cp.ascontiguousarray(blocks[..., :2]).view(cp.float16).astype(cp.float32)
        return (d * cp.ascontiguousarray(blocks[..., 2:]).view(cp.int8).astype(cp.float32)).reshape(hkv, n, head_dim)
    if kind != "tq3_0":
        raise ValueError(f"unknown KV cache type {kind!r}")
    blocks = rows.reshape(hkv, n, head_dim // tq3.QK, tq3.BLOCK_BYTES)
    norm = cp.ascontiguousarray(blocks[..., :2]).view(cp.float16).astype(cp.float32)        # (.., nb, 1)
    # value j of a block: 2 low index bits at qs[j // 4] >> 2 (j % 4), the high bit at signs[j // 8] >> (j % 8)
    low = (blocks[..., 2:10, None] >> cp.asarray([0, 2, 4, 6], dtype=cp.uint8)) & 3
    high = (blocks[..., 10:14, None] >> cp.arange(8, dtype=cp.uint8)) & 1
    idx = low.reshape(hkv, n, -1, tq3.QK) | (high.reshape(hkv, n, -1, tq3.QK) << 2)
    vals = cp.asarray(tq3.CENTROIDS)[idx.astype(cp.int32)] * norm                           # rotated domain
    g = tq3.group_size(head_dim)
    r = cp.asarray(tq3.inverse_rotate(np.eye(g, dtype=np.float32)))                          # y -> y @ R
    return (vals.reshape(hkv, n, head_dim // g, g) @ r).reshape(hkv, n, head_dim)


class HostHead:
    """The target as a CPU drafter sees it (dflash.DFlashDrafter reads cfg, tok_embd, output, be)."""

    def __init__(self, cfg: ModelConfig, tok_embd: RawTensor | np.ndarray, output: RawTensor | np.ndarray):
        from ..backend import NumpyBackend

        self.cfg = cfg
        self.be = NumpyBackend()
        self.tok_embd = self.be.embedding(tok_embd)
        self.output = self.be.weight(output)


def load_gpu_target(path: str, device: int = 0, with_tokenizer: bool = True):
    """loader.load_target for the GPU: the same LoadedTarget, its model a Qwen35GpuModel on cuda:`device`."""
    from .. import loader as ld

    mf = ld.open_model_file(path)
    if mf.kind == "gguf":
        emb = mf.tensors.get("token_embd.weight")
        cfg = ld.config_from_gguf(mf.metadata, n_vocab=emb.shape[0] if emb is not None else None, path=mf.path)
        tensors = mf.tensors
    else:
        cfg, tensors = ld.hf_checkpoint(mf)
    if cfg.arch != "qwen35":
        raise ValueError(f"{path}: the GPU backend runs qwen35 targets so far, not {cfg.arch!r} (use --device cpu)")
    model = Qwen35GpuModel(cfg, tensors, CupyBackend(device), source=mf.path)
    tok, tmpl = None, None
    if with_tokenizer:
        tok = ld._tokenizer_of(mf)  # the same helpers as loader.load_target
        if tok is not None:
            tmpl = ld.ChatTemplate(tok.chat_template or ld.DEFAULT_CHATML_TEMPLATE,
                                   bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
                                   eos_token=ld._eos_text(tok))
    return ld.LoadedTarget(path=path, cfg=cfg, model=model, tokenizer=tok, chat_template=tmpl, file=mf)
