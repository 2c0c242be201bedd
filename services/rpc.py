"""Shared gRPC plumbing for the services: addresses, servers with health and reflection, channels, readiness.

Addresses are strings: `unix:///abs/path` or `unix:relative/path` (same host), `host:port` or
`[v6addr]:port` (across hosts), and `inproc` / `inproc:NAME` (one process). There is no true in-process
transport in grpc.aio, so `inproc:NAME` is a unix socket `NAME.sock` in a private 0700 temporary folder
made once per process (removed at exit): the same code path as `unix://`, with nothing visible outside.
Two servers in one process need two names (`inproc:drafter`, `inproc:verifier`); bare `inproc` is
`inproc:default`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import errno
import logging
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("specsplit.rpc")

SERVICE_VERIFIER = "specsplit.v1.Verifier"
SERVICE_DRAFTER = "specsplit.v1.Drafter"
SERVICE_GATEWAY = "specsplit.v1.Gateway"
HEALTH_SERVICE = grpc_health.SERVICE_NAME
REFLECTION_SERVICE = reflection.SERVICE_NAME

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Client pings every 30 s (also while idle: a dead peer is noticed without a request in flight); the server
# accepts pings down to 10 s apart, so the pair never trips the "too_many_pings" GOAWAY.
_KEEPALIVE_TIME_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Linux gRPC sets SO_REUSEPORT by default: a second server on a busy TCP port would bind silently
    # and share the traffic. Off, so "address in use" is an error.
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Peers start at different times (a model load takes minutes); reconnect promptly once they are up
    # rather than on gRPC's default 1 s .. 120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


# ---------------------------------------------------------------------------------------------------
# addresses


@dataclass(frozen=True)
class Address:
    """A parsed service address. `target` is what grpc binds / dials."""

    kind: str                    # "unix" | "tcp" | "inproc"
    target: str                  # "unix:///abs/x.sock" or "host:port" / "[v6]:port"
    path: str | None = None      # unix and inproc: the absolute socket path
    host: str | None = None      # tcp
    port: int | None = None      # tcp
    name: str | None = None      # inproc
    text: str = ""               # as given

    @property
    def is_local(self) -> bool:
        """True when both ends must be on this host (unix socket or in-process)."""
        return self.kind in ("unix", "inproc")

    def __str__(self) -> str:
        return self.text or self.target


_INPROC_LOCK = threading.Lock()
_INPROC_DIR: str | None = None
_INPROC_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _inproc_dir() -> str:
    global _INPROC_DIR
    with _INPROC_LOCK:
        if _INPROC_DIR is None:
            _INPROC_DIR = tempfile.mkdtemp(prefix="specsplit-inproc-")   # mode 0700
            atexit.register(shutil.rmtree, _INPROC_DIR, True)
        return _INPROC_DIR


def parse_address(addr: str) -> Address:
    """Parse a service address (see the module docstring); ValueError says what is wrong and what works."""
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"empty service address {addr!r}; expected unix:///abs/path, host:port or inproc")
    text = addr.strip()
    if text == "inproc" or text.startswith("inproc:"):
        name = text[len("inproc:"):] if text.startswith("inproc:") else "default"
        if not _INPROC_NAME.match(name):
            raise ValueError(f"bad in-process address {text!r}: the name after 'inproc:' may only hold "
                             "letters, digits, '.', '_' and '-'")
        path = os.path.join(_inproc_dir(), f"{name}.sock")
        return Address("inproc", f"unix://{path}", path=path, name=name, text=text)
    if text.startswith("unix:"):
        rest = text[len("unix:"):]
        if rest.startswith("//"):
            rest = rest[2:]
            if not rest.startswith("/"):
                raise ValueError(f"bad unix address {text!r}: unix:// must be followed by an absolute path "
                                 "(unix:///run/x.sock); use unix:relative/x.sock for a relative one")
        if not rest or rest.endswith("/"):
            raise ValueError(f"bad unix address {text!r}: no socket file name")
        path = os.path.abspath(rest)
        return Address("unix", f"unix://{path}", path=path, text=text)
    if "://" in text:
        raise ValueError(f"unsupported address scheme in {text!r}; expected unix:///abs/path, host:port, "
                         "[v6addr]:port or inproc")
    m = re.match(r"^\[([0-9A-Fa-f:.%a-zA-Z]+)\]:(\d+)$", text)
    if m:
        host, port = m.group(1), m.group(2)
        if ":" not in host:
            raise ValueError(f"bad address {text!r}: brackets are only for IPv6 addresses")
        target_host = f"[{host}]"
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"bad address {text!r}: expected host:port (e.g. localhost:50051), "
                             "[v6addr]:port, unix:///abs/path or inproc")
        if ":" in host:
            raise ValueError(f"bad address {text!r}: write IPv6 addresses in brackets, [::1]:50051")
        if not _HOSTNAME.match(host):
            raise ValueError(f"bad address {text!r}: {host!r} is not a host name or address")
        target_host = host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {text!r}: port must be a number in 0..65535, got {port!r}")
    return Address("tcp", f"{target_host}:{int(port)}", host=host, port=int(port), text=text)


def _with_port(addr: Address, port: int) -> Address:
    host = f"[{addr.host}]" if ":" in (addr.host or "") else addr.host
    return Address("tcp", f"{host}:{port}", host=addr.host, port=port, text=f"{host}:{port}")


# ---------------------------------------------------------------------------------------------------
# servers


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead server; refuse if a live server answers on it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"a server is already listening on {path}")


class RunningServer:
    """A started grpc.aio server with its health servicer. Readiness per service is off until set_ready."""

    def __init__(self, server: grpc.aio.Server, address: Address, health: Any, service_names: list[str]):
        self.server = server
        self.address = address            # the bound address (a tcp port 0 resolved to the real port)
        self.health = health
        self.service_names = list(service_names)
        self.loop = asyncio.get_running_loop()
        self._stopping: asyncio.Task | None = None

    def set_ready(self, name: str, ready: bool = True) -> asyncio.Future | concurrent.futures.Future:
        """Mark `name` SERVING (or NOT_SERVING). Callable from any thread; await the result to be sure the
        status is visible before going on (it applies at the next turn of the server's loop otherwise)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return self.loop.create_task(self.health.set(name, status))
        return asyncio.run_coroutine_threadsafe(self.health.set(name, status), self.loop)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Graceful shutdown: health goes NOT_SERVING first (balancers stop routing here), then in-flight
        RPCs get `grace` seconds before they are cancelled. Safe to call more than once."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        log.info("shutting down %s (grace %s s)", self.address, grace)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.address.path:
            try:
                os.unlink(self.address.path)
            except FileNotFoundError:
                pass

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(servicers: Sequence[tuple[Callable[[Any, Any], None], Any]], address: str,
                       service_names: Sequence[str], options: Sequence[tuple[str, Any]] | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None) -> RunningServer:
    """Start a grpc.aio server on `address` serving `servicers` ([(add_XServicer_to_server, servicer)]).

    Health: "" is SERVING at once (liveness); each name in `service_names` is NOT_SERVING until
    `running.set_ready(name)`. Reflection lists `service_names`, health and reflection.
    """
    addr = parse_address(address)
    opts = dict(SERVER_OPTIONS)
    opts.update(dict(options or ()))
    server = grpc.aio.server(options=list(opts.items()), interceptors=list(interceptors or ()))
    for add_fn, servicer in servicers:
        add_fn(servicer, server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in service_names:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*service_names, HEALTH_SERVICE, REFLECTION_SERVICE], server)

    if addr.path:
        os.makedirs(os.path.dirname(addr.path), exist_ok=True)
        _clear_stale_socket(addr.path)
    try:
        port = server.add_insecure_port(addr.target)
    except RuntimeError as e:       # grpc raises a bare "Failed to bind"
        raise OSError(errno.EADDRINUSE, f"cannot listen on {addr}: {e} (address in use or not allowed?)") from e
    if addr.kind == "tcp" and port == 0:
        raise OSError(errno.EADDRINUSE, f"cannot listen on {addr} (address in use or not allowed?)")
    bound = _with_port(addr, port) if addr.kind == "tcp" else addr
    await server.start()
    log.info("listening on %s (%s)", bound, ", ".join(service_names))
    return RunningServer(server, bound, health, list(service_names))


def install_sigterm(loop: asyncio.AbstractEventLoop, running: RunningServer | Any, grace: float = 5.0) -> None:
    """SIGTERM / SIGINT start a graceful stop of `running` (a RunningServer, or anything with an async
    `stop(grace)` that may be called again; RunningServer.stop ignores repeats)."""

    def on_signal(signame: str) -> None:
        log.info("%s received", signame)
        loop.create_task(running.stop(grace))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)


# ---------------------------------------------------------------------------------------------------
# channels


def _channel_options(options: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    opts = dict(CHANNEL_OPTIONS)
    opts.update(dict(options or ()))
    return list(opts.items())


def open_channel(addr: str | Address, options: Sequence[tuple[str, Any]] | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `addr` with the shared message-size, keepalive and reconnect options."""
    a = addr if isinstance(addr, Address) else parse_address(addr)
    return grpc.aio.insecure_channel(a.target, options=_channel_options(options),
                                     interceptors=list(interceptors or ()) or None)


def open_sync_channel(addr: str | Address, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """The blocking-API twin of open_channel (for code that runs on plain threads)."""
    a = addr if isinstance(addr, Address) else parse_address(addr)
    return grpc.insecure_channel(a.target, options=_channel_options(options))


_STATUS_NAME = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}


async def wait_ready(channel: grpc.aio.Channel, service_name: str = "", timeout: float | None = None,
                     log_every: float = 10.0, what: str | None = None) -> None:
    """Wait until the health service on `channel` reports `service_name` SERVING.

    Waits through "not listening yet" and NOT_SERVING (a model still loading) alike. timeout=None waits
    forever; progress is logged every `log_every` seconds. TimeoutError past the timeout, RuntimeError if
    the peer has no health service.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = None if timeout is None else t0 + timeout
    stub = health_pb2_grpc.HealthStub(channel)
    label = what or (f"service {service_name!r}" if service_name else "server")
    last = "no answer yet"
    failures = 0
    while True:
        now = loop.time()
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"{label} not ready after {timeout:.1f} s (last status: {last})")
        slice_s = log_every if deadline is None else min(log_every, deadline - now)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=service_name), timeout=slice_s,
                          wait_for_ready=True)
        try:
            async for resp in call:
                last = _STATUS_NAME.get(resp.status, str(resp.status))
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    call.cancel()
                    return
                log.info("waiting for %s: %s", label, last)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise RuntimeError(f"{label}: the peer has no grpc.health.v1 service") from e
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                failures = 0
                log.info("still waiting for %s after %.0f s (last status: %s)", label, loop.time() - t0, last)
                continue
            # The peer went away mid-watch (or is restarting): back off a little and watch again; the
            # wait_for_ready call then blocks until it is reachable.
            last = f"{code.name}: {e.details()}"
            failures += 1
            await asyncio.sleep(min(0.05 * 2 ** min(failures, 5), 1.0))
        finally:
            call.cancel()
