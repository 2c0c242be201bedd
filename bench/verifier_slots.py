"""Aggregate tokens/s of N concurrent requests against one request, through a running verifier, in one run.

A GPU verifier's slots take turns on the device step by step; a slot waiting for a drafter service's answer lets the
others step (services/verifier/service.py _EngineLock.released), so concurrent requests through a remote drafter
should add up to more than one. Prompts are random token ids (no stop ids: every request runs max_tokens), so a
synthetic model works; its drafts are rarely accepted, which makes the draft's wait a large share of each step.

    python3 bench/verifier_slots.py --verifier unix:///tmp/v.sock --concurrency 1 2 --max-tokens 48 --budget 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import rpc  # noqa: E402
from services.wire import pb, pb_grpc  # noqa: E402


def wait_info(channel: grpc.Channel, stub: pb_grpc.VerifierStub, timeout_s: float) -> pb.VerifierInfo:
    """The verifier's Info once its health says SERVING (it loads its model first)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    end = time.monotonic() + timeout_s
    while True:
        try:
            r = health.Check(health_pb2.HealthCheckRequest(service=rpc.SERVICE_VERIFIER), timeout=5.0)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return stub.Info(pb.InfoRequest(), timeout=5.0)
        except grpc.RpcError as e:
            if time.monotonic() > end:
                raise SystemExit(f"verifier not ready after {timeout_s:.0f} s: {e.code().name}: {e.details()}") \
                    from None
        if time.monotonic() > end:
            raise SystemExit(f"verifier not SERVING after {timeout_s:.0f} s")
        time.sleep(1.0)


def one_round(stub: pb_grpc.VerifierStub, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """len(prompts) requests started together: wall time from the first start to the last end, tokens, spec stats."""
    out: list = [None] * len(prompts)

    def run(i: int) -> None:
        req = pb.GenerateRequest(prompt_ids=prompts[i], max_tokens=args.max_tokens, speculative=not args.plain)
        if args.budget is not None:
            req.budget = args.budget
        chunks = list(stub.Generate(req, timeout=args.timeout_s))
        out[i] = (sum(len(c.token_ids) for c in chunks), chunks[-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(o is None for o in out):
        raise SystemExit("a request failed (see the verifier's log)")
    tokens = sum(n for n, _ in out)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "acceptance": [last.spec.mean_acceptance_length for _, last in out],
            "fallback": [bool(last.spec.fallback) for _, last in out]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", required=True, help="address of a running verifier")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="DDTree budget per request (default: the verifier's)")
    ap.add_argument("--plain", action="store_true", help="plain decoding instead of speculative")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--ready-s", type=float, default=300.0, help="how long the verifier may take to answer Info")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    channel = grpc.insecure_channel(rpc.parse_address(args.verifier).target)
    stub = pb_grpc.VerifierStub(channel)
    info = wait_info(channel, stub, args.ready_s)
    n_vocab = int(info.model.n_vocab) or 1000
    if max(args.concurrency) > info.slots:
        print(f"note: {max(args.concurrency)} concurrent requests on {info.slots} slots: the rest queue")
    rng = np.random.default_rng(0)
    res: dict = {"verifier": args.verifier, "label": args.label, "slots": info.slots,
                 "drafter": info.drafter_address, "rows": {}}
    one_round(stub, [rng.integers(0, n_vocab, args.prompt_len).tolist()], args)        # warm-up
    for c in args.concurrency:
        rounds = [one_round(stub, [rng.integers(0, n_vocab, args.prompt_len).tolist() for _ in range(c)], args)
                  for _ in range(args.rounds)]
        res["rows"][c] = {"tok_s": statistics.median(r["tok_s"] for r in rounds), "rounds": rounds}
    base = res["rows"][args.concurrency[0]]["tok_s"]
    print(f"== verifier_slots {args.label} ({args.verifier}, {info.slots} slots, drafter "
          f"{info.drafter_address or 'in process or none'}, {'plain' if args.plain else 'speculative'}, "
          f"{args.max_tokens} tokens a request)")
    for c, row in res["rows"].items():
        acc = [a for r in row["rounds"] for a in r["acceptance"]]
        fb = sum(f for r in row["rounds"] for f in r["fallback"])
        print(f"| {c} concurrent | {row['tok_s']:.1f} tok/s aggregate | {row['tok_s'] / base:.3f}x of "
              f"{args.concurrency[0]} | mean acceptance {statistics.mean(acc):.2f} | fallbacks {fb} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
