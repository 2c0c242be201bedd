"""`specsplit gateway`: the OpenAI-compatible HTTP API (and optional public gRPC API) in front of verifiers.

The gateway loads no weights: it reads the tokenizer and chat template from the target model file
(memory-mapped metadata) and routes each request to the ready verifier with the fewest open requests.

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (upper case, dashes as
underscores: --grpc-listen -> SPECSPLIT_GRPC_LISTEN); SPECSPLIT_VERIFIER takes a comma-separated list.
A flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from services.cliargs import add_env_argument, env_name, port, seconds

from .server import DEFAULT_PORT, GatewayConfig


def add_gateway_arguments(p: argparse.ArgumentParser, with_model: bool = True) -> None:
    """The HTTP-side flags, shared with `specsplit serve`."""
    add_env_argument(p, "--host", default="0.0.0.0", help="HTTP listen address (default 0.0.0.0)")
    add_env_argument(p, "--port", type=port, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    add_env_argument(p, "--model-name", default=None,
                     help="model id clients send and /v1/models lists (default: the model file's name)")
    add_env_argument(p, "--request-timeout", type=seconds, default=None,
                     help="default per-request deadline in seconds, passed on to the verifier (default none)")
    add_env_argument(p, "--ping-interval", type=seconds, default=15.0,
                     help="seconds between SSE keep-alive comments while a stream waits (0: off)")
    add_env_argument(p, "--trace", default="none", choices=["none", "console", "otlp"],
                     help="OpenTelemetry span exporter (otlp reads the OTEL_EXPORTER_OTLP_* variables)")
    add_env_argument(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("gateway", help="run the OpenAI-compatible gateway (HTTP + public gRPC)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_env_argument(p, "--model", required=True,
                     help="target model (GGUF file or HF folder) to read the tokenizer and chat template from")
    env = env_name("--verifier")
    from_env = [a.strip() for a in os.environ.get(env, "").split(",") if a.strip()]
    p.add_argument("--verifier", action="append", default=None, required=not from_env,
                   help=f"verifier address (unix:///run/specsplit/verifier.sock, host:port); repeat for "
                        f"several [env {env}, comma-separated]")
    add_env_argument(p, "--grpc-listen", default=None,
                     help="serve the public gRPC Gateway API on this address too (host:port, unix:///...)")
    add_gateway_arguments(p)
    p.set_defaults(func=cmd_gateway, verifier_env=from_env)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(model=args.model, verifiers=list(args.verifier or args.verifier_env), host=args.host,
                         port=args.port, grpc_listen=args.grpc_listen or None, model_name=args.model_name or None,
                         trace=args.trace, request_timeout=args.request_timeout or None,
                         ping_interval=args.ping_interval)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def cmd_gateway(args: argparse.Namespace) -> int:
    from services.engine.errors import SpecsplitError

    setup_logging(args.log_level)
    try:
        return asyncio.run(_main(config_from_args(args)))
    except (ValueError, OSError) as e:
        raise SpecsplitError(f"cannot start the gateway: {e}") from None


async def _main(cfg: GatewayConfig) -> int:
    from .server import serve_gateway

    server = await serve_gateway(cfg)
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        logging.getLogger("specsplit.gateway").info("%s: shutting down", name)
        loop.create_task(server.stop())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await server.wait_for_termination()
    return 0
