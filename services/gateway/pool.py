"""The verifiers a gateway routes to: readiness tracking and least-outstanding-requests choice.

Each endpoint is polled with `grpc.health.v1` for the Verifier's readiness service name (falling back to
the overall "" status for servers that only register that) and, when it turns ready, asked for `Info`
(model id, context length, slots). A Generate call that fails with UNAVAILABLE marks the endpoint down at
once; the poller brings it back. The gateway is stateless, so any ready verifier may take any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.wire import pb, pb_grpc

from .errors import unavailable

log = logging.getLogger("specsplit.gateway")

VERIFIER_SERVICE = "specsplit.v1.Verifier"

class _Unreachable(Exception):
    pass


ChannelFactory = Callable[[str], grpc.aio.Channel]


@dataclass
class VerifierEndpoint:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.VerifierStub
    health: health_pb2_grpc.HealthStub
    ready: bool = False
    info: pb.VerifierInfo | None = None
    outstanding: int = 0
    last_error: str = "not checked yet"
    checked_at: float = 0.0
    _task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def context_length(self) -> int:
        return int(self.info.model.context_length) if self.info is not None else 0


def default_channel_factory(address: str) -> grpc.aio.Channel:
    """A channel with the shared options and the trace-context interceptors (the verifier's spans become
    children of the gateway's request span)."""
    from services import rpc, telemetry

    return rpc.open_channel(address, interceptors=telemetry.client_interceptors())


class VerifierPool:
    """Verifier endpoints with readiness; `pick()` returns the ready one with the fewest open requests."""

    def __init__(self, addresses: list[str], channel_factory: ChannelFactory | None = None,
                 poll_interval: float = 2.0, fast_poll_interval: float = 0.2, check_timeout: float = 2.0):
        if not addresses:
            raise ValueError("at least one verifier address is needed")
        factory = channel_factory or default_channel_factory
        self.endpoints: list[VerifierEndpoint] = []
        for addr in addresses:
            ch = factory(addr)
            self.endpoints.append(VerifierEndpoint(addr, ch, pb_grpc.VerifierStub(ch),
                                                   health_pb2_grpc.HealthStub(ch)))
        self._poll = poll_interval
        self._fast_poll = fast_poll_interval
        self._check_timeout = check_timeout
        self._rr = itertools.count()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------------------------------- state

    @property
    def ready(self) -> list[VerifierEndpoint]:
        return [e for e in self.endpoints if e.ready]

    def status_message(self) -> str:
        return "; ".join(f"{e.address}: {'ready' if e.ready else e.last_error}" for e in self.endpoints)

    def model_info(self) -> pb.ModelInfo | None:
        """The model of the first endpoint that answered Info (all verifiers serve the same model)."""
        for e in self.endpoints:
            if e.info is not None:
                return e.info.model
        return None

    def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> VerifierEndpoint:
        """The ready endpoint with the fewest open requests (addresses in `exclude` only if none else)."""
        ready = self.ready
        if not ready:
            raise unavailable(f"no verifier is ready ({self.status_message()})")
        ready = [e for e in ready if e.address not in exclude] or ready
        low = min(e.outstanding for e in ready)
        tied = [e for e in ready if e.outstanding == low]
        # Round-robin among ties so idle verifiers share the load instead of the first one taking all.
        return tied[next(self._rr) % len(tied)]

    def mark_down(self, ep: VerifierEndpoint, reason: str) -> None:
        if ep.ready:
            log.warning("verifier %s marked unavailable: %s", ep.address, reason)
        ep.ready = False
        ep.last_error = reason
        self._changed.set()

    # ---------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        for ep in self.endpoints:
            ep._task = asyncio.create_task(self._watch(ep), name=f"verifier-health {ep.address}")

    async def close(self) -> None:
        for ep in self.endpoints:
            if ep._task is not None:
                ep._task.cancel()
        for ep in self.endpoints:
            if ep._task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ep._task
            await ep.channel.close()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until at least one verifier is ready; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            self._changed.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return bool(self.ready)
        return True

    async def _watch(self, ep: VerifierEndpoint) -> None:
        while True:
            was = ep.ready
            try:
                ok, why = await self._check(ep)
            except asyncio.CancelledError:
                raise
            except _Unreachable as e:
                ok, why = False, str(e)
            except Exception as e:                 # a poller must never die; report and retry
                ok, why = False, f"health check failed: {e!r}"
            ep.ready, ep.last_error, ep.checked_at = ok, ("" if ok else why), time.monotonic()
            if ok != was:
                log.info("verifier %s is %s", ep.address, "ready" if ok else f"not ready ({why})")
                self._changed.set()
            await asyncio.sleep(self._poll if ok else self._fast_poll)

    async def _check(self, ep: VerifierEndpoint) -> tuple[bool, str]:
        status = await self._health(ep, VERIFIER_SERVICE)
        if status is None:                       # readiness name not registered: use overall health
            status = await self._health(ep, "")
        if status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status) if status is not None else "UNKNOWN"
            return False, f"loading ({name})"
        if ep.info is None or not ep.ready:
            try:
                ep.info = await ep.stub.Info(pb.InfoRequest(), timeout=self._check_timeout)
            except grpc.aio.AioRpcError as e:
                return False, f"Info failed: {e.code().name}: {e.details()}"
        return True, ""

    async def _health(self, ep: VerifierEndpoint, service: str) -> int | None:
        try:
            resp = await ep.health.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=self._check_timeout)
            return resp.status
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None if service else health_pb2.HealthCheckResponse.SERVING
            raise _Unreachable(f"unreachable ({e.code().name}: {e.details()})") from None
