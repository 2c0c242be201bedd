"""`specsplit verifier`: run the Verifier gRPC service (target model + speculative loop).

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (upper case, dashes as
underscores: --max-queue -> SPECSPLIT_MAX_QUEUE), so compose files and Helm charts need no command
overrides; a flag on the command line wins over the variable.

--budget takes a number of DDTree nodes, `chain` (a plain chain of block_size - 1 drafted tokens), or
`auto` (the default): at start-up the verifier times the target at a few verify widths, and each step then
verifies the best-first prefix of a 64-node tree that maximises expected tokens per second, with the
acceptance calibrated on the steps served so far (services/engine/budget.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from services.cliargs import (
    KV_CACHE_HELP,
    add_device_arguments,
    add_env_argument,
    int_at_least,
    kv_cache_type,
    parse_budget,
)

DEFAULT_LISTEN = "unix:///run/specsplit/verifier.sock"   # same place the drafter and compose use


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("verifier", help="run the Verifier gRPC service (target model)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_env_argument(p, "--model", required=True, help="target model: GGUF file or Hugging Face folder")
    add_env_argument(p, "--draft", default=None, help="in-process DFlash drafter (folder or GGUF)")
    add_env_argument(p, "--drafter", default=None,
                     help="address of a Drafter service (unix:///run/specsplit/drafter.sock, host:port)")
    add_env_argument(p, "--drafter-timeout", type=float, default=30.0,
                     help="seconds one remote draft may take before the request falls back to plain decoding")
    add_env_argument(p, "--draft-features", default="auto", choices=["auto", "f32", "f16"],
                     help="a remote drafter's features on the wire: auto (the default: f16 across a network, half "
                          "the bytes; f32 through shared memory on one host), f32 or f16")
    add_env_argument(p, "--budget", type=parse_budget, default="auto",
                     help="DDTree budget: N nodes, 'chain', or 'auto' (tuned per step; the default)")
    add_env_argument(p, "--slots", type=int_at_least(1), default=1, help="concurrent generations (KV slots)")
    add_env_argument(p, "--max-queue", type=int_at_least(0), default=16,
                     help="requests that may wait for a slot; more get RESOURCE_EXHAUSTED")
    add_env_argument(p, "--max-ctx", type=int_at_least(1), default=None, help="context per request (default: model's)")
    add_env_argument(p, "--cache-type-k", type=kv_cache_type, default="auto", help=KV_CACHE_HELP.format(side="keys"))
    add_env_argument(p, "--cache-type-v", type=kv_cache_type, default="auto",
                     help=KV_CACHE_HELP.format(side="values"))
    add_env_argument(p, "--listen", default=DEFAULT_LISTEN,
                     help=f"address to serve on: host:port, unix:///path or inproc (default {DEFAULT_LISTEN})")
    add_env_argument(p, "--trace", default="none", choices=["none", "console", "otlp"],
                     help="OpenTelemetry span exporter (otlp reads the OTEL_EXPORTER_OTLP_* variables)")
    add_env_argument(p, "--no-speculative", action="store_true",
                     help="plain decoding unless a request asks for speculation")
    add_env_argument(p, "--grace", type=float, default=10.0,
                     help="seconds in-flight requests get to finish on SIGTERM")
    add_env_argument(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    add_device_arguments(p)
    add_env_argument(p, "--json", action="store_true", help="with --plan-only: print the plan as JSON")
    p.set_defaults(func=cmd_verifier)


def config_from_args(args: argparse.Namespace):
    from .service import VerifierConfig

    if args.draft and args.drafter:
        raise ValueError("give either --draft (in-process drafter) or --drafter (a Drafter address), not both")
    return VerifierConfig(model=args.model, draft=args.draft or None, drafter_address=args.drafter or None,
                          budget=args.budget, slots=args.slots, max_queue=args.max_queue, max_ctx=args.max_ctx,
                          speculative=not args.no_speculative, trace=args.trace, shutdown_grace_s=args.grace,
                          drafter_timeout_s=args.drafter_timeout, draft_features=args.draft_features,
                          cache_type_k=args.cache_type_k,
                          cache_type_v=args.cache_type_v, device=args.device, draft_device=args.draft_device)


def cmd_verifier(args: argparse.Namespace) -> int:
    from services.engine.errors import SpecsplitError

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SpecsplitError(str(e)) from None
    if not startup_plan(args, cfg.model, cfg.draft, remote_drafter=bool(cfg.drafter_address)):
        return 0
    cfg.max_ctx = args.max_ctx
    return asyncio.run(_main(cfg, args.listen))


def startup_plan(args: argparse.Namespace, model: str, draft: str | None, remote_drafter: bool = False) -> bool:
    """Plan memory before loading (services.engine.memory_plan): refuse with what to change, or log the plan.

    Returns False when --plan-only printed the plan. Without --max-ctx a context that does not fit is shrunk
    (args.max_ctx is set to what fits, with a warning).
    """
    from services.engine.memory_plan import plan_from_args, print_plan

    plan = plan_from_args(args, model, draft, remote_drafter=remote_drafter)
    if args.plan_only:
        print_plan(plan, args.json)
        return False
    log = logging.getLogger("specsplit.verifier")
    if plan.shrunk_from:
        log.warning("max_ctx %d does not fit in memory; using %d (pass --max-ctx to choose)",
                    plan.shrunk_from, plan.settings.max_ctx)
        args.max_ctx = plan.settings.max_ctx
    log.info("%s", plan.summary())
    for w in plan.warnings:
        log.warning("memory plan: %s", w)
    return True


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
