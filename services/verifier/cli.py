"""`specsplit verifier`: run the Verifier gRPC service (target model + speculative loop).

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (upper case, dashes as
underscores: --max-queue -> SPECSPLIT_MAX_QUEUE), so compose files and Helm charts need no command
overrides; a flag on the command line wins over the variable.

--budget takes a number of DDTree nodes, `chain` (a plain chain of block_size - 1 drafted tokens), or
`auto`. `auto` is 22 for now: the best fixed budget measured on the CPU backend; online tuning from the
measured verify-cost curve will replace it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from services.cliargs import add_env_argument, int_at_least

DEFAULT_LISTEN = "unix:///run/specsplit/verifier.sock"   # same place the drafter and compose use


def parse_budget(text: str) -> int | None:
    """`chain` -> None, `auto` -> the default budget, N -> N (1..MAX_BUDGET)."""
    from .service import DEFAULT_BUDGET, MAX_BUDGET

    t = str(text).strip().lower()
    if t == "chain":
        return None
    if t == "auto":
        return DEFAULT_BUDGET
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes a number, 'chain' or 'auto', got {text!r}") from None
    if not 1 <= n <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"--budget must be in 1..{MAX_BUDGET}, got {n}")
    return n


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("verifier", help="run the Verifier gRPC service (target model)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_env_argument(p, "--model", required=True, help="target model: GGUF file or Hugging Face folder")
    add_env_argument(p, "--draft", default=None, help="in-process DFlash drafter (folder or GGUF)")
    add_env_argument(p, "--drafter", default=None,
                     help="address of a Drafter service (unix:///run/specsplit/drafter.sock, host:port)")
    add_env_argument(p, "--drafter-timeout", type=float, default=30.0,
                     help="seconds one remote draft may take before the request falls back to plain decoding")
    add_env_argument(p, "--budget", type=parse_budget, default="auto",
                     help="DDTree budget: N nodes, 'chain', or 'auto' (= 22 on CPU for now)")
    add_env_argument(p, "--slots", type=int_at_least(1), default=1, help="concurrent generations (KV slots)")
    add_env_argument(p, "--max-queue", type=int_at_least(0), default=16,
                     help="requests that may wait for a slot; more get RESOURCE_EXHAUSTED")
    add_env_argument(p, "--max-ctx", type=int_at_least(1), default=None, help="context per request (default: model's)")
    add_env_argument(p, "--listen", default=DEFAULT_LISTEN,
                     help=f"address to serve on: host:port, unix:///path or inproc (default {DEFAULT_LISTEN})")
    add_env_argument(p, "--trace", default="none", choices=["none", "console", "otlp"],
                     help="OpenTelemetry span exporter (otlp reads the OTEL_EXPORTER_OTLP_* variables)")
    add_env_argument(p, "--no-speculative", action="store_true",
                     help="plain decoding unless a request asks for speculation")
    add_env_argument(p, "--grace", type=float, default=10.0,
                     help="seconds in-flight requests get to finish on SIGTERM")
    add_env_argument(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_verifier)


def config_from_args(args: argparse.Namespace):
    from .service import VerifierConfig

    if args.draft and args.drafter:
        raise ValueError("give either --draft (in-process drafter) or --drafter (a Drafter address), not both")
    return VerifierConfig(model=args.model, draft=args.draft or None, drafter_address=args.drafter or None,
                          budget=args.budget, slots=args.slots, max_queue=args.max_queue, max_ctx=args.max_ctx,
                          speculative=not args.no_speculative, trace=args.trace, shutdown_grace_s=args.grace,
                          drafter_timeout_s=args.drafter_timeout)


def cmd_verifier(args: argparse.Namespace) -> int:
    from services.engine.errors import SpecsplitError

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SpecsplitError(str(e)) from None
    return asyncio.run(_main(cfg, args.listen))


async def _main(cfg: Any, listen: str) -> int:
    from .service import serve_verifier

    server = await serve_verifier(cfg, listen, wait=False)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal(name: str) -> None:
        logging.getLogger("specsplit.verifier").info("%s: draining (grace %.1f s)", name, cfg.shutdown_grace_s)
        if not stopping:                 # a second signal does not restart the drain
            stopping.append(loop.create_task(server.stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        await server.wait_loaded()
    except asyncio.CancelledError:       # stopped (signal) while loading
        pass
    except Exception as e:
        await server.stop(0)
        from services.engine.errors import SpecsplitError

        raise SpecsplitError(f"cannot start the verifier: {e}") from e
    await server.wait_for_termination()
    if stopping:
        await stopping[0]
    return 0
