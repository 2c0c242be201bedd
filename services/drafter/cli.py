"""`specsplit drafter`: run the Drafter gRPC service (a DFlash drafter for one target model).

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (upper case, dashes as
underscores: --max-sessions -> SPECSPLIT_MAX_SESSIONS); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

DEFAULT_LISTEN = "unix:///run/specsplit/drafter.sock"
ENV_PREFIX = "SPECSPLIT_"


def _env_argument(parser: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    # Same convention as `specsplit verifier`: the variable stands in for the flag (parsed by `type`).
    env = ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")
    val = os.environ.get(env)
    if val:
        kw["default"] = val
        kw["required"] = False
    kw["help"] = f"{kw.get('help', '')} [env {env}]".strip()
    parser.add_argument(flag, **kw)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {n}")
    return n


def _address(text: str) -> str:
    from services.rpc import parse_address

    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("drafter", help="run the Drafter gRPC service (DFlash drafter)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _env_argument(p, "--model", required=True,
                  help="target model (GGUF or HF folder); only its embedding and lm head are loaded")
    _env_argument(p, "--draft", required=True, help="DFlash drafter: z-lab folder or GGUF")
    _env_argument(p, "--listen", type=_address, default=DEFAULT_LISTEN,
                  help=f"address to serve on: unix:///path, host:port or inproc (default {DEFAULT_LISTEN})")
    _env_argument(p, "--max-sessions", type=_positive, default=16,
                  help="concurrent Draft streams (requests); more get RESOURCE_EXHAUSTED")
    _env_argument(p, "--trace", default="none", choices=["none", "console", "otlp"],
                  help="OpenTelemetry span exporter (otlp reads the OTEL_EXPORTER_OTLP_* variables)")
    _env_argument(p, "--otlp-endpoint", default=None, help="OTLP collector endpoint (with --trace otlp)")
    _env_argument(p, "--grace", type=float, default=5.0, help="seconds open streams get to finish on SIGTERM")
    _env_argument(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_drafter)


def cmd_drafter(args: argparse.Namespace) -> int:
    from services.engine.errors import SpecsplitError

    from .service import DrafterConfig

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from services.telemetry import configure_tracing

    try:
        configure_tracing(args.trace, "specsplit-drafter", args.otlp_endpoint)
    except RuntimeError as e:
        raise SpecsplitError(str(e)) from None
    cfg = DrafterConfig(model=args.model, draft=args.draft, max_sessions=args.max_sessions, trace=args.trace,
                        shutdown_grace_s=args.grace)
    return asyncio.run(_main(cfg, args.listen))


async def _main(cfg: Any, listen: str) -> int:
    from services import rpc
    from services.engine.errors import SpecsplitError

    from .service import serve_drafter

    try:
        server = await serve_drafter(cfg, listen)
    except OSError as e:
        raise SpecsplitError(f"cannot listen on {listen}: {e}") from None
    # the DrafterServer, not just its grpc server: a signal during the load also abandons the load
    rpc.install_sigterm(asyncio.get_running_loop(), server, cfg.shutdown_grace_s)
    try:
        await server.wait_loaded()
    except asyncio.CancelledError:       # stopped by a signal while loading
        pass
    except Exception as e:
        await server.stop(0)
        raise SpecsplitError(f"cannot start the drafter: {e}") from e
    await server.wait_for_termination()
    return 0
