"""The DFlash drafter on the GPU: models/dflash.py's DFlashDrafter, block for block, on CupyBackend and kernels/,
with its context K/V in device memory and each draft pass (append + block + LM head + top-k) one CUDA graph replay.

Same public interface as DFlashDrafter (new_session, append_context, draft, block_logits, block_size,
target_layer_ids, n_vocab, cfg), plus draft_topk: what DDTree reads (top-k ids and log-probabilities per drafted
position) is all that comes back to the host. The token table and LM head are the target's own device arrays when
the target is a Qwen35GpuModel on the same device (no second copy).

Per-step values (the context length before and after the append, the positions, the block's first token) live in one
device int32 buffer of the session and the new feature rows in a device buffer, so a captured pass replays for every
step of its shape: (rows appended, the attention's S bucket). A
step appends at most a block and its bonus token (graph_append rows); a longer append (a prompt, the plain steps of
a drafter pause) runs eagerly first, then the pass with nothing to append, so capture_passes captures every pass of
a step at start-up (each pooled session, the first S bucket) and requests replay them. Attention: kernels.attention
over the session's f16 KVCacheLayer (context rows, then the block's rows at `start`), mask all-ones (full layers,
bidirectional) or causal (sliding layers); a sliding layer passes its window to the kernel, which hides committed
row j from block token t unless j >= start - (window - 1) + t (SpecForge's per-query window) and reads only the tiles
from the first row a token sees, in place (nothing is hidden while start + block <= window).

Sessions outlive a request: GpuProposer takes one from the drafter's pool (acquire_session) and returns it on
close, so a request replays the graphs an earlier one captured (session_pool_size of them kept; the verifier sets
its slots and makes them at start-up with reserve_sessions, at the serving context: GpuDraftSession.nbytes is what
the memory plan counts per slot). A pass's values and the first embedded row go up in one copy from pinned memory;
its top-k ids and log-probabilities come back in one copy. Captured passes take their temporaries from the
device's one graph arena (qwen35_gpu.GraphArena), shared with the target's graphs: a pass's outputs live there
until the next replay, so draft() and draft_topk() copy them out at once.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels import attention as att
from kernels import norm_rope as nr
from kernels import quant_matmul as qm
from kernels import sampling as smp

from ..backend import CupyBackend, HostRowCache
from ..errors import DrafterMismatchError, ModelFormatError, is_out_of_memory
from ..formats import RawTensor
from ..pinned import HostRows, pin_host
from . import qwen35_gpu as QG
from .dflash import _LAYER_TENSORS, DFlashDrafter, DrafterConfig, _expected_shapes, read_drafter

TOPK = smp.MAX_K              # top-k computed on the device per drafted position (DDTree asks for <= 8)
MAX_APPEND = 64               # feature rows a captured pass appends; longer appends (a prompt) run eagerly first
INITIAL_ROWS = 512            # first context capacity of a session; doubled (graphs dropped) when outgrown
GRAPHS_PER_SESSION = 64
# matrices of a layer uploaded as one (q stays apart: the context rows need only k | v); memory_plan.GPU_DRAFTER_STACKS
STACKS = {"attn_kv": ("attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}
_ARANGE_APPEND = np.arange(MAX_APPEND, dtype=np.int32)


@dataclass
class _DraftGraph:
    graph: Any
    outputs: Any       # _head's (logits, ids, log-probs, packed) inside the graph arena, valid until the next replay
    replays: int = 0


class GpuDraftSession:
    """One request's draft state on the device: per layer an f16 KVCacheLayer of committed context rows (k after
    k_norm + RoPE; the block's own rows are written after them by each pass and overwritten by the next append),
    the per-step values of a pass, and the captured passes of this session."""

    def __init__(self, cfg: DrafterConfig, capacity: int = INITIAL_ROWS, max_rows: int | None = None,
                 host_rows: bool = False):
        self.cfg = cfg
        self.max_rows = max_rows      # growth stops doubling here (the target's context + a block)
        if max_rows is not None:
            capacity = min(capacity, max_rows)
        self.n_ctx = 0
        self.cp = cp = nr.loader.require()
        self.kv = [att.KVCacheLayer(cfg.n_head_kv, cfg.head_dim, capacity, "f16") for _ in range(cfg.n_layer)]
        B = cfg.block_size
        # [s_ctx, start, ctx positions (MAX_APPEND), block positions (B), block tokens (B)], then (a token table
        # the device cannot decode) the block's rows embedded on the host: one device buffer and its pinned
        # twin, so a pass's values go up in one copy (the header and the first row; the mask-token rows after
        # it are written once)
        n_vals = 2 + MAX_APPEND + 2 * B
        self.vals_bytes = -(-4 * n_vals // 256) * 256
        self.row_bytes = 4 * cfg.n_embd if host_rows else 0
        total = self.vals_bytes + B * self.row_bytes
        self.stage = cp.zeros(total, cp.uint8)
        self.h_stage = QG._pinned(cp, total, np.uint8)
        self.h_stage[...] = 0
        self.vals = self.stage[:4 * n_vals].view(np.int32)
        self.h_vals = self.h_stage[:4 * n_vals].view(np.int32)
        self.x_in = self.h_x_in = None
        if host_rows:
            self.x_in = self.stage[self.vals_bytes:].view(np.float32).reshape(B, cfg.n_embd)
            self.h_x_in = self.h_stage[self.vals_bytes:].view(np.float32).reshape(B, cfg.n_embd)
        self.feats = cp.zeros((MAX_APPEND, cfg.n_features), cp.float32)
        # a pass's top-k ids and log-probabilities (bits) side by side, copied here in one transfer
        self.h_top = QG._pinned(cp, (B - 1) * 2 * TOPK, np.int32).reshape(B - 1, 2 * TOPK)
        self.graphs: dict[tuple, _DraftGraph] = {}
        QG.graph_arena(cp).register(self)

    def drop_graphs(self) -> None:
        self.graphs.clear()

    @property
    def nbytes(self) -> int:
        """Device bytes this session holds (what memory_plan.gpu_session_bytes counts per slot)."""
        arrays = [c.k for c in self.kv] + [c.v for c in self.kv] + [self.stage, self.feats]
        return sum(int(a.nbytes) for a in arrays)

    # views into vals (kernel arguments point into the one buffer)
    @property
    def s_ctx(self) -> Any:
        return self.vals[0:1]

    @property
    def s_start(self) -> Any:
        return self.vals[1:2]

    def ctx_pos(self, n: int) -> Any:
        return self.vals[2:2 + n]

    @property
    def blk_pos(self) -> Any:
        return self.vals[2 + MAX_APPEND:2 + MAX_APPEND + self.cfg.block_size]

    @property
    def tokens(self) -> Any:
        return self.vals[2 + MAX_APPEND + self.cfg.block_size:]

    @property
    def capacity(self) -> int:
        return self.kv[0].max_ctx

    def upload(self, whole: bool = False) -> None:
        """One host-to-device copy of the pass's values (and of the first embedded row, or all of them)."""
        n = self.vals_bytes + (self.stage.size - self.vals_bytes if whole else self.row_bytes)
        QG._upload(self.cp, self.stage[:n], self.h_stage[:n])

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows (context plus a block); growing copies the valid rows and drops the graphs."""
        if rows <= self.capacity:
            return
        cap = max(rows, 2 * self.capacity if self.max_rows is None else min(2 * self.capacity, self.max_rows))
        c = self.cfg
        for i, old in enumerate(self.kv):
            new = att.KVCacheLayer(c.n_head_kv, c.head_dim, cap, "f16")
            for a, b in ((old.k, new.k), (old.v, new.v)):
                kept = a.reshape(c.n_head_kv, old.ctx, -1)[:, :self.n_ctx]
                b.reshape(c.n_head_kv, new.ctx, -1)[:, :self.n_ctx] = kept
            self.kv[i] = new
        self.graphs.clear()

    def truncate(self, n_ctx: int) -> None:
        """Forget context rows from n_ctx on (error recovery; the normal loop never rolls back)."""
        if not 0 <= n_ctx <= self.n_ctx:
            raise ValueError(f"cannot truncate a {self.n_ctx}-row draft context to {n_ctx}")
        self.n_ctx = n_ctx

    def context_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float32 host copies of a layer's context rows [n_ctx, Hkv, D] (tests, checks)."""
        c, kv = self.cfg, self.kv[layer]
        return tuple(np.ascontiguousarray(self.cp.asnumpy(
            buf.view(self.cp.float16).reshape(c.n_head_kv, kv.ctx, c.head_dim)[:, :self.n_ctx]
        ).transpose(1, 0, 2), dtype=np.float32) for buf in (kv.k, kv.v))


class DFlashGpuDrafter:
    """DFlashDrafter on the device; bound to its target (token table and LM head shared, checked like the CPU's)."""

    # host f16 features (a drafter service's rows off the wire) go up as f16 and widen on the device: half the upload,
    # no conversion on the host (services/drafter/service.py FeatureReader keeps them f16 for a drafter saying so)
    takes_f16_features = True

    def __init__(self, cfg: DrafterConfig, tensors: Mapping[str, RawTensor | np.ndarray], target: Any,
                 backend: CupyBackend | None = None, source: str = "<drafter>"):
        tbe = getattr(target, "be", None)
        if backend is None:
            backend = tbe if isinstance(tbe, CupyBackend) else CupyBackend()
        if isinstance(tbe, CupyBackend) and tbe.device != backend.device:
            # in-process, a drafter and its GPU target share one device (the token table and LM head are the
            # target's); a drafter on a GPU of its own runs as the drafter service (placement.check_devices says so)
            raise ValueError(
                f"a GPU drafter on cuda:{backend.device} with its target on cuda:{tbe.device} in one process: put both "
                f"on one device, or run the drafter service there (`specsplit drafter --device cuda:{backend.device}`)")
        self.cfg, self.target, self.be, self.source = cfg, target, backend, source
        self.xp = backend.xp
        self.target_layer_ids: list[int] = list(cfg.target_layer_ids)
        self.block_size: int = cfg.block_size
        self.mask_token_id: int = cfg.mask_token_id
        DFlashDrafter._check_target(self)   # reads cfg, target, source only
        # the target's device table and LM head when it has them, else device copies of its host ones
        if isinstance(tbe, CupyBackend):
            self.tok_embd, self.output = target.tok_embd, target.output
        else:
            self.tok_embd = backend.embedding(target.tok_embd)
            self.output = backend.weight(target.output)
        self.output.upload()

        # the same checks as DFlashDrafter's constructor
        t = dict(tensors)
        fc = t.get("dflash_fc.weight")
        if fc is not None and len(fc.shape) == 2 and fc.shape[1] != cfg.n_features:
            raise DrafterMismatchError(
                f"{source}: fc takes {fc.shape[1]} input features but {len(cfg.target_layer_ids)} target "
                f"layers {cfg.target_layer_ids} x hidden {cfg.n_embd} = {cfg.n_features}")
        if cfg.n_head % cfg.n_head_kv:
            raise ModelFormatError(source, "attention heads divisible by KV heads",
                                   f"{cfg.n_head} heads, {cfg.n_head_kv} KV heads")
        for name, shape in _expected_shapes(cfg).items():
            got = tuple(int(d) for d in t[name].shape) if name in t else None
            if got != shape:
                raise ModelFormatError(source, f"tensor '{name}' of shape {list(shape)}",
                                       "it missing" if got is None else f"shape {list(got)}")
        B = cfg.block_size
        if B > att.MAX_TOKENS:
            raise ValueError(f"{source}: a block of {B} tokens does not fit the attention kernel's "
                             f"{att.MAX_TOKENS}-token mask")
        be = backend
        self.fc = be.weight(t["dflash_fc.weight"]).upload()
        self.hidden_norm = be.array(t["dflash_hidden_norm.weight"])
        self.output_norm = be.array(t["output_norm.weight"])
        self.layers = []
        for i in range(cfg.n_layer):
            raw = {n: t[f"blk.{i}.{n}.weight"] for n in _LAYER_TENSORS}
            mat = lambda n, raw=raw: be.weight(raw[n])  # noqa: E731
            w = {n: be.array(raw[n]) for n in ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")}
            # q apart from k|v: the context rows need only k|v, and one k|v copy serves both (dflash.py stacks
            # q|k|v as well, which on the device would hold k and v twice)
            w["attn_q"] = mat("attn_q").upload()
            w["attn_kv"] = be.stack([mat(n) for n in STACKS["attn_kv"]]).upload()
            w["attn_output"] = mat("attn_output").upload()
            w["ffn_gate_up"] = be.stack([mat(n) for n in STACKS["ffn_gate_up"]]).upload()
            w["ffn_down"] = mat("ffn_down").upload()
            self.layers.append(w)
        cp = self.xp
        # (memory_plan counts these two with the drafter's weights)
        self._mask_full = cp.full(B, (1 << B) - 1, dtype=cp.uint64)     # every block key visible to every query
        self._mask_causal = cp.asarray(att.tree_mask(np.arange(-1, B - 1)))
        # a table the device cannot decode: the block's rows are embedded on the host, unless the target (whose
        # table it is) decodes them on the device (Qwen35GpuModel.device_embed: a Q4_K table)
        self._device_embed = (self.tok_embd is getattr(target, "tok_embd", None)
                              and bool(getattr(target, "embeds_on_device", False)))
        self._host_table = bool(getattr(self.tok_embd, "on_host", False)) and not self._device_embed
        # host_embed's rows of a table on the host, each dequantized once: the target's cache when the table is the
        # target's, else one of the drafter's own (a drafter service's)
        self._host_rows: Callable[[np.ndarray], np.ndarray] | None = None
        if self.tok_embd is getattr(target, "tok_embd", None) and hasattr(target, "host_head_embed"):
            self._host_rows = target.host_head_embed
        elif getattr(self.tok_embd, "on_host", False):
            self._host_rows = HostRowCache(self.tok_embd.host, cfg.n_embd, QG.HOST_ROW_CACHE_BYTES).lookup
        self.use_graphs = QG.graphs_default()
        self.graph_blocker: str | None = None
        self.graph_stats = {"captures": 0, "replays": 0, "eager": 0, "failed": 0}
        # feature rows a captured pass appends: a step's accepted tokens (at most a block and the bonus token);
        # longer appends run eagerly first
        self.graph_append = min(MAX_APPEND, B + 1)
        self._stream = None
        # finished requests' sessions kept for the next ones (acquire_session / release_session): a session
        # captures its graphs per shape, so a new session per request would capture them all again. Bounded:
        # the verifier sets the size to its slots; 1 for one request at a time.
        self.session_pool_size = 1
        self._pool: list[GpuDraftSession] = []
        self._pool_lock = threading.Lock()
        self.pool_stats = {"new": 0, "reused": 0}
        # context rows a session may grow to (None: the target's context length + a block); the verifier sets
        # its serving context + a block (reserve_sessions)
        self.max_rows: int | None = None
        if self.use_graphs and hasattr(target, "arena_bound"):   # its passes' share of the shared graph arena
            QG.graph_arena(cp).reserve(target.arena_bound(cfg))

    @property
    def n_vocab(self) -> int:
        return int(self.output.shape[0])

    @property
    def weight_bytes(self) -> int:
        """Device bytes of the drafter's own matrices (the shared table and LM head not counted)."""
        mats = [self.fc] + [w[n] for w in self.layers for n in ("attn_q", "attn_kv", "attn_output",
                                                                  "ffn_gate_up", "ffn_down")]
        return sum(m.nbytes for m in mats)

    # -- context -------------------------------------------------------------------------------------
    def new_session(self, capacity: int = INITIAL_ROWS) -> GpuDraftSession:
        ctx = getattr(getattr(self.target, "cfg", None), "context_length", None)
        rows = self.max_rows if self.max_rows is not None else (ctx + self.block_size if ctx else None)
        s = GpuDraftSession(self.cfg, capacity, max_rows=rows, host_rows=self._host_table)
        B = self.block_size
        s.h_vals[2 + MAX_APPEND + B:] = self.mask_token_id
        if self._host_table:
            s.h_x_in[...] = self.host_embed(np.full(B, self.mask_token_id))
        s.upload(whole=True)
        return s

    def acquire_session(self) -> GpuDraftSession:
        """A session for a new request: a pooled one when there is one (its buffers and captured graphs come
        with it, so a request of shapes seen before replays instead of capturing), else a new one. Hand it
        back with release_session()."""
        with self._pool_lock:
            if self._pool:
                s = max(self._pool, key=lambda x: x.capacity)
                self._pool.remove(s)
                self.pool_stats["reused"] += 1
                s.n_ctx = 0
                return s
        self.pool_stats["new"] += 1
        return self.new_session()

    def reserve_sessions(self, n: int, max_ctx: int) -> None:
        """Make the pool `n` sessions holding max_ctx context rows and a block now, at start-up: a request of up to
        max_ctx tokens then grows none, and every byte the memory plan counts per slot for the drafter is taken
        before the first request."""
        self.max_rows = int(max_ctx) + self.block_size
        with self._pool_lock:
            self.session_pool_size = int(n)
            self._pool.clear()
        made = []
        for _ in range(int(n)):
            made.append(self.new_session(self.max_rows))
        with self._pool_lock:
            self._pool.extend(made)

    def capture_passes(self) -> int:
        """Capture, on every pooled session, the pass of each append a step makes (0 .. graph_append rows) in the
        first context bucket, now (at start-up, after reserve_sessions): requests then replay them instead of
        capturing mid-request. Returns how many were captured (0 with graphs off)."""
        if not (self.use_graphs and self.graph_blocker is None):
            return 0
        with self._pool_lock:
            sessions = list(self._pool)
        before = self.graph_stats["captures"]
        feats = self.xp.zeros((self.graph_append, self.cfg.n_features), self.xp.float32)
        for s in sessions:
            for n in range(self.graph_append + 1):
                s.n_ctx = 1          # one context row, whatever it holds: only the shapes matter (emptied after)
                self._pass(s, feats[:n], 0, 1 + n)
            s.n_ctx = 0
        self.xp.cuda.get_current_stream().synchronize()
        return self.graph_stats["captures"] - before

    def warm_appends(self, chunks: Sequence[int] = QG.WARM_CHUNKS) -> int:
        """Append feature rows of each count in `chunks` that fits a pooled session eagerly (a prompt's append),
        so that every kernel an append may launch is fetched now and not during a request; the session is left
        empty. Returns how many kernels were fetched."""
        with self._pool_lock:
            s = max(self._pool, key=lambda x: x.capacity, default=None)
        if s is None:
            return 0
        sizes = [int(n) for n in chunks if int(n) + self.block_size <= s.capacity]
        before = nr.loader.functions_loaded()
        feats = self.xp.zeros((max(sizes, default=1), self.cfg.n_features), self.xp.float32)
        for n in sizes:
            s.n_ctx = 0
            self.append_context(s, feats[:n], n)
        s.n_ctx = 0
        self.xp.cuda.get_current_stream().synchronize()
        return nr.loader.functions_loaded() - before

    def release_session(self, session: GpuDraftSession) -> None:
        """Keep a finished request's session for the next one; at most `session_pool_size` are kept (those of
        the largest context caches), the rest are freed. The memory plan counts a drafter context cache per
        slot, which is what that many idle sessions hold."""
        with self._pool_lock:
            if any(s is session for s in self._pool):
                return
            self._pool.append(session)
            self._pool.sort(key=lambda x: -x.capacity)
            del self._pool[max(0, int(self.session_pool_size)):]

    def clear_pool(self) -> None:
        with self._pool_lock:
            self._pool.clear()

    def use_device(self) -> None:
        """Make this drafter's device the calling thread's current one (CuPy's is per thread): a thread that drafts
        besides the one that loaded it (a drafter service's event loop) calls this first."""
        self.xp.cuda.Device(self.be.device).use()

    def pin_host_rows(self, buf: Any) -> Any:
        """A drafter service's read-only mapping of a stream's segment registered in this drafter's device context
        (pinned.pin_host), or None: its features then reach _features as HostRows, one direct copy each."""
        return pin_host(buf, read_only=True, device=self.be.device)

    def _features(self, features: Any) -> Any:
        """(n, n_features) rows: device rows as they are, host rows as float32 or float16 (widened on the device after
        their upload); (n, K, E) accepted too."""
        cp, c = self.xp, self.cfg
        if features is None:
            return cp.zeros((0, c.n_features), cp.float32)
        if isinstance(features, QG.DeviceRows):      # the GPU target's captured rows: already on the device
            features = features.rows
        elif isinstance(features, HostRows):         # rows in a registered segment: one direct copy up
            features = features.upload(cp)
        f = features
        if not isinstance(f, cp.ndarray):   # host rows: f16 ones stay f16, widened on the device after the upload
            f = np.asarray(f)
            f = f if f.dtype == np.float16 else f.astype(np.float32, copy=False)
        if f.ndim == 3:
            f = f.reshape(f.shape[0], -1)
        if f.ndim != 2 or f.shape[1] != c.n_features:
            raise ValueError(f"features must be (n, {c.n_features}) = (n, {len(c.target_layer_ids)} layers "
                             f"x {c.n_embd}), got shape {tuple(np.shape(features))}")
        return f

    def _append_rows(self, s: GpuDraftSession, feats: Any, s_ctx: Any, positions: Any) -> None:
        """Context K/V of the feature rows into the caches at rows s_ctx[0].. (dflash.append_context's math)."""
        c, eps = self.cfg, self.cfg.rms_eps
        n, kd = int(feats.shape[0]), c.n_head_kv * c.head_dim
        fc = self.fc.matmul(feats)
        # the hidden norm in the one pack every layer's k|v product reads (bit for bit rms_norm, then each product's
        # own pack: one launch instead of 1 + n_layer); above a launch's tokens the products pack their chunks
        ctx = (qm.pack_activations(fc, rms_weight=self.hidden_norm, eps=eps) if n <= qm.MAX_TOKENS
               else nr.rms_norm(fc, self.hidden_norm, eps))
        for i, w in enumerate(self.layers):
            kv = w["attn_kv"].matmul(ctx)
            k, _ = nr.qk_norm_rope(kv[:, :kd].reshape(n, c.n_head_kv, c.head_dim), None, w["attn_k_norm"], None,
                                   positions, c.head_dim, c.rope_theta, eps)
            s.kv[i].store(k, kv[:, kd:].reshape(n, c.n_head_kv, c.head_dim), s_ctx)

    def append_context(self, session: GpuDraftSession, features: Any, start: int) -> None:
        """Append the target features of committed tokens at session.n_ctx.. so that n_ctx becomes start
        (eager launches; draft() appends inside its captured pass instead)."""
        cp = self.xp
        feats = self._features(features)
        n = int(feats.shape[0])
        if session.n_ctx + n != start:
            raise ValueError(f"draft context holds {session.n_ctx} tokens, {n} new feature rows would make "
                             f"{session.n_ctx + n}, but the block starts at position {start}")
        if n == 0:
            return
        session.reserve(start + self.block_size)
        for j in range(0, n, 256):   # chunks bound the scratch of a long prompt
            m = min(256, n - j)
            rows = cp.asarray(feats[j:j + m]).astype(cp.float32, copy=False)
            pos = cp.arange(session.n_ctx + j, session.n_ctx + j + m, dtype=cp.int32)
            self._append_rows(session, rows, session.n_ctx + j, pos)
        session.n_ctx = start

    # -- block ---------------------------------------------------------------------------------------
    def _block_pass(self, s: GpuDraftSession, T: int, n_new: int, s_hint: int, masks: tuple[Any, Any],
                    x0: Any = None) -> Any:
        """Every launch of a pass, reading per-step values only from the session's device buffers: append the
        n_new feature rows in s.feats, then the block of T tokens at s_start. masks: (full layers, sliding
        layers). Returns the final hidden rows."""
        c, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, D = c.n_head, c.n_head_kv, c.head_dim
        if n_new:
            self._append_rows(s, s.feats[:n_new], s.s_ctx, s.ctx_pos(n_new))
        if x0 is not None:
            x = x0
        elif self._host_table:
            x = s.x_in[:T]
        elif self._device_embed:
            x = self.target.device_embed(s.tokens[:T])
        else:
            x = self.be.embed(self.tok_embd, s.tokens[:T])
        pos = s.blk_pos[:T]
        window = c.sliding_window or 0
        # As the target's fused step (qwen35_gpu._block): each norm runs in the pack its products read (bit for bit the
        # norm, then the pack), the residual add in the post-attention norm's pack, SwiGLU in ffn_down's pack, and
        # ffn_down adds into the stream in its epilogue: 4 launches a layer fewer than norm, pack, add one by one
        for i, w in enumerate(self.layers):
            h = qm.pack_activations(x, rms_weight=w["attn_norm"], eps=eps)     # packed once for both products
            q = w["attn_q"].matmul(h).reshape(T, H, D)
            kv = w["attn_kv"].matmul(h)
            k = kv[:, :Hkv * D].reshape(T, Hkv, D)
            v = kv[:, Hkv * D:].reshape(T, Hkv, D)
            q, k = nr.qk_norm_rope(q, k, w["attn_q_norm"], w["attn_k_norm"], pos, D, c.rope_theta, eps)
            cache = s.kv[i]
            cache.store(k, v, s.s_start)          # the block's rows after the context (overwritten next append)
            if c.layer_causal[i]:
                o = att.attention(q, cache, s.s_start, masks[1], s_hint=s_hint, window=window)
            else:
                o = att.attention(q, cache, s.s_start, masks[0], s_hint=s_hint)
            # (a new stream array: layer 0's x, the embedded rows or x0, is only read)
            h = qm.pack_activations(w["attn_output"].matmul(o.reshape(T, H * D)), rms_weight=w["post_attention_norm"],
                                    eps=eps, residual=x)
            x = h.residual
            gu = w["ffn_gate_up"].matmul(h)
            w["ffn_down"].matmul(qm.pack_activations(gu[:, :c.n_ff], silu_up=gu[:, c.n_ff:]), out=x, accumulate=True)
        return x

    def _head(self, x: Any) -> tuple[Any, Any, Any, Any]:
        """(logits, top-k ids, top-k log-probs at temperature 1, both side by side as int32 bits) of hidden
        rows, all on the device (the last for one copy to the host)."""
        cp = self.xp
        logits = self.output.matmul(qm.pack_activations(x, rms_weight=self.output_norm, eps=self.cfg.rms_eps))
        k = min(TOPK, self.n_vocab)
        ids, logp = smp.topk_logprobs(logits, k)
        packed = cp.zeros((int(ids.shape[0]), 2 * TOPK), cp.int32)
        packed[:, :k] = ids
        packed[:, TOPK:TOPK + k] = logp.view(cp.int32)
        return logits, ids, logp, packed

    def _check_ids(self, ids: Any) -> np.ndarray:
        return DFlashDrafter._check_ids(self, ids)

    def _set_step(self, s: GpuDraftSession, start: int, n_new: int, tokens: np.ndarray | None,
                  row0: np.ndarray | None = None) -> None:
        """Write a pass's per-step values (and the block's first embedded row, a host token table) into the
        session's pinned buffer and upload them in one copy."""
        B = self.block_size
        vals = s.h_vals
        vals[0], vals[1] = start - n_new, start
        vals[2:2 + MAX_APPEND] = _ARANGE_APPEND
        vals[2:2 + MAX_APPEND] += start - n_new
        vals[2 + MAX_APPEND:2 + MAX_APPEND + B] = _ARANGE_APPEND[:B]
        vals[2 + MAX_APPEND:2 + MAX_APPEND + B] += start
        vals[2 + MAX_APPEND + B:] = self.mask_token_id
        if tokens is not None:
            vals[2 + MAX_APPEND + B:2 + MAX_APPEND + B + len(tokens)] = tokens
        if row0 is not None:
            s.h_x_in[0] = row0
        s.upload()

    def block_logits(self, session: GpuDraftSession, ids: Any, start: int) -> np.ndarray:
        """Logits (len(ids), n_vocab) of every slot of any block of <= block_size tokens at start.. (eager)."""
        ids = self._check_ids(ids)
        T = len(ids)
        if session.n_ctx != start:
            raise ValueError(f"the block must start right after the draft context ({session.n_ctx} tokens), "
                             f"not at position {start}")
        if T > self.block_size:
            raise ValueError(f"a block has at most {self.block_size} tokens, not {T}")
        cp = self.xp
        session.reserve(start + self.block_size)
        self._set_step(session, start, 0, ids)
        x0 = cp.asarray(self.host_embed(ids)) if self._host_table else None
        masks = (cp.full(T, (1 << T) - 1, dtype=cp.uint64), cp.asarray(att.tree_mask(np.arange(-1, T - 1))))
        x = self._block_pass(session, T, 0, start, masks, x0)
        logits = self.output.matmul(qm.pack_activations(x, rms_weight=self.output_norm, eps=self.cfg.rms_eps))
        return np.asarray(cp.asnumpy(logits), dtype=np.float32)

    def host_embed(self, ids: np.ndarray) -> np.ndarray:
        if self._host_rows is None:
            raise ValueError("the drafter's token table is not kept on the host")
        return self._host_rows(np.asarray(ids))

    def _pass(self, s: GpuDraftSession, features: Any, last_token: int, start: int) -> tuple[Any, Any, Any, Any]:
        """Append + block + head as one graph replay (or eager launches): device (logits, ids, logp, packed)."""
        cp = self.xp
        feats = self._features(features)
        n = int(feats.shape[0])
        if s.n_ctx + n != start:
            raise ValueError(f"draft context holds {s.n_ctx} tokens, {n} new feature rows would make "
                             f"{s.n_ctx + n}, but the block starts at position {start}")
        if not 0 <= int(last_token) < int(self.tok_embd.shape[0]):
            raise ValueError(f"block token ids must be in [0, {int(self.tok_embd.shape[0])})")
        graphs = self.use_graphs and self.graph_blocker is None
        if n > MAX_APPEND or (graphs and n > self.graph_append):
            # a prompt's features, or the rows of a drafter pause's plain steps: eager, then a pass with nothing to
            # append (so the captured passes are the few capture_passes makes at start-up, not one per prompt length)
            self.append_context(s, feats, start)
            n = 0
        B = self.block_size
        s.reserve(start + B)
        row0 = self.host_embed(np.array([last_token]))[0] if self._host_table else None
        self._set_step(s, start, n, np.array([last_token]), row0)
        if n:   # device rows (the GPU target's): a device copy; host rows: an upload
            s.feats[:n] = feats if isinstance(feats, cp.ndarray) else cp.asarray(feats)   # (f16: cast on the device)
        masks = (self._mask_full, self._mask_causal)
        if graphs:
            s_hint = QG._s_bucket(start + B, s.capacity) - B
            out = self._graph_pass(s, (n, s_hint), lambda: self._head(
                self._block_pass(s, B, n, s_hint, masks)[1:]))
        else:
            self.graph_stats["eager"] += 1
            out = self._head(self._block_pass(s, B, n, start, masks)[1:])
        s.n_ctx = start
        return out

    def _graph_pass(self, s: GpuDraftSession, key: tuple, launches: Any) -> tuple[Any, Any, Any, Any]:
        """Replay the session's graph for this shape; without one: eager warm-up (this pass's results), then
        capture (Qwen35GpuModel._graph_step's scheme: measured arena, _GraphHeap, _record)."""
        cp = self.xp
        g = s.graphs.get(key)
        if g is not None:
            g.graph.launch(cp.cuda.get_current_stream())
            g.replays += 1
            self.graph_stats["replays"] += 1
            return g.outputs
        probe = QG._GraphHeap(cp, None)
        with cp.cuda.using_allocator(probe.malloc):
            out = launches()
        try:
            heap = QG.graph_arena(cp).heap_for(probe.peak)
            if self._stream is None:
                self._stream = cp.cuda.Stream(non_blocking=True)
            graph, res = QG._record(self._stream, heap, launches)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from here on, and say why
            if is_out_of_memory(e):   # no memory for the arena: this request fails, graphs stay on
                raise
            self.use_graphs = False
            self.graph_blocker = f"capture failed: {type(e).__name__}: {e}"
            self.graph_stats["failed"] += 1
            warnings.warn(f"CUDA graphs off for the drafter: {self.graph_blocker}", RuntimeWarning, stacklevel=3)
            return out
        while len(s.graphs) >= GRAPHS_PER_SESSION:
            s.graphs.pop(next(iter(s.graphs)))
        s.graphs[key] = _DraftGraph(graph=graph, outputs=res)
        self.graph_stats["captures"] += 1
        return out

    def draft(self, session: GpuDraftSession, new_features: Any, last_token: int, start: int) -> np.ndarray:
        """DFlashDrafter.draft: float32 host logits (block_size - 1, n_vocab) of positions start+1 ..
        (the whole rows come back: tests and tools; the speculative loop uses draft_topk)."""
        logits = self._pass(session, new_features, last_token, start)[0]
        return np.asarray(self.xp.asnumpy(logits), dtype=np.float32)

    def draft_topk(self, session: GpuDraftSession, new_features: Any, last_token: int, start: int,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
        """draft() followed by ddtree.topk_logprobs(logits, k), with only the (block_size - 1, k) ids (int64) and
        log-probabilities (float64) coming back to the host."""
        return self.draft_topk_begin(session, new_features, last_token, start, k)()

    def draft_topk_begin(self, session: GpuDraftSession, new_features: Any, last_token: int, start: int,
                         k: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """draft_topk in two halves: the pass and the top-k's copy into the session's pinned buffer are queued on
        the stream now (so work queued after them, the target's commit, runs while the host waits for this
        pass alone); the returned callable waits for the copy and gives draft_topk's answer."""
        if not 1 <= k <= TOPK:
            raise ValueError(f"k must be in 1..{TOPK}, not {k}")
        cp = self.xp
        packed = self._pass(session, new_features, last_token, start)[3]
        top = session.h_top
        if packed.shape != top.shape or packed.dtype != top.dtype or not packed.flags.c_contiguous:
            raise AssertionError(f"top-k rows {packed.shape} {packed.dtype} do not fit {top.shape} {top.dtype}")
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(top.ctypes.data, packed.data.ptr, top.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        done = stream.record()

        def fetch() -> tuple[np.ndarray, np.ndarray]:
            done.synchronize()
            return top[:, :k].astype(np.int64), top[:, TOPK:TOPK + k].view(np.float32).astype(np.float64)

        return fetch


class GpuProposer:
    """speculative.LocalProposer for a DFlashGpuDrafter: the top-k come from the device (draft_topk). Its
    session comes from the drafter's pool at the first propose() or append_features() (inside the engine's step,
    so under the verifier's engine lock: a new session's allocations and uploads never meet another thread's
    capture) and goes back on close()."""

    def __init__(self, drafter: DFlashGpuDrafter):
        self.drafter = drafter
        self.session: GpuDraftSession | None = None
        self._pending: Callable[[], Any] | None = None   # the last propose_begin's wait, until it is asked for
        self.closed = False
        self.block_size = drafter.block_size
        self.target_layer_ids = list(drafter.target_layer_ids)

    def propose(self, new_features: Any, last_token: int, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.propose_begin(new_features, last_token, start, k)()

    def append_features(self, new_features: Any, start: int) -> None:
        """speculative's prompt appends: committed tokens' features (a GPU target's stay on the device) into the
        session's context now, eagerly, ahead of the next propose."""
        if self.closed:
            raise RuntimeError("append_features() on a closed proposer")
        if self.session is None:
            self.session = self.drafter.acquire_session()
        self.drafter.append_context(self.session, new_features, int(start))

    def propose_begin(self, new_features: Any, last_token: int, start: int,
                      k: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """speculative.begin_propose: the pass queued now, its top-k waited for by the returned callable."""
        if self.closed:
            raise RuntimeError("propose() on a closed proposer")
        if self.session is None:
            self.session = self.drafter.acquire_session()
        fetch = self.drafter.draft_topk_begin(self.session, new_features, int(last_token), int(start), int(k))
        self._pending = fetch

        def result() -> tuple[np.ndarray, np.ndarray]:
            self._pending = None
            return fetch()

        return result

    def close(self) -> None:
        self.closed = True
        pending, self._pending = self._pending, None
        s, self.session = self.session, None
        try:
            if pending is not None:   # a request ended with a pass in flight: its session goes back to the pool idle
                pending()
        finally:
            if s is not None:   # closed twice (the engine, then the service): returned once
                self.drafter.release_session(s)


def load_gpu_drafter(path: str, target: Any, device: int | None = None) -> DFlashGpuDrafter:
    """models.dflash.load_drafter for the GPU: the drafter on cuda:`device` (default: the target's device)."""
    cfg, tensors, source = read_drafter(path, target.cfg.n_layer)
    tbe = getattr(target, "be", None)
    if device is None:
        device = tbe.device if isinstance(tbe, CupyBackend) else 0
    be = tbe if isinstance(tbe, CupyBackend) and tbe.device == int(device) else CupyBackend(int(device))
    return DFlashGpuDrafter(cfg, tensors, target, be, source=source)
