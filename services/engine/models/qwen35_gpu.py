"""Qwen3.5 / Qwen3.6 (`qwen35`) on the GPU: models/qwen35.py's forward, block for block, on the kernels in kernels/.

Same contract as TargetModel.forward (token trees by parent list, positions n_past + depth, captured layer
outputs, per-node recurrent checkpoints, logits rows all / last / none) and the same commit(path) semantics
as state.SequenceState, with every per-sequence array on the device (GpuSequenceState). Per-step values
(positions, parents, the ancestor mask, the committed length S) are written into device buffers of the state
before the launches, so that a captured CUDA graph replays the same launches for every step of its shape.

Logits stay on the device (DeviceLogits): the step also computes each row's argmax there (kernels/sampling.py),
and forward copies only those T ids to the host; a full row crosses only when a caller indexes it (sampling).
At a 248k vocabulary that saves a 40-64 MB copy to pageable memory per verify (11-17 ms of a 40-60 ms step).
KV types: f16, q8_0 or tq3_0, K and V chosen independently (f32 is kept as f16, the kernel's widest).

CUDA graphs (default on; SPECSPLIT_CUDA_GRAPHS=0 or `model.use_graphs = False`: eager launches): the first
step of a shape on a state (width T <= 64, chain or tree, checkpoints, logits rows, captured layers, and a
power-of-two bucket of S that fixes the attention's K splits) runs eagerly while its allocations are measured,
then the same launches are captured on a side stream with every allocation taken from an arena owned by the
graph (_GraphHeap); later steps of that shape write their values (token ids, positions, parents, mask, S)
into the state's device buffers and replay. Nothing in the captured launches reads the host or syncs.

Pieces done with plain CuPy ops instead of a kernel (each marked FALLBACK below): attention of a tree wider
than 64 tokens (the attention kernel's mask is one uint64 per token; it decodes Q8_0 / TQ3_0 rows with CuPy),
KV row compaction at commit, Q8_0 embedding rows, the residual adds of steps wider than 64 tokens (narrower
steps fold norms, SwiGLU and residual adds into the matmuls' activation packing and epilogue).
"""

from __future__ import annotations

import os
import warnings
import weakref
from bisect import insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels import attention as att
from kernels import deltanet as dn
from kernels import norm_rope as nr
from kernels import quant_matmul as qm
from kernels import sampling as smp

from ..backend import CupyBackend
from ..config import ModelConfig
from ..errors import ContextOverflowError
from ..formats import RawTensor
from ..kvcache import resolve_cache_types
from ..quants import tq3
from ..state import check_commit_path
from .base import ForwardResult, TargetModel, check_step

MAX_TREE = 65            # tree nodes with recurrent checkpoints (a 64-node budget plus the root)
ATTN_TOKENS = att.MAX_TOKENS


GRAPH_MIN_BUCKET = 512   # smallest S bucket of a graph (K splits chosen for S + T up to it)
GRAPHS_PER_STATE = 64    # captured shapes kept per state (oldest dropped first: each holds an arena)


def graphs_default() -> bool:
    """CUDA-graph replay unless SPECSPLIT_CUDA_GRAPHS=0."""
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
    per_token: bool          # recurrent checkpoints after every token (else only the final state)


class GpuSequenceState:
    """Device twin of state.SequenceState: KV per attention layer, DeltaNet state + conv windows, checkpoints."""

    def __init__(self, cfg: ModelConfig, max_ctx: int, kv_k: str, kv_v: str, max_tree: int = MAX_TREE):
        cp = nr.loader.require()
        self.cfg, self.max_ctx, self.max_tree = cfg, int(max_ctx), int(max_tree)
        self.n_past = 0
        self.pending: GpuPending | None = None
        self.kv_types = (kv_k, kv_v)
        self.attn_layers = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        self.rec_layers = [i for i, r in enumerate(cfg.recurrent_layers) if r]
        self.kv = {i: att.KVCacheLayer(cfg.n_head_kv, cfg.head_dim, self.max_ctx, kv_k, kv_v)
                   for i in self.attn_layers}
        L = len(self.rec_layers)
        self.slot = {layer: j for j, layer in enumerate(self.rec_layers)}
        if L:
            hv, dk, dv, cd = cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim, cfg.ssm_conv_dim
            self.ssm = cp.zeros((L, hv, dk, dv), cp.float32)
            self.ssm_final = cp.zeros((L, hv, dk, dv), cp.float32)
            self.ckpt = cp.zeros((L, max_tree, hv, dk, dv), cp.float32)
            self.conv = cp.zeros((L, cfg.ssm_conv_kernel - 1, cd), cp.float32)
            self.raw = cp.zeros((L, max_tree, cd), cp.float32)
        # per-step values in device buffers (what a captured graph will read)
        self.positions = cp.zeros(max_tree, cp.int32)
        self.parents = cp.full(max_tree, -1, cp.int32)
        self.mask = cp.zeros(ATTN_TOKENS, cp.uint64)
        self.s_len = cp.zeros(1, cp.int32)
        self.accepted = cp.zeros(1, cp.int32)
        self.tokens = cp.zeros(max_tree, cp.int32)
        self.x_in = None          # embedded rows of a step (see embedded())
        # captured steps of this state by shape (see Qwen35GpuModel.forward); they hold the addresses of the
        # buffers above, so replacing a buffer drops them
        self.graphs: dict[tuple, _StepGraph | None] = {}

    def embedded(self, n_embd: int):
        """(max_tree, n_embd) float32 buffer for a step's embedded rows when the token table is on the host."""
        if self.x_in is None:
            cp = nr.loader.require()
            self.x_in = cp.zeros((self.tokens.size, n_embd), cp.float32)
        return self.x_in

    def check_room(self, n_new: int) -> None:
        if self.n_past + n_new > self.max_ctx:
            raise ContextOverflowError(self.n_past + n_new, self.max_ctx)

    def raw_rows(self, T: int):
        """(L, >= T, conv_dim) buffer for this step's pre-conv rows (grown for a long prefill chunk)."""
        if T > self.raw.shape[1]:
            cp = nr.loader.require()
            self.graphs.clear()
            self.raw = cp.zeros((self.raw.shape[0], T, self.raw.shape[2]), cp.float32)
        return self.raw

    def commit(self, path) -> None:
        """state.SequenceState.commit on the device: KV rows compacted, state from the path's checkpoint,
        conv window gathered along the path; nothing is recomputed."""
        p = self.pending
        if p is None:
            raise RuntimeError("commit() without a pending forward pass")
        path = check_commit_path(path, p.parents)
        if path:
            cp = nr.loader.require()
            base = self.n_past
            moved = [(d, i) for d, i in enumerate(path) if i != d]
            if moved:  # FALLBACK (plain CuPy gather): KV rows of the branch into place
                dst = cp.asarray([base + d for d, _ in moved], dtype=cp.int64)
                src = cp.asarray([base + i for _, i in moved], dtype=cp.int64)
                for c in self.kv.values():
                    # each side is [Hkv][ctx][its row bytes] and a token's row is quantized on its own (a Q8_0
                    # block or TQ3_0 rotation group never spans two tokens), so moving bytes moves the token
                    for buf, rb in ((c.k, c.row_bytes), (c.v, c.row_bytes_v)):
                        rows = buf.reshape(c.n_kv_heads, c.ctx, rb)
                        rows[:, dst] = rows[:, src]
            if self.rec_layers:
                whole = path == list(range(p.n_tokens))
                self.accepted[...] = path[-1]
                if p.per_token:
                    dn.commit_state(self.accepted, self.ckpt, self.ssm)
                elif whole:
                    self.ssm[...] = self.ssm_final
                else:
                    raise ValueError("a chain forward without checkpoints can only be committed whole")
                chain = bool(np.array_equal(p.parents, np.arange(-1, p.n_tokens - 1)))
                dn.commit_conv(self.accepted, None if chain else self.parents[:p.n_tokens],
                               self.raw[:, :p.n_tokens], self.conv)
            self.n_past += len(path)
        self.pending = None


class DeviceLogits:
    """The logits rows of a GPU forward, left on the device, with each row's argmax (computed on the device in
    the same step) already on the host. Reads like the (rows, n_vocab) float32 array of the NumPy engine where
    a caller needs one: `x[i]` (a row; any NumPy index) and np.asarray(x) copy from the device, each call a
    fresh host array; argmax_rows() and np.argmax(x, axis=-1) copy nothing."""

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


class Qwen35GpuModel(TargetModel):
    """The qwen35 target on CupyBackend; `forward` reads like models/qwen35.py with kernel calls."""

    arch = "qwen35"
    kv_cache_types: tuple[str, str] = ("f16", "f16")

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
        self.use_graphs = graphs_default()
        # norms, SwiGLU and residual adds folded into the matmuls' activation packing / epilogue (steps of <= 64
        # tokens); SPECSPLIT_FUSED_LAUNCHES=0 or `model.fused_launches = False`: the separate launches
        self.fused_launches = os.environ.get("SPECSPLIT_FUSED_LAUNCHES", "1").strip().lower() not in (
            "0", "false", "no", "off")
        # why steps cannot be captured on this model (None: they can)
        self.graph_blocker: str | None = None
        # a token table whose type the device cannot decode (GpuEmbedding.on_host, e.g. Q4_K / Q6_K): the step's
        # rows are dequantized on the host and written to state.x_in before the launches, like the token ids
        self._host_table = bool(getattr(self.tok_embd, "on_host", False))
        # detached: replays that first copied the rows of a still-held result of the same graph (DeviceLogits)
        self.graph_stats = {"captures": 0, "replays": 0, "eager": 0, "failed": 0, "detached": 0}
        self._capture_stream = None

    def _load_layer(self, i: int) -> dict:
        p, c, be = f"blk.{i}.", self.cfg, self.be
        arr = lambda n: be.array(self._need(p + n))  # noqa: E731
        mat = lambda n: be.weight(self._need(p + n + ".weight"))  # noqa: E731
        w = {"attn_norm": arr("attn_norm.weight"), "post_attention_norm": arr("post_attention_norm.weight"),
             "ffn_gate_up": be.stack([mat("ffn_gate"), mat("ffn_up")]), "ffn_down": mat("ffn_down")}
        if c.recurrent_layers[i]:
            w["ssm_in"] = be.stack([mat(n) for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")])
            w["ssm_out"] = mat("ssm_out")
            w["ssm_conv1d"] = arr("ssm_conv1d.weight")
            w["ssm_norm"] = arr("ssm_norm.weight")
            w["ssm_a"] = arr("ssm_a")
            w["ssm_dt"] = arr("ssm_dt.bias")
        else:
            w["attn_qkv"] = be.stack([mat(n) for n in ("attn_q", "attn_k", "attn_v")])
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
        return GpuSequenceState(self.cfg, max_ctx or self.cfg.context_length, gpu_kv_type(k), gpu_kv_type(v))

    def host_head_embed(self, tokens: np.ndarray) -> np.ndarray:
        """float32 rows of a token table kept on the host (GpuEmbedding.on_host)."""
        from ..backend import NumpyBackend

        return NumpyBackend().embed(self.tok_embd.host, tokens)

    def host_head(self) -> HostHead:
        """What a CPU drafter needs from this target: cfg, token table and lm head on the host (NumPy)."""
        return HostHead(self.cfg, self._host_embd, self._host_out)

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, state: GpuSequenceState, tokens: Sequence[int], parents: Sequence[int] | None = None,
                capture: Sequence[int] = (), checkpoints: bool = False, logits: str = "all") -> ForwardResult:
        """TargetModel.forward on the device. The logits stay there (DeviceLogits: each row's argmax is already
        on the host, a row is copied when indexed); captured features come back as host float32. Returns when
        the step has run (callers read the result next, and their timings stay honest)."""
        cp = self.be.xp
        tokens, par, is_chain = check_step(tokens, parents, self.cfg.n_vocab)
        T = len(tokens)
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', not {logits!r}")
        per_token = checkpoints or not is_chain
        if per_token and T > state.max_tree:
            raise ValueError(f"a tree or checkpointed forward takes at most {state.max_tree} tokens on the GPU")
        state.check_room(T)
        capture = list(capture)
        for lid in capture:
            if not 0 <= lid < self.cfg.n_layer:
                raise ValueError(f"capture layer {lid} outside the model's {self.cfg.n_layer} layers")
        depth = np.zeros(T, dtype=np.int64)
        for i in range(T):
            depth[i] = 0 if par[i] < 0 else depth[par[i]] + 1

        # per-step values into the state's device buffers
        S = state.n_past
        if T > state.positions.size:
            state.graphs.clear()
            state.positions = cp.zeros(T, cp.int32)
        state.positions[:T] = cp.asarray((S + depth).astype(np.int32))
        if not is_chain:
            state.parents[:T] = cp.asarray(par.astype(np.int32))
        if T <= ATTN_TOKENS:
            state.mask[:T] = cp.asarray(att.tree_mask(par))
        small = T <= state.tokens.size
        if small:
            state.tokens[:T] = cp.asarray(tokens.astype(np.int32))
        x0 = None
        if self._host_table:
            rows = cp.asarray(self.host_head_embed(tokens))
            if small:
                state.embedded(self.cfg.n_embd)[:T] = rows
            else:
                x0 = rows
        elif not small:
            x0 = self.be.embed(self.tok_embd, cp.asarray(tokens))
        state.s_len.fill(S)
        graph = self.use_graphs and self.graph_blocker is None and small and T <= min(ATTN_TOKENS, state.max_tree)
        # K splits of the attention: from S (eager), or from S's bucket (a graph serves every S up to it)
        s_hint = _s_bucket(S + T, state.max_ctx) - T if graph else S
        step = _Step(T=T, S=S, parents=par, is_chain=is_chain, per_token=per_token,
                     positions=state.positions[:T], s_hint=s_hint)
        if graph:
            key = (T, is_chain, per_token, logits, tuple(capture), s_hint)
            lg, amax, cap, g = self._graph_step(state, step, key, logits, capture)
        else:
            self.graph_stats["eager"] += 1
            (lg, amax, cap), g = self._launches(state, step, logits, capture, x0), None
        state.pending = GpuPending(n_tokens=T, parents=par, per_token=per_token)
        rows = {"all": np.arange(T), "last": np.array([T - 1]), "none": np.array([], dtype=np.int64)}[logits]
        out = None
        if lg is not None:
            ids = np.ndarray((len(rows),), np.int32, buffer=cp.cuda.alloc_pinned_memory(4 * len(rows)))
            cp.asnumpy(amax, out=ids, blocking=False)    # T ids into pinned memory, in stream order
            out = DeviceLogits(lg, ids)
            if g is not None:  # the graph's next replay rewrites these rows: out copies them first
                g.handed = weakref.ref(out)
        captured = cp.asnumpy(cap) if cap is not None else None
        cp.cuda.get_current_stream().synchronize()
        return ForwardResult(logits=out, logit_rows=rows, captured=captured)

    def _launches(self, state: GpuSequenceState, step: _Step, logits: str, capture: list[int],
                  x0: Any = None) -> tuple[Any, Any, Any]:
        """Every launch of a step; without x0 (the embedded rows, given for long chunks) it reads the step's
        values only from the state's device buffers (what a graph captures). Returns (logits, captured) as device
        arrays (or None): the logits rows, each row's argmax (int32) and the captured layers."""
        cp = self.be.xp
        T = step.T
        captured = cp.empty((T, len(capture), self.cfg.n_embd), cp.float32) if capture else None
        if x0 is not None:
            x = x0
        elif self._host_table:
            x = state.embedded(self.cfg.n_embd)[:T]
        else:
            x = self.be.embed(self.tok_embd, state.tokens[:T])
        for i, w in enumerate(self.layers):
            x = self._block(i, w, x, state, step)
            for slot, lid in enumerate(capture):
                if lid == i:
                    captured[:, slot] = x
        out = amax = None
        if logits != "none":
            xr = x if logits == "all" else x[T - 1:]
            out = self.output.matmul(nr.rms_norm(xr, self.output_norm, self.cfg.rms_eps))
            amax, _ = smp.argmax(out)     # greedy acceptance reads only these (lowest id on ties, as np.argmax)
        return out, amax, captured

    def _graph_step(self, state: GpuSequenceState, step: _Step, key: tuple, logits: str,
                    capture: list[int]) -> tuple[Any, Any, Any, _StepGraph | None]:
        """Replay the state's graph for this shape; without one: eager warm-up (this step's results), then
        capture. A failed capture turns graphs off for the model (with a warning) and keeps the eager result.
        Returns (logits, argmax, captured, the graph whose buffers they are or None)."""
        cp = self.be.xp
        g = state.graphs.get(key)
        if g is not None:
            last = g.handed() if g.handed is not None else None
            if last is not None:   # a result of this graph is still held: give it its own rows first
                last._detach()
                self.graph_stats["detached"] += 1
            g.graph.launch(cp.cuda.get_current_stream())
            g.replays += 1
            self.graph_stats["replays"] += 1
            return g.logits, g.argmax, g.captured, g
        # warm-up: builds every kernel, fills every cache (nothing may load or upload while capturing) and
        # measures the arena the capture needs (the capture makes the same allocations in the same order)
        probe = _GraphHeap(cp, None)
        with cp.cuda.using_allocator(probe.malloc):
            out = self._launches(state, step, logits, capture)
        try:
            # the graph's own arena: its addresses stay reserved while the graph lives
            heap = _GraphHeap(cp, cp.empty(probe.peak + probe.peak // 8 + (4 << 20), cp.uint8))
            if self._capture_stream is None:
                self._capture_stream = cp.cuda.Stream(non_blocking=True)
            graph, (lg, amax, cap) = _record(self._capture_stream, heap,
                                             lambda: self._launches(state, step, logits, capture))
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from here on, and say why
            self.use_graphs = False
            self.graph_blocker = f"capture failed: {type(e).__name__}: {e}"
            self.graph_stats["failed"] += 1
            warnings.warn(f"CUDA graphs off for this model: {self.graph_blocker}", RuntimeWarning, stacklevel=3)
            return (*out, None)
        while len(state.graphs) >= GRAPHS_PER_STATE:
            state.graphs.pop(next(iter(state.graphs)))
        state.graphs[key] = _StepGraph(graph=graph, heap=heap, logits=lg, argmax=amax, captured=cap)
        self.graph_stats["captures"] += 1
        return (*out, None)

    def _block(self, i: int, w: dict, x, state: GpuSequenceState, step: _Step):
        eps = self.cfg.rms_eps
        mixer = self._deltanet if self.cfg.recurrent_layers[i] else self._gated_attention
        if not (self.fused_launches and step.T <= qm.MAX_TOKENS):
            h = nr.rms_norm(x, w["attn_norm"], eps)
            h, x = nr.rms_norm(mixer(i, w, h, state, step), w["post_attention_norm"], eps, residual=x)
            gu = w["ffn_gate_up"].matmul(h)
            f = gu.shape[1] // 2
            return x + w["ffn_down"].matmul(nr.silu_mul(gu[:, :f], gu[:, f:]))   # residual add: FALLBACK (CuPy)
        # fused: each norm and the SwiGLU run in the packing of the matmul that reads them; the mixer's residual
        # add rides in the post-attention norm's pack (which writes the new stream), ffn_down's in its epilogue
        h = qm.pack_activations(x, rms_weight=w["attn_norm"], eps=eps)
        px = qm.pack_activations(mixer(i, w, h, state, step), rms_weight=w["post_attention_norm"], eps=eps,
                                 residual=x)
        x = px.residual
        gu = w["ffn_gate_up"].matmul(px)
        f = gu.shape[1] // 2
        w["ffn_down"].matmul(qm.pack_activations(gu[:, :f], silu_up=gu[:, f:]), out=x, accumulate=True)
        return x

    def _gated_attention(self, i: int, w: dict, h, state: GpuSequenceState, step: _Step):
        c = self.cfg
        T, H, D, Hkv = step.T, c.n_head, c.head_dim, c.n_head_kv
        qkv = w["attn_qkv"].matmul(h)
        qg = qkv[:, :2 * H * D].reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = qkv[:, 2 * H * D:(2 * H + Hkv) * D].reshape(T, Hkv, D)
        v = qkv[:, (2 * H + Hkv) * D:].reshape(T, Hkv, D)
        q, k = nr.qk_norm_rope(q, k, w["attn_q_norm"], w["attn_k_norm"], step.positions, c.n_rot, c.rope_theta,
                               c.rms_eps)
        cache = state.kv[i]
        cache.store(k, v, state.s_len)
        if T <= ATTN_TOKENS:
            o = att.attention(q, cache, state.s_len, state.mask[:T], gate=gate, s_hint=step.s_hint)
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
        return w["attn_output"].matmul(o.reshape(T, H * D))

    def _deltanet(self, i: int, w: dict, h, state: GpuSequenceState, step: _Step):

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
        if fused:  # the conv reads the projection in place and keeps the raw rows itself
            mixed = dn.conv_silu(proj[:, :cd], state.conv[L], w["ssm_conv1d"], parents=parents, rows_out=raw)
        else:
            raw[...] = proj[:, :cd]
            mixed = dn.conv_silu(raw, state.conv[L], w["ssm_conv1d"], parents=parents)
        g, beta = dn.qk_norm_gate(mixed, alpha, b, w["ssm_a"], w["ssm_dt"], n_k_heads=Hk, head_k_dim=dk)
        o = dn.gated_delta_tree(mixed[:, :kd], mixed[:, kd:2 * kd], mixed[:, 2 * kd:], g, beta, state.ssm[L],
                                parents=parents, checkpoints=state.ckpt[L] if step.per_token else None,
                                final_state=None if step.per_token else state.ssm_final[L])
        if fused:  # the output norm * silu(z) in ssm_out's pack
            return w["ssm_out"].matmul(qm.pack_activations(o.reshape(T, Hv * dv), rms_weight=w["ssm_norm"],
                                                           eps=c.rms_eps, gate=proj[:, cd:cd + Hv * dv]))
        o = nr.norm_gate(o, z, w["ssm_norm"], c.rms_eps)
        return w["ssm_out"].matmul(o.reshape(T, Hv * dv))


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
    heap: _GraphHeap
    logits: Any        # device outputs inside the arena, rewritten by every replay
    argmax: Any
    captured: Any
    replays: int = 0
    handed: Any = None  # weakref to the DeviceLogits last returned over `logits`


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


class _GraphHeap:
    """First-fit allocator over one arena for the allocations of a captured step.

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
            raise MemoryError(f"graph arena of {self.base.nbytes} bytes has no {n} bytes free (the capture "
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
