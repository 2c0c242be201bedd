"""The Drafter gRPC service: a DFlash drafter that proposes per-position top-k for the next block.

Each `Draft` bidi stream is one request's session (its projected context K/V live as long as the stream);
each DraftRequest appends the newly committed tokens' target features and drafts one block. Features come
inline (bytes) or through a POSIX shared-memory segment the client owns (same host); see FeatureReader.
The drafter runs on the CPU (NumPy) or on a GPU of its own (`--device cuda:N`): there its sessions are planned
and made at start-up (memory_plan.plan_drafter_service), so a stream never allocates a context cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from services import rpc, telemetry
from services.engine.ddtree import topk_logprobs
from services.engine.pinned import HostRows
from services.wire import pb, pb_grpc

log = logging.getLogger("specsplit.drafter")
tracer = telemetry.get_tracer("specsplit.drafter")

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
MAX_TOP_K = 256
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class BadRequest(ValueError):
    """A request the drafter refuses (INVALID_ARGUMENT); the message names the field and what was wrong."""


class ContextFull(ValueError):
    """A request past the context the drafter's sessions were made for (RESOURCE_EXHAUSTED)."""


class SharedMemoryError(BadRequest):
    """A shared-memory segment named by the client cannot be read here (another host or IPC namespace?)."""


# ---------------------------------------------------------------------------------------------------
# features transport


def _shm_open_readonly(name: str) -> mmap.mmap:
    """Map a POSIX shared-memory segment read-only.

    Not multiprocessing.shared_memory: before Python 3.13 attaching registers the segment with this
    process's resource tracker, which then unlinks the client's segment when the drafter exits; it also
    only maps read-write.
    """
    import _posixshmem  # CPython's shm_open, the call multiprocessing.shared_memory itself makes

    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


class FeatureReader:
    """Decodes one stream's Features messages; keeps the client's shared-memory segment mapped between
    requests (the client reuses one segment per stream and only switches to a new one to grow)."""

    def __init__(self, width: int, keep_f16: bool = False, pin: Callable[[mmap.mmap], Any] | None = None):
        self.width = width
        self.keep_f16 = keep_f16      # f16 rows stay f16 (a GPU drafter widens them on the device)
        # a GPU drafter's registration of a mapping with CUDA (its pin_host_rows): rows then go to it in place
        # (HostRows, one direct copy to the device) instead of copied out here; None, or a refusal: copies
        self._pin_fn = pin
        self._pin: Any = None
        self._shm_name: str | None = None
        self._shm: mmap.mmap | None = None

    def read(self, f: pb.Features) -> np.ndarray | HostRows | None:
        """(rows, width) float32 copy of the features (f16 ones as float16 with keep_f16), or None for no rows; rows in
        a registered segment come as HostRows in the wire dtype, valid until the next read. Raises BadRequest."""
        if f.rows < 0:
            raise BadRequest(f"features.rows must be >= 0, got {f.rows}")
        if f.rows == 0:
            return None
        if f.width != self.width:
            raise BadRequest(f"features.width is {f.width} but this drafter takes {self.width} values per token "
                             "(its target layers x hidden size)")
        dtype = DTYPES.get(f.dtype)
        if dtype is None:
            raise BadRequest(f"features.dtype must be one of {sorted(DTYPES)}, got {f.dtype!r}")
        nbytes = f.rows * f.width * dtype.itemsize
        if f.shm_name and f.data:
            raise BadRequest("features carry both inline data and a shared-memory name; send one")
        if f.shm_name:
            buf = self._segment(f.shm_name)
            if f.shm_offset < 0 or f.shm_offset + nbytes > len(buf):
                raise BadRequest(f"features need bytes [{f.shm_offset}, {f.shm_offset + nbytes}) of shared memory "
                                 f"{f.shm_name!r}, which holds {len(buf)} bytes")
            if self._pin is not None:
                return HostRows(self._pin, f.shm_offset, f.rows, f.width, dtype)
            view = np.frombuffer(buf, dtype=dtype, count=f.rows * f.width, offset=f.shm_offset)
            # Copy out first (the client rewrites the segment next step), then widen: converting straight
            # out of the shared mapping measured ~1.6x slower than from private memory.
            out = view.copy()
            del view                           # release the export so the mapping can close later
        else:
            if len(f.data) != nbytes:
                raise BadRequest(f"features.data holds {len(f.data)} bytes; {f.rows} rows x {f.width} {f.dtype} "
                                 f"need {nbytes}")
            out = np.frombuffer(f.data, dtype=dtype)     # read-only view of the message's bytes
        if not (self.keep_f16 and dtype == np.float16):
            out = out.astype(np.float32, copy=False)
        return out.reshape(f.rows, f.width)

    def _segment(self, name: str) -> mmap.mmap:
        if name == self._shm_name and self._shm is not None:
            return self._shm
        if not _SHM_NAME.match(name):
            raise BadRequest(f"features.shm_name {name!r} is not a shared-memory segment name")
        self.close()
        try:
            self._shm = _shm_open_readonly(name)
        except (OSError, ValueError) as e:
            raise SharedMemoryError(f"cannot map shared memory {name!r} ({e}); the drafter must be on the "
                                    "client's host and IPC namespace, else send features inline") from e
        self._shm_name = name
        if self._pin_fn is not None:
            self._pin = self._pin_fn(self._shm)
        return self._shm

    def close(self) -> None:
        pin, self._pin = self._pin, None
        if pin is not None:         # unregistered before it is unmapped
            pin.release()
        if self._shm is not None:
            self._shm.close()
        self._shm, self._shm_name = None, None


# ---------------------------------------------------------------------------------------------------
# servicer


@dataclass
class DrafterStats:
    streams: int = 0
    drafts: int = 0
    appends: int = 0
    rejected_busy: int = 0
    invalid: int = 0


class DrafterServicer(pb_grpc.DrafterServicer):
    """Serves one loaded DFlashDrafter to at most `max_sessions` concurrent Draft streams."""

    def __init__(self, max_sessions: int = 16, executor: concurrent.futures.Executor | None = None,
                 backend: str = "numpy"):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.backend = backend
        self.device_top_k = 0                # largest top_k a GPU drafter computes on the device (attach)
        self.drafter: Any = None             # set by attach() once loaded
        self.active = 0
        self.stats = DrafterStats()
        # One thread: drafting is array math (NumPy's BLAS is multi-threaded already; a GPU backend runs
        # one stream). Off the event loop so health checks and cancellations stay prompt.
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drafter")
        # A GPU drafter's draft (~1-2 ms, mostly waiting on the device) runs on the event loop itself when nothing else
        # is drafting: the two thread hops to the executor and back cost ~0.2 ms a step on an H200 host. The lock keeps
        # one caller in the drafter at a time (a long prompt append on the executor meanwhile sends drafts there too).
        self.inline_drafts = False
        self._drafting = threading.Lock()

    def attach(self, drafter: Any) -> None:
        """Serve `drafter` (called on the event loop: a GPU drafter's device becomes the loop thread's, for its inline
        drafts)."""
        if hasattr(drafter, "draft_topk"):
            from services.engine.models.dflash_gpu import TOPK

            self.device_top_k = TOPK
        use_device = getattr(drafter, "use_device", None)
        if use_device is not None:
            use_device()
            self.inline_drafts = True
        self.drafter = drafter
        self.n_rows = int(drafter.target.tok_embd.shape[0])
        self.n_features = len(drafter.target_layer_ids) * int(drafter.cfg.n_embd)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.DrafterInfo:
        d = self.drafter
        if d is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading its model")
        return pb.DrafterInfo(block_size=d.block_size, target_layer_ids=list(d.target_layer_ids),
                              mask_token_id=d.mask_token_id, hidden_size=int(d.cfg.n_embd), n_vocab=d.n_vocab,
                              max_sessions=self.max_sessions, active_sessions=self.active, backend=self.backend,
                              appends=True)

    def _open(self) -> Any:
        """A session for a new stream: a pooled one (made at start-up) for a GPU drafter, else a new one."""
        acquire = getattr(self.drafter, "acquire_session", None)
        return acquire() if acquire is not None else self.drafter.new_session()

    def _close(self, session: Any) -> None:
        release = getattr(self.drafter, "release_session", None)
        if release is not None and session is not None:
            release(session)

    def _check(self, req: pb.DraftRequest, session: Any, feats: np.ndarray | None) -> None:
        max_rows = getattr(self.drafter, "max_rows", None)
        if max_rows is not None and req.start + self.drafter.block_size > max_rows:
            raise ContextFull(f"start {req.start} + a block of {self.drafter.block_size} is past the "
                              f"{max_rows - self.drafter.block_size}-token context the drafter's sessions were made "
                              "for (its --max-ctx); the rest of this request decodes without drafting")
        rows = 0 if feats is None else len(feats)
        if session.n_ctx + rows != req.start:
            raise BadRequest(f"start is {req.start} but this stream's context holds {session.n_ctx} tokens and "
                             f"the request adds {rows} feature rows (start must be {session.n_ctx + rows})")
        if req.top_k == 0:          # an append: features only
            if rows == 0:
                raise BadRequest("an append (top_k 0) carries no feature rows")
            return
        if not 0 <= req.last_token < self.n_rows:
            raise BadRequest(f"last_token {req.last_token} is outside the vocabulary [0, {self.n_rows})")
        if not 1 <= req.top_k <= MAX_TOP_K:
            raise BadRequest(f"top_k must be 0 (an append) or in 1..{MAX_TOP_K}, got {req.top_k}")

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._drafting:
            return fn(*args)

    async def _call(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        """fn(*args) in the drafter, one caller at a time: on the loop when `inline` and the drafter is free, else on
        the drafting thread."""
        if inline and self._drafting.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self._drafting.release()
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._locked, fn, *args)

    def _append(self, session: Any, feats: np.ndarray, req: pb.DraftRequest) -> pb.DraftResponse:
        t0 = time.perf_counter()
        self.drafter.append_context(session, feats, int(req.start))
        return pb.DraftResponse(positions=0, top_k=0, draft_ms=(time.perf_counter() - t0) * 1e3)

    def _draft(self, session: Any, feats: np.ndarray | None, req: pb.DraftRequest) -> pb.DraftResponse:
        t0 = time.perf_counter()
        k = int(req.top_k)
        if hasattr(self.drafter, "draft_topk") and k <= self.device_top_k:   # the top-k from the device
            ids, logp = self.drafter.draft_topk(session, feats, int(req.last_token), int(req.start), k)
        else:
            logits = self.drafter.draft(session, feats, int(req.last_token), int(req.start))
            ids, logp = topk_logprobs(logits, k)
        return pb.DraftResponse(positions=ids.shape[0], top_k=ids.shape[1], token_ids=ids.reshape(-1).tolist(),
                                logprobs=logp.reshape(-1).tolist(), draft_ms=(time.perf_counter() - t0) * 1e3)

    async def Draft(self, request_iterator: AsyncIterator[pb.DraftRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DraftResponse]:
        # Streaming handlers end with a status and return: context.abort() from inside a response generator
        # races the client's writes and sometimes reaches the client as INTERNAL instead of the real code.
        if self.drafter is None:
            await _take_first(request_iterator)
            _end(context, grpc.StatusCode.UNAVAILABLE, "the drafter is still loading its model")
            return
        if self.active >= self.max_sessions:
            self.stats.rejected_busy += 1
            await _take_first(request_iterator)
            _end(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"the drafter is serving its maximum of {self.max_sessions} sessions; retry later "
                 "or decode without drafting")
            return
        self.active += 1
        self.stats.streams += 1
        session = None
        reader = FeatureReader(self.n_features, keep_f16=getattr(self.drafter, "takes_f16_features", False),
                               pin=getattr(self.drafter, "pin_host_rows", None))
        n = 0
        try:
            # on the drafting thread: a GPU drafter's device is that thread's current one
            session = await self._call(self._open)
            with telemetry.server_span(tracer, "drafter.session", context) as span:
                async for req in request_iterator:
                    try:
                        feats = reader.read(req.features) if req.HasField("features") else None
                        self._check(req, session, feats)
                    except SharedMemoryError as e:
                        # Not the request's fault: this drafter cannot see the client's memory. A distinct
                        # code lets the client switch to inline features for its next streams.
                        span.set_attribute("error.type", "shared_memory")
                        _end(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
                        return
                    except BadRequest as e:
                        self.stats.invalid += 1
                        span.set_attribute("error.type", "invalid_argument")
                        _end(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                        return
                    except ContextFull as e:
                        span.set_attribute("error.type", "context_full")
                        _end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                        return
                    if req.top_k == 0:
                        with tracer.start_as_current_span("drafter.append", attributes={
                                "spec.draft.start": req.start, "spec.draft.rows": len(feats)}):
                            resp = await self._call(self._append, session, feats, req)
                        self.stats.appends += 1
                        yield resp
                        continue
                    with tracer.start_as_current_span("drafter.draft", attributes={
                            "spec.draft.start": req.start, "spec.draft.rows": 0 if feats is None else len(feats),
                            "spec.draft.top_k": req.top_k}):
                        resp = await self._call(self._draft, session, feats, req, inline=self.inline_drafts)
                    n += 1
                    self.stats.drafts += 1
                    yield resp
                span.set_attribute("spec.drafts", n)
        finally:
            # Also runs when the client cancels (the handler task is cancelled): the session goes at once (back to
            # a GPU drafter's pool: bookkeeping only, safe from this thread).
            self.active -= 1
            reader.close()
            self._close(session)
            session = None


async def _take_first(request_iterator: AsyncIterator[pb.DraftRequest], timeout: float = 5.0) -> None:
    """Receive the client's first message before refusing the stream: a status sent while that write is
    still in flight makes grpc-core fail the write and report INTERNAL to the client instead."""
    try:
        await asyncio.wait_for(anext(aiter(request_iterator)), timeout)
    except (StopAsyncIteration, asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
        pass


def _end(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    context.set_code(code)
    context.set_details(details)


# ---------------------------------------------------------------------------------------------------
# server


@dataclass
class DrafterConfig:
    model: str                  # the target (GGUF or HF folder): only its embedding and lm head are used
    draft: str                  # the DFlash drafter (z-lab folder or GGUF)
    max_sessions: int = 16
    trace: str = "none"
    shutdown_grace_s: float = 5.0
    device: str = "cpu"         # cpu or cuda:N (a GPU of its own: the verifier may be on another one)
    max_ctx: int | None = None  # GPU: context rows per session (None: the target's, shrunk to fit)


def load(cfg: DrafterConfig) -> Any:
    """Load the target's token table and LM head (not its blocks) and the drafter; draft once as a warm-up. On a GPU the
    memory plan comes first (headers only: a refusal names --max-ctx / --max-sessions before anything loads), then
    every session and the graph arena are made, each session's passes captured and a prompt's appends run once (so
    no stream builds a kernel or, in the first context bucket, captures a pass)."""
    from services.engine.loader import load_target_head
    from services.engine.models.dflash import load_drafter
    from services.engine.placement import is_gpu

    t0 = time.perf_counter()
    plan = None
    if is_gpu(cfg.device):
        from services.engine import memory_plan as mp

        plan, _ = mp.plan_drafter_service(cfg.model, cfg.draft, mp.parse_device(cfg.device), cfg.max_sessions,
                                          cfg.max_ctx)
        if plan.shrunk_from:
            log.warning("max_ctx shrunk from %d to %d to fit %s (set --max-ctx to choose)", plan.shrunk_from,
                        plan.settings.max_ctx, cfg.device)
        log.info("%s", plan.summary())
        for w in plan.warnings:
            log.warning("memory plan: %s", w)
    # only the target's token table and LM head: on a GPU the head as stored (quantized, as the plan counts it)
    target = load_target_head(cfg.model, packed=plan is not None)
    if plan is not None:
        from services.engine.models.dflash_gpu import load_gpu_drafter
        from services.engine.models.qwen35_gpu import graph_arena

        drafter = load_gpu_drafter(cfg.draft, target, mp.parse_device(cfg.device).index)
        drafter.reserve_sessions(cfg.max_sessions, plan.settings.max_ctx)
        graph_arena(drafter.xp).reserve(plan.devices[0].get("graph arena"), exact=True)
    else:
        drafter = load_drafter(cfg.draft, target)
    t1 = time.perf_counter()
    width = len(drafter.target_layer_ids) * int(drafter.cfg.n_embd)
    if plan is not None:    # every pooled session's passes of a step's appends, captured before the first stream
        n = drafter.capture_passes()
        built = drafter.warm_appends()
        log.info("drafter: %d pass graphs captured on %d session(s), %d kernels fetched for prompt appends", n,
                 cfg.max_sessions, built)
        if not n:           # graphs off: one eager pass builds the kernels
            s = drafter.acquire_session()
            drafter.draft_topk(s, np.zeros((1, width), np.float32), 0, 1, 1)
            drafter.release_session(s)
    else:
        drafter.draft(drafter.new_session(), np.zeros((1, width), np.float32), 0, 1)
    log.info("drafter %s for %s loaded in %.0f ms (block %d, target layers %s), warm-up %.0f ms", cfg.draft,
             cfg.model, (t1 - t0) * 1e3, drafter.block_size, drafter.target_layer_ids,
             (time.perf_counter() - t1) * 1e3)
    return drafter


class DrafterServer:
    """A running drafter: the gRPC server is up (liveness) at once, readiness once the model is loaded."""

    def __init__(self, running: rpc.RunningServer, servicer: DrafterServicer, loading: asyncio.Task):
        self.running = running
        self.servicer = servicer
        self.loading = loading

    @property
    def address(self) -> rpc.Address:
        return self.running.address

    async def wait_loaded(self) -> None:
        await self.loading

    async def stop(self, grace: float | None = 5.0) -> None:
        self.loading.cancel()
        await self.running.stop(grace)
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)

    async def wait_for_termination(self) -> None:
        await self.running.wait_for_termination()


async def serve_drafter(cfg: DrafterConfig, listen: str, drafter: Any = None) -> DrafterServer:
    """Start serving on `listen`; load (unless `drafter` is given) in the background, then turn ready.

    Await `server.wait_loaded()` to know the load worked (it raises what the load raised).
    """
    servicer = DrafterServicer(max_sessions=cfg.max_sessions)
    running = await rpc.start_server([(pb_grpc.add_DrafterServicer_to_server, servicer)], listen,
                                     [rpc.SERVICE_DRAFTER])
    loop = asyncio.get_running_loop()

    async def load_then_ready() -> None:
        d = drafter if drafter is not None else await loop.run_in_executor(servicer.executor, load, cfg)
        servicer.backend = cfg.device if getattr(getattr(d, "be", None), "name", "numpy") == "cuda" else "numpy"
        servicer.attach(d)
        await running.set_ready(rpc.SERVICE_DRAFTER)
        log.info("drafter ready on %s (max %d sessions)", running.address, cfg.max_sessions)

    return DrafterServer(running, servicer, loop.create_task(load_then_ready()))
