"""Start a gateway in the running event loop: HTTP (aiohttp) and, optionally, the public gRPC API.

The HTTP listener comes up at once and answers /health with 503 until a verifier reports ready, so
orchestrators can tell "booting" from "down" (llama-server does the same).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from services import rpc, telemetry
from services.wire import pb_grpc

from .core import GatewayCore, TokenizerSource, load_tokenizer_source
from .grpc_api import GatewayServicer
from .http import create_app
from .metrics import GatewayMetrics
from .pool import ChannelFactory, VerifierPool

log = logging.getLogger("specsplit.gateway")

DEFAULT_PORT = 8080


@dataclass
class GatewayConfig:
    """Everything a gateway needs; the CLI flags and SPECSPLIT_* env vars map onto it."""

    model: str                                      # tokenizer source: target GGUF or HF folder
    verifiers: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT                        # 0: any free port (tests)
    grpc_listen: str | None = None                  # public gRPC API address (None: off)
    model_name: str | None = None                   # the id clients use (default: the model's name)
    trace: str | None = None                        # none | console | otlp | memory; None: leave as is
    request_timeout: float | None = None            # default per-request deadline in seconds
    ping_interval: float = 15.0                     # SSE keep-alive comment interval (0: off)
    shutdown_grace_s: float = 5.0


class GatewayServer:
    """A running gateway; `stop()` shuts HTTP, gRPC and the verifier channels down gracefully."""

    def __init__(self, cfg: GatewayConfig, core: GatewayCore, runner: web.AppRunner, site: web.TCPSite,
                 grpc_server: rpc.RunningServer | None):
        self.cfg = cfg
        self.core = core
        self.runner = runner
        self.site = site
        self.grpc_server = grpc_server
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task | None = None
        self._readiness: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The bound HTTP port (port 0 resolved)."""
        server = self.site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self.cfg.port

    @property
    def url(self) -> str:
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def grpc_address(self) -> str | None:
        return str(self.grpc_server.address.target) if self.grpc_server is not None else None

    async def stop(self, grace: float | None = None) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(self.cfg.shutdown_grace_s if grace is None
                                                              else grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        if self._readiness is not None:
            self._readiness.cancel()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        await self.runner.shutdown()       # stops accepting; waits for open handlers (aiohttp's own timeout)
        await self.runner.cleanup()
        await self.core.pool.close()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


async def serve_gateway(cfg: GatewayConfig, source: TokenizerSource | None = None,
                        channel_factory: ChannelFactory | None = None,
                        metrics: GatewayMetrics | None = None) -> GatewayServer:
    """Load the tokenizer (no weights), connect to the verifiers and start listening."""
    if cfg.trace is not None:
        telemetry.configure_tracing(cfg.trace, "specsplit-gateway")
    cfg.verifiers = [str(a) for a in cfg.verifiers]     # rpc.Address objects are welcome too
    if not cfg.verifiers:
        raise ValueError("the gateway needs at least one --verifier address")
    for a in cfg.verifiers:
        rpc.parse_address(a)              # a typo fails here with a message, not later as "unavailable"
    if source is None:
        source = await asyncio.to_thread(load_tokenizer_source, cfg.model)
    pool = VerifierPool(list(cfg.verifiers), channel_factory=channel_factory)
    core = GatewayCore(source, pool, metrics=metrics, model_name=cfg.model_name,
                       tracer=telemetry.get_tracer("specsplit.gateway"), default_timeout=cfg.request_timeout)
    await pool.start()
    runner = web.AppRunner(create_app(core, cfg.ping_interval), handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        await pool.close()
        raise
    grpc_server = None
    if cfg.grpc_listen:
        grpc_server = await rpc.start_server([(pb_grpc.add_GatewayServicer_to_server, GatewayServicer(core))],
                                             cfg.grpc_listen, [rpc.SERVICE_GATEWAY])
    server = GatewayServer(cfg, core, runner, site, grpc_server)
    if grpc_server is not None:
        server._readiness = asyncio.create_task(_mirror_readiness(pool, grpc_server))
    log.info("gateway on %s (model %s, verifiers %s%s)", server.url, core.model_name, ", ".join(cfg.verifiers),
             f", gRPC {server.grpc_address}" if grpc_server else "")
    return server


async def _mirror_readiness(pool: VerifierPool, grpc_server: rpc.RunningServer, period: float = 0.5) -> None:
    """The public gRPC API's readiness follows the verifiers': SERVING while at least one is ready."""
    shown: bool | None = None
    while True:
        ready = bool(pool.ready)
        if ready != shown:
            await grpc_server.set_ready(rpc.SERVICE_GATEWAY, ready)
            shown = ready
        await asyncio.sleep(period)
