"""`specsplit serve`: gateway, verifier and drafter in ONE process, for a first try or a single machine.

The drafter runs inside the verifier (no Draft stream at all); the verifier listens on a private
in-process address (a unix socket in a 0700 temporary folder, see services.rpc); the gateway's HTTP API
listens on --host:--port. Without --model the embedded default model pair is used.

Every flag can also come from an environment variable SPECSPLIT_<FLAG> (see `specsplit gateway -h`).
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
from services.engine.errors import SpecsplitError
from services.gateway.cli import add_gateway_arguments, setup_logging
from services.verifier.cli import startup_plan

VERIFIER_ADDRESS = "inproc:verifier"

log = logging.getLogger("specsplit.serve")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run gateway + verifier + drafter in one process",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_env_argument(p, "--model", default=None,
                     help="target model: GGUF file or HF folder (default: the embedded default model)")
    add_env_argument(p, "--draft", default=None,
                     help="DFlash drafter: z-lab folder or GGUF (default with --model: none, plain decoding)")
    add_env_argument(p, "--budget", type=parse_budget, default="auto",
                     help="DDTree budget: N nodes, 'chain', or 'auto'")
    add_env_argument(p, "--slots", type=int_at_least(1), default=1, help="concurrent generations (KV slots)")
    add_env_argument(p, "--max-queue", type=int_at_least(0), default=16,
                     help="requests that may wait for a slot; more get HTTP 429")
    add_env_argument(p, "--max-ctx", type=int_at_least(1), default=None, help="context per request (default: model's)")
    add_env_argument(p, "--no-speculative", action="store_true", help="plain decoding even with a drafter")
    add_env_argument(p, "--cache-type-k", type=kv_cache_type, default="auto", help=KV_CACHE_HELP.format(side="keys"))
    add_env_argument(p, "--cache-type-v", type=kv_cache_type, default="auto",
                     help=KV_CACHE_HELP.format(side="values"))
    add_env_argument(p, "--grpc-listen", default=None, help="also serve the public gRPC Gateway API here")
    add_gateway_arguments(p)
    add_device_arguments(p)
    add_env_argument(p, "--json", action="store_true", help="with --plan-only: print the plan as JSON")
    p.set_defaults(func=cmd_serve)


def resolve_models(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """(target, drafter) paths: as given, or the embedded default pair when --model is omitted."""
    if model:
        return model, draft
    if draft:
        raise SpecsplitError("--draft needs --model (the drafter belongs to a target model)")
    try:
        from services.engine.default_model import default_model_paths
    except ImportError:
        raise SpecsplitError("no embedded default model is available in this installation; "
                             "pass --model TARGET [--draft DRAFTER]") from None
    target, drafter = default_model_paths()
    return str(target), (str(drafter) if drafter else None)


# The name clients send and /v1/models lists for the embedded pair.
DEFAULT_MODEL_NAME = "specsplit-code-tiny"


def cmd_serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    embedded = not args.model
    model, draft = resolve_models(args.model, args.draft)
    if not startup_plan(args, model, draft):
        return 0
    if embedded and not args.model_name:
        args.model_name = DEFAULT_MODEL_NAME
    try:
        return asyncio.run(_main(args, model, draft))
    except (ValueError, OSError) as e:
        raise SpecsplitError(f"cannot start: {e}") from None


async def _main(args: argparse.Namespace, model: str, draft: str | None) -> int:
    from services import telemetry
    from services.gateway.server import GatewayConfig, serve_gateway
    from services.verifier.service import VerifierConfig, serve_verifier

    # One provider for the whole process: gateway, verifier and drafter spans land in the same trace.
    telemetry.configure_tracing(args.trace, "specsplit")
    vcfg = VerifierConfig(model=model, draft=draft, budget=args.budget, slots=args.slots,
                          max_queue=args.max_queue, max_ctx=args.max_ctx, speculative=not args.no_speculative,
                          trace=None, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                          device=args.device, draft_device=args.draft_device)
    verifier = await serve_verifier(vcfg, VERIFIER_ADDRESS, wait=False)
    try:
        gateway = await serve_gateway(GatewayConfig(
            model=model, verifiers=[str(verifier.address)], host=args.host, port=args.port,
            grpc_listen=args.grpc_listen or None, model_name=args.model_name or None, trace=None,
            request_timeout=args.request_timeout or None, ping_interval=args.ping_interval))
    except BaseException:
        await verifier.stop(0)
        raise
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    async def stop_all() -> None:
        await gateway.stop()             # no new requests, open streams finish (or time out) first
        await verifier.stop()

    def on_signal(name: str) -> None:
        log.info("%s: shutting down", name)
        if not stopping:
            stopping.append(loop.create_task(stop_all()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    log.info("specsplit serve: %s (target %s, drafter %s)", gateway.url, model, draft or "none")
    try:
        await verifier.wait_loaded()
    except asyncio.CancelledError:        # a signal during the load
        pass
    except Exception as e:
        await gateway.stop(0)
        await verifier.stop(0)
        raise SpecsplitError(f"cannot load the model: {e}") from e
    await gateway.wait_for_termination()
    if stopping:
        await stopping[0]
    return 0
