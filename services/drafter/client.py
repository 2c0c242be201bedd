"""Client of the Drafter service: a Proposer (services.engine.speculative) backed by one Draft stream.

The verifier calls propose() synchronously from its worker threads. Every DrafterClient of one address
shares a connection: one grpc.aio channel driven by a private event-loop thread, so making a client per
request costs a stream, not a channel. Any failure (drafter gone, timeout, refusal) raises
DrafterUnavailableError, which the engine answers with plain decoding.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import secrets
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, TypeVar

import grpc
import numpy as np
from opentelemetry import context as otel_context

from services import rpc, telemetry
from services.engine.pinned import pin_host
from services.engine.speculative import DrafterUnavailableError
from services.wire import pb, pb_grpc

log = logging.getLogger("specsplit.drafter.client")

DEFAULT_TIMEOUT_S = 30.0
# shared-memory segments a connection keeps for its next streams when theirs end (a new segment of a prompt
# append's 25 MiB is made and faulted in again per request otherwise), each at most SEGMENT_KEEP_BYTES
SEGMENT_POOL = 8
SEGMENT_KEEP_BYTES = 64 << 20
TRANSPORTS = ("auto", "inline", "shm")
FEATURE_DTYPES = {"f32": np.float32, "f16": np.float16}
# `--draft-features`: a dtype, or auto (f16 where features cross a network inline, f32 through shared memory)
FEATURE_CHOICES = ("auto", *FEATURE_DTYPES)
F16_MAX = float(np.finfo(np.float16).max)   # 65504: f16 saturates here instead of becoming infinite
_T = TypeVar("_T")


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter service reports about itself (Info)."""

    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    hidden_size: int
    n_vocab: int
    max_sessions: int
    active_sessions: int
    backend: str
    appends: bool = False       # takes appends (DraftRequest.top_k 0): a prompt's features as its chunks commit

    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


# ---------------------------------------------------------------------------------------------------
# shared connections


class DrafterConnection:
    """A channel to one drafter address, driven by its own event-loop thread; shared by DrafterClients."""

    def __init__(self, address: str):
        self.address = rpc.parse_address(address)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"drafter-client {address}",
                                        daemon=True)
        self._thread.start()
        self._info: DrafterInfo | None = None
        self._info_lock = threading.Lock()
        self.closed = False
        # False once the drafter said it cannot map our shared memory (another host or IPC namespace
        # behind a shared unix socket): "auto" clients then send features inline.
        self.shm_usable = True
        self._segments: list[_Segment] = []     # idle ones, for the next streams (take_segment / give_segment)
        self._segments_lock = threading.Lock()

        async def make() -> tuple[grpc.aio.Channel, pb_grpc.DrafterStub]:
            # grpc.aio objects belong to the loop they were made on: make the channel on ours.
            ch = rpc.open_channel(self.address)
            return ch, pb_grpc.DrafterStub(ch)

        self.channel, self.stub = self.run(make())

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run `coro` on the connection's loop and wait for it from this (other) thread."""
        return self.wait(self.submit(coro), timeout)

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Start `coro` on the connection's loop; wait() waits for it."""
        if self.closed:
            coro.close()
            raise DrafterUnavailableError(f"drafter connection to {self.address} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @staticmethod
    def wait(fut: concurrent.futures.Future[_T], timeout: float | None = None) -> _T:
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def info(self, timeout: float = DEFAULT_TIMEOUT_S, refresh: bool = False) -> DrafterInfo:
        """The drafter's Info, fetched once per connection (again after `forget_info`, or with refresh)."""
        with self._info_lock:
            if self._info is None or refresh:
                async def fetch() -> pb.DrafterInfo:
                    return await self.stub.Info(pb.InfoRequest(), timeout=timeout)

                try:
                    r = self.run(fetch(), timeout + 5.0)
                except grpc.aio.AioRpcError as e:
                    raise DrafterUnavailableError(
                        f"drafter {self.address}: Info failed: {e.code().name}: {e.details()}") from None
                except TimeoutError:
                    raise DrafterUnavailableError(f"drafter {self.address}: Info timed out after {timeout} s") \
                        from None
                self._info = DrafterInfo(block_size=r.block_size, target_layer_ids=list(r.target_layer_ids),
                                         mask_token_id=r.mask_token_id, hidden_size=r.hidden_size,
                                         n_vocab=r.n_vocab, max_sessions=r.max_sessions,
                                         active_sessions=r.active_sessions, backend=r.backend,
                                         appends=r.appends)
            return self._info

    def forget_info(self) -> None:
        # After a failure the drafter may come back as another model: ask again next time.
        self._info = None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the drafter's health says SERVING (timeout None: forever, logging progress)."""
        try:
            self.run(rpc.wait_ready(self.channel, rpc.SERVICE_DRAFTER, timeout=timeout,
                                    what=f"drafter {self.address}"))
        except (TimeoutError, RuntimeError) as e:
            raise DrafterUnavailableError(str(e)) from None

    def take_segment(self) -> _Segment:
        """A shared-memory segment for a new stream: an idle one of an ended stream, else a new (empty) one."""
        with self._segments_lock:
            return self._segments.pop() if self._segments else _Segment()

    def give_segment(self, seg: _Segment) -> None:
        """An ended stream's segment: kept for the next stream (up to SEGMENT_POOL of at most SEGMENT_KEEP_BYTES),
        else unlinked. Only a stream whose exchanges were all answered gives one back: the drafter has read it."""
        with self._segments_lock:
            if (not self.closed and seg.shm is not None and seg.shm.size <= SEGMENT_KEEP_BYTES
                    and len(self._segments) < SEGMENT_POOL):
                self._segments.append(seg)
                return
        seg.close()

    def close(self) -> None:
        if self.closed:
            return
        with self._segments_lock:
            idle, self._segments = self._segments, []
        for seg in idle:
            seg.close()
        try:
            self.run(self.channel.close(), 5.0)
        except Exception:               # the loop may already be gone at interpreter exit
            pass
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


_connections: dict[str, DrafterConnection] = {}
_connections_lock = threading.Lock()


def connection(address: str) -> DrafterConnection:
    """The shared connection to `address` (made on first use)."""
    key = rpc.parse_address(address).target
    with _connections_lock:
        conn = _connections.get(key)
        if conn is None or conn.closed:
            conn = _connections[key] = DrafterConnection(address)
        return conn


@atexit.register
def close_connections() -> None:
    """Close every shared connection (at exit; tests that want a clean slate)."""
    with _connections_lock:
        conns = list(_connections.values())
        _connections.clear()
    for c in conns:
        c.close()


# ---------------------------------------------------------------------------------------------------
# the proposer


class _Segment:
    """A stream's shared-memory segment: reused every step, replaced by a bigger one (twice the size at least)
    when a step needs more room; kept by the connection for the next stream when this one ends (give_segment).
    Device rows (a GPU target's) are written by the device itself: the segment is registered with CUDA on their
    first write (pinned.pin_host) and released before it is unmapped. Unlinked on close (and by a finalizer if it is
    dropped unclosed)."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self._pins: list[Any] = []          # this segment's registration, if any (shared with its finalizer)
        self._pin_refused = False           # registration failed once: device rows come through the host copy
        self._finalizer: weakref.finalize | None = None

    def _room(self, nbytes: int) -> shared_memory.SharedMemory:
        if self.shm is None or self.shm.size < nbytes:
            size = max(nbytes, 2 * (self.shm.size if self.shm else 0), 1 << 16)
            self.close()
            self.shm = shared_memory.SharedMemory(name=f"specsplit-{secrets.token_hex(8)}", create=True, size=size)
            self._pins = []
            self._finalizer = weakref.finalize(self, _unlink, self.shm, self._pins)
        return self.shm

    def write(self, a: np.ndarray) -> str:
        shm = self._room(a.nbytes)
        dst = np.ndarray(a.shape, dtype=a.dtype, buffer=shm.buf)
        dst[...] = a
        del dst                     # a live view would make shm.close() fail
        return shm.name

    def write_device(self, features: Any, dtype: Any) -> str | None:
        """Device rows (with copy_into) straight into the segment as (rows, width) `dtype`; None when the segment
        cannot be registered (the caller copies through the host instead)."""
        if self._pin_refused:
            return None
        rows = int(features.shape[0])
        width = int(np.prod(features.shape[1:]))
        dtype = np.dtype(dtype)
        shm = self._room(rows * width * dtype.itemsize)
        if not self._pins:
            pin = pin_host(shm.buf)
            if pin is None:
                self._pin_refused = True
                return None
            self._pins.append(pin)
        dst = np.ndarray((rows, width), dtype=dtype, buffer=shm.buf)
        try:
            features.copy_into(dst)
        finally:
            del dst
        return shm.name

    @property
    def pinned(self) -> bool:
        return bool(self._pins)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.shm, self._finalizer, self._pins = None, None, []


def wire_array(features: Any, name: str) -> np.ndarray:
    """(rows, width) contiguous host array of `features` in wire dtype `name`. f16 saturates at +-F16_MAX (numpy's
    cast would make an infinity the drafter cannot use); features that live on a device and can cast there
    (`to_host`, the GPU engine's captured rows) are cast before they are copied, so half the bytes leave it."""
    dtype = FEATURE_DTYPES[name]
    if hasattr(features, "to_host"):
        a = features.to_host(dtype)
    elif dtype == np.float16:
        a = np.asarray(features)
        if a.dtype != np.float16:
            a = np.clip(np.asarray(a, dtype=np.float32), -F16_MAX, F16_MAX).astype(np.float16)
    else:
        a = np.asarray(features, dtype=dtype)
    return np.ascontiguousarray(a.reshape(a.shape[0], -1), dtype=dtype)


def _unlink(shm: shared_memory.SharedMemory, pins: list[Any]) -> None:
    for pin in pins:                # unregistered before it is unmapped
        pin.release()
    try:
        shm.close()
        shm.unlink()
    except (FileNotFoundError, BufferError):
        pass


class DrafterClient:
    """One request's drafting over a Draft stream (the engine's Proposer protocol).

    address: a drafter address (`unix:///...`, `host:port`, `inproc:NAME`). transport: how features
    travel: "inline" (bytes in the message), "shm" (a shared-memory segment this client owns; same host
    only) or "auto" (shm for unix and inproc addresses, inline otherwise, and inline from then on if the
    drafter once answers that it cannot map this host's shared memory). feature_dtype: "f32" or "f16"
    on the wire, or "auto": f16 inline (half the bytes on a network; the drafter sees features rounded to
    f16, whose 11 significant bits are more than the bf16 ring the reference DFlash implementations keep),
    f32 through shared memory (exact, and there a copy costs less than a conversion); None: f16 arrays stay
    f16, anything else goes as f32. f16 saturates at +-65504 (a massive activation stays finite; a device's
    features are cast there, so half the bytes leave it). timeout: seconds each propose()
    (and Info) may take. wait_ready: block in the constructor until the drafter is ready (ready_timeout
    seconds, None = forever) and fetch its Info, raising DrafterUnavailableError if that fails; without
    it nothing is contacted until first use.

    block_size and target_layer_ids come from the drafter's Info, fetched on first access. If it cannot be
    fetched they read 16 and [] and the client is failed: the next propose() raises
    DrafterUnavailableError with the reason (so the engine falls back), as does info().
    The trace context current when the client is made travels with the stream.
    """

    def __init__(self, address: str, transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 wait_ready: bool = False, ready_timeout: float | None = None, feature_dtype: str | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if feature_dtype is not None and feature_dtype not in FEATURE_CHOICES:
            raise ValueError(f"feature_dtype must be one of {', '.join(FEATURE_CHOICES)} or None, got "
                             f"{feature_dtype!r}")
        addr = rpc.parse_address(address)
        if transport == "shm" and not addr.is_local:
            raise ValueError(f"transport 'shm' needs a drafter on this host (unix:// or inproc), not {address}")
        self.address = address
        self._conn = connection(address)
        self._auto = transport == "auto"
        if self._auto:
            transport = "shm" if addr.is_local and self._conn.shm_usable else "inline"
        self.transport = transport
        self.timeout = float(timeout)
        if feature_dtype == "auto":
            feature_dtype = "f32" if transport == "shm" else "f16"
        self.feature_dtype = feature_dtype
        self._trace_context = otel_context.get_current()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._segment = self._conn.take_segment() if self.transport == "shm" else None
        self._failed: str | None = None
        self._closed = False
        # the last append's exchange, answered before the next exchange starts (one at a time on the stream, and
        # the shared-memory segment is not rewritten before the drafter has read it)
        self._appending: concurrent.futures.Future[pb.DraftResponse] | None = None
        self._held: np.ndarray | None = None      # features for the next draft (a drafter without appends)
        # the drafter's own time for the last draft answered (DraftResponse.draft_ms): the rest of a propose()
        # is the features' trip, the exchange and the answer's (bench/decode.py --drafter-service reports both)
        self.last_draft_ms = 0.0
        if wait_ready:
            self._conn.wait_ready(ready_timeout)
            self._conn.info(self.timeout)

    # -- Info ----------------------------------------------------------------------------------------
    def info(self) -> DrafterInfo:
        """The drafter's Info (cached per connection). Raises DrafterUnavailableError."""
        if self._failed:
            raise DrafterUnavailableError(self._failed)
        try:
            return self._conn.info(self.timeout)
        except DrafterUnavailableError as e:
            self._fail(str(e))
            raise

    def _info_or_none(self) -> DrafterInfo | None:
        try:
            return self.info()
        except DrafterUnavailableError:
            return None

    @property
    def block_size(self) -> int:
        i = self._info_or_none()
        return i.block_size if i is not None else 16

    @property
    def target_layer_ids(self) -> list[int]:
        i = self._info_or_none()
        return list(i.target_layer_ids) if i is not None else []

    # -- drafting ------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> DrafterUnavailableError:
        if self._failed is None:
            self._failed = reason
            log.warning("%s", reason)
            self._conn.forget_info()
        return DrafterUnavailableError(self._failed)

    def _features(self, new_features: np.ndarray | None) -> pb.Features | None:
        if new_features is None:
            return None
        if len(new_features) == 0:
            return None
        name = self.feature_dtype or ("f16" if getattr(new_features, "dtype", None) == np.float16 else "f32")
        if self._segment is not None and hasattr(new_features, "copy_into"):    # device rows: the device writes them
            shm_name = self._segment.write_device(new_features, FEATURE_DTYPES[name])
            if shm_name is not None:
                return pb.Features(rows=int(new_features.shape[0]), width=int(np.prod(new_features.shape[1:])),
                                   dtype=name, shm_name=shm_name, shm_offset=0)
        a = wire_array(new_features, name)
        rows, width = a.shape
        if self._segment is not None:
            return pb.Features(rows=rows, width=width, dtype=name, shm_name=self._segment.write(a), shm_offset=0)
        if a.nbytes > rpc.MAX_MESSAGE_BYTES - (1 << 16):   # gRPC itself would refuse it, as INTERNAL
            raise ValueError(f"{rows} feature rows are {a.nbytes / 2**20:.1f} MiB inline, past gRPC's "
                             f"{rpc.MAX_MESSAGE_BYTES >> 20} MiB message limit (a drafter that takes appends gets a "
                             "prompt's features in pieces; upgrade it, or send f16 features)")
        return pb.Features(rows=rows, width=width, dtype=name, data=a.tobytes())

    async def _exchange(self, req: pb.DraftRequest) -> pb.DraftResponse:
        if self._call is None:
            # No deadline on the stream (it lives as long as the request); each exchange has its own.
            self._call = self._conn.stub.Draft(metadata=telemetry.inject_metadata(context=self._trace_context))
        call = self._call

        async def once() -> pb.DraftResponse | Any:
            await call.write(req)
            return await call.read()

        try:
            resp = await asyncio.wait_for(once(), self.timeout)
        except asyncio.TimeoutError:
            call.cancel()
            raise
        if resp is grpc.aio.EOF:
            code = await call.code()
            raise DrafterUnavailableError(f"drafter {self.address} ended the stream ({code.name}: "
                                          f"{await call.details()})")
        return resp

    def propose(self, new_features: np.ndarray | None, last_token: int, start: int,
                k: int) -> tuple[np.ndarray, np.ndarray]:
        """Send the committed tokens' features, get the block's per-position top-k (ids int64, logp float64)."""
        return self.propose_begin(new_features, last_token, start, k)()

    def append_features(self, new_features: Any, start: int) -> None:
        """speculative's prompt appends: committed tokens' features ahead of the next draft. To a drafter that
        takes appends (Info.appends) they go now as an append (DraftRequest.top_k 0) that travels and is appended
        while the caller runs on, answered before this client's next exchange; an older drafter gets them with
        the next draft (held here until then)."""
        if self._closed:
            raise DrafterUnavailableError("the drafter client is closed")
        self._settle()
        info = self.info()
        if not info.appends:
            rows = np.asarray(new_features, dtype=np.float32)
            rows = rows.reshape(rows.shape[0], -1)
            self._held = rows if self._held is None else np.concatenate([self._held, rows], axis=0)
            return
        try:
            req = pb.DraftRequest(features=self._features(new_features), start=int(start), top_k=0)
        except (OSError, ValueError) as e:
            raise self._fail(f"drafter {self.address}: cannot send features: {e}") from None
        try:
            self._appending = self._conn.submit(self._exchange(req))
        except DrafterUnavailableError as e:
            raise self._fail(str(e)) from None

    def _settle(self) -> None:
        """Wait for the append in flight, if any (a failed one fails the client)."""
        fut, self._appending = self._appending, None
        if fut is not None:
            resp = self._response(fut)
            if resp.positions != 0 or resp.token_ids:
                raise self._fail(f"drafter {self.address} answered an append with a draft ({resp.positions} "
                                 "positions)")

    def propose_begin(self, new_features: np.ndarray | None, last_token: int, start: int,
                      k: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """propose() in two halves (speculative.begin_propose): the exchange is sent now and drafts while the
        caller commits its step; the returned callable waits for the answer (within the client's timeout)."""
        if self._closed:
            raise DrafterUnavailableError("the drafter client is closed")
        if self._failed:
            raise DrafterUnavailableError(self._failed)
        self._settle()
        if self._held is not None:
            held, self._held = self._held, None
            if new_features is not None and len(new_features):
                new = np.asarray(new_features, dtype=np.float32)
                held = np.concatenate([held, new.reshape(new.shape[0], -1)], axis=0)
            new_features = held
        try:
            req = pb.DraftRequest(features=self._features(new_features), last_token=int(last_token),
                                  start=int(start), top_k=int(k))
        except (OSError, ValueError) as e:      # shared memory full, odd shapes
            raise self._fail(f"drafter {self.address}: cannot send features: {e}") from None
        try:
            fut = self._conn.submit(self._exchange(req))
        except DrafterUnavailableError as e:
            raise self._fail(str(e)) from None
        return lambda: self._answer(fut)

    def _answer(self, fut: concurrent.futures.Future[pb.DraftResponse]) -> tuple[np.ndarray, np.ndarray]:
        resp = self._response(fut)
        n = resp.positions * resp.top_k
        if len(resp.token_ids) != n or len(resp.logprobs) != n or resp.positions < 1:
            raise self._fail(f"drafter {self.address} sent a malformed answer ({resp.positions} x {resp.top_k}, "
                             f"{len(resp.token_ids)} ids, {len(resp.logprobs)} log-probabilities)")
        self.last_draft_ms = float(resp.draft_ms)
        ids = np.asarray(resp.token_ids, dtype=np.int64).reshape(resp.positions, resp.top_k)
        logp = np.asarray(resp.logprobs, dtype=np.float32).astype(np.float64).reshape(resp.positions, resp.top_k)
        return ids, logp

    def _response(self, fut: concurrent.futures.Future[pb.DraftResponse]) -> pb.DraftResponse:
        """An exchange's answer (within the client's timeout); any failure fails the client."""
        try:
            resp = self._conn.wait(fut, self.timeout + 5.0)
        except (TimeoutError, asyncio.TimeoutError):
            raise self._fail(f"drafter {self.address} did not answer within {self.timeout:.1f} s") from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and self._segment is not None and self._auto:
                self._conn.shm_usable = False
                log.warning("drafter %s cannot map this host's shared memory; later requests send features "
                            "inline", self.address)
            raise self._fail(f"drafter {self.address}: {e.code().name}: {e.details()}") from None
        except DrafterUnavailableError as e:
            raise self._fail(str(e)) from None
        except (Exception, asyncio.CancelledError) as e:    # e.g. InvalidStateError from a finished call
            raise self._fail(f"drafter {self.address}: {type(e).__name__}: {e}") from None
        return resp

    def close(self) -> None:
        """End the stream (the drafter frees the session) and unlink the shared-memory segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        appending, self._appending = self._appending, None
        if appending is not None:     # its answer first: the stream's reads come one at a time
            try:
                appending.result(self.timeout + 5.0)
            except Exception:         # a failed or stuck append: the stream is cancelled below
                self._failed = self._failed or "an append failed while the client closed"
        self._held = None
        call, self._call = self._call, None
        if call is not None and not self._conn.closed:
            async def finish() -> None:
                if self._failed:
                    call.cancel()
                    return
                try:
                    await asyncio.wait_for(call.done_writing(), 2.0)
                    await asyncio.wait_for(call.read(), 2.0)     # EOF: the server side has finished
                except Exception:       # timing out or a broken stream: cancelling frees it just as well
                    call.cancel()

            try:
                self._conn.run(finish(), 5.0)
            except Exception:
                log.debug("closing the draft stream failed", exc_info=True)
        seg, self._segment = self._segment, None
        if seg is not None and self._failed:    # a failed stream's drafter may not have read it: never handed on
            seg.close()
        elif seg is not None:
            self._conn.give_segment(seg)

    def __enter__(self) -> DrafterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
