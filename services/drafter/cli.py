"""`specsplit drafter`: run the Drafter gRPC service (a DFlash drafter for one target model).

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (upper case, dashes as
underscores: --max-sessions -> SPECSPLIT_MAX_SESSIONS); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from services.cliargs import add_env_argument, address, device, int_at_least

DEFAULT_LISTEN = "unix:///run/specsplit/drafter.sock"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("drafter", help="run the Drafter gRPC service (DFlash drafter)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_env_argument(p, "--model", required=True,
                     help="target model (GGUF or HF folder); only its embedding and lm head are loaded")
    add_env_argument(p, "--draft", required=True, help="DFlash drafter: z-lab folder or GGUF")
    add_env_argument(p, "--listen", type=address, default=DEFAULT_LISTEN,
                     help=f"address to serve on: unix:///path, host:port or inproc (default {DEFAULT_LISTEN})")
    add_env_argument(p, "--max-sessions", type=int_at_least(1), default=16,
                     help="concurrent Draft streams (requests); more get RESOURCE_EXHAUSTED")
    add_env_argument(p, "--device", type=device, default="cpu",
                     help="where the drafter runs: cpu or cuda:N (default cpu; a GPU of its own, the verifier's "
                          "target may be on another one); on a GPU every session is made at start-up")
    add_env_argument(p, "--max-ctx", type=int_at_least(1), default=None,
                     help="GPU: context tokens per session (default: the model's, shrunk to what fits)")
    add_env_argument(p, "--trace", default="none", choices=["none", "console", "otlp"],
                     help="OpenTelemetry span exporter (otlp reads the OTEL_EXPORTER_OTLP_* variables)")
    add_env_argument(p, "--otlp-endpoint", default=None, help="OTLP collector endpoint (with --trace otlp)")
    add_env_argument(p, "--grace", type=float, default=5.0, help="seconds open streams get to finish on SIGTERM")
    add_env_argument(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
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
                        shutdown_grace_s=args.grace, device=args.device, max_ctx=args.max_ctx)
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
