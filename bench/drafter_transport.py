"""Features transport to the drafter: inline bytes vs shared memory, over a unix socket.

A stand-in Drafter (separate process, no model) decodes each request's features exactly as the real
service does (FeatureReader: copy out of the message or the mapped segment) and answers a block of top-8
ids, so the time is the transport's. Payload per step: Qwen3.6-27B sized, 16 rows x 5 layers x 5120, f16.
Prints ms per step for each and the ratio shm / inline (below 1: shared memory is faster).

With --prompt N: a prompt's N feature rows (f32, as the verifier sends a GPU target's) to a new stream, then a
draft, in one message with the draft (what a drafter without appends gets) against appends of
speculative.PROMPT_APPEND_ROWS rows (DraftRequest.top_k 0) before it, each way over both transports; a message past
gRPC's limit (services/rpc.MAX_MESSAGE_BYTES) is refused, which is what appends avoid. Medians of --prompt-rounds
requests each way, and the shm appends again with a new segment per request (the connection's pool off), and the
appends as f16 on the wire (what `--draft-features auto` sends a drafter across hosts: converted on this host here,
on the device beside a GPU target) against f32, each transport.

    python bench/drafter_transport.py [--steps 200] [--rows 16] [--width 25600] [--dtype f16] [--prompt 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services import rpc  # noqa: E402
from services.drafter import client as client_mod  # noqa: E402
from services.drafter.client import DrafterClient  # noqa: E402
from services.drafter.service import FeatureReader  # noqa: E402
from services.engine.speculative import PROMPT_APPEND_ROWS, DrafterUnavailableError  # noqa: E402
from services.wire import pb, pb_grpc  # noqa: E402

POSITIONS, TOP_K = 15, 8


class CopyOnlyDrafter(pb_grpc.DrafterServicer):
    def __init__(self, width: int):
        self.width = width

    async def Info(self, request, context):
        return pb.DrafterInfo(block_size=POSITIONS + 1, target_layer_ids=[0], hidden_size=self.width, n_vocab=1000,
                              appends=True)

    async def Draft(self, request_iterator, context):
        reader = FeatureReader(self.width)
        ids = list(range(POSITIONS * TOP_K))
        logp = [-1.0] * (POSITIONS * TOP_K)
        try:
            async for req in request_iterator:
                feats = reader.read(req.features) if req.HasField("features") else None
                assert feats is None or feats.shape[1] == self.width
                if req.top_k == 0:      # an append
                    yield pb.DraftResponse(positions=0, top_k=0)
                    continue
                yield pb.DraftResponse(positions=POSITIONS, top_k=TOP_K, token_ids=ids, logprobs=logp)
        finally:
            reader.close()


def serve(address: str, width: int) -> None:
    async def main() -> None:
        running = await rpc.start_server([(pb_grpc.add_DrafterServicer_to_server, CopyOnlyDrafter(width))],
                                         address, [rpc.SERVICE_DRAFTER])
        running.set_ready(rpc.SERVICE_DRAFTER)
        await running.wait_for_termination()

    asyncio.run(main())


def run(address: str, transport: str, feats: np.ndarray, steps: int) -> float:
    """Seconds per propose() over `steps` steps (after a few warm-up steps)."""
    with DrafterClient(address, transport=transport) as client:
        start = 0
        for _ in range(5):
            start += len(feats)
            client.propose(feats, 0, start, TOP_K)
        t0 = time.perf_counter()
        for _ in range(steps):
            start += len(feats)
            client.propose(feats, 0, start, TOP_K)
        return (time.perf_counter() - t0) / steps


def prompt_once(address: str, transport: str, feats: np.ndarray, appends: bool,
                dtype: str | None = None) -> float | None:
    """Seconds for a prompt's rows and a first draft on a new stream (None: the drafter refused the message)."""
    with DrafterClient(address, transport=transport, feature_dtype=dtype) as client:
        client.info()
        t0 = time.perf_counter()
        try:
            if appends:
                for a in range(0, len(feats), PROMPT_APPEND_ROWS):
                    part = feats[a:a + PROMPT_APPEND_ROWS]
                    client.append_features(part, a + len(part))
                client.propose(None, 0, len(feats), TOP_K)
            else:
                client.propose(feats, 0, len(feats), TOP_K)
        except DrafterUnavailableError:
            return None
        return time.perf_counter() - t0


def prompts(address: str, rows: int, width: int, rounds: int) -> None:
    feats = np.random.default_rng(1).standard_normal((rows, width)).astype(np.float32)
    def median(transport: str, appends: bool, dtype: str | None = None) -> float | None:
        # one way's requests one after another, as a server's (a stream's shm segment serves the next one's);
        # the median: a request's own costs (a new segment's) vary more than a best-of shows
        ts = [prompt_once(address, transport, feats, appends, dtype) for _ in range(rounds)]
        return None if None in ts else statistics.median(ts)

    best = {(t, a): median(t, a) for t in ("inline", "shm") for a in (False, True)}
    mb = feats.nbytes / 2**20
    print(f"prompt of {rows} rows x {width} f32 = {mb:.1f} MiB, then a first draft; gRPC message limit "
          f"{rpc.MAX_MESSAGE_BYTES / 2**20:.0f} MiB; median of {rounds}")
    for transport in ("inline", "shm"):
        one, app = best[(transport, False)], best[(transport, True)]
        text = "refused (past the message limit)" if one is None else f"{one * 1e3:8.2f} ms"
        line = f"  {transport:6s} one message {text}; appends of {PROMPT_APPEND_ROWS} rows "
        line += "failed" if app is None else f"{app * 1e3:8.2f} ms"
        if one is not None and app is not None:
            line += f"; appends / one message {app / one:.3f}"
        print(line)
    # the same appends over shm without the connection's segment pool (a new segment per request, as before it)
    keep = client_mod.SEGMENT_POOL
    client_mod.SEGMENT_POOL = 0
    try:
        fresh = median("shm", True) or float("inf")
    finally:
        client_mod.SEGMENT_POOL = keep
    pooled = best[("shm", True)]
    print(f"  shm appends with a new segment per request {fresh * 1e3:8.2f} ms"
          + (f"; pooled / new {pooled / fresh:.3f}" if pooled else ""))
    for transport in ("inline", "shm"):
        half, full = median(transport, True, "f16"), best[(transport, True)]
        print(f"  {transport:6s} appends as f16 on the wire {half * 1e3:8.2f} ms"
              + (f"; f16 / f32 {half / full:.3f}" if full else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=5 * 5120)
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--rounds", type=int, default=3, help="alternating inline/shm rounds; the best of each counts")
    ap.add_argument("--prompt", type=int, default=0, help="also: a prompt of this many feature rows (f32)")
    ap.add_argument("--prompt-rounds", type=int, default=7, help="requests of each way with --prompt (median)")
    args = ap.parse_args()

    feats = np.random.default_rng(0).standard_normal((args.rows, args.width)).astype(
        np.float16 if args.dtype == "f16" else np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix://{tmp}/bench.sock"
        proc = mp.get_context("spawn").Process(target=serve, args=(address, args.width), daemon=True)
        proc.start()
        try:
            DrafterClient(address, wait_ready=True, ready_timeout=60).close()
            best = {"inline": float("inf"), "shm": float("inf")}
            for _ in range(args.rounds):
                for transport in best:
                    best[transport] = min(best[transport], run(address, transport, feats, args.steps))
            if args.prompt:
                prompts(address, args.prompt, args.width, args.prompt_rounds)
        finally:
            proc.terminate()
            proc.join()
    mb = feats.nbytes / 2**20
    print(f"payload {args.rows} x {args.width} {args.dtype} = {mb:.2f} MiB per step, unix socket, "
          f"{args.steps} steps x {args.rounds} rounds (best)")
    for t, s in best.items():
        print(f"  {t:6s} {s * 1e3:8.3f} ms/step  {mb / s:8.0f} MiB/s")
    print(f"shm/inline time ratio: {best['shm'] / best['inline']:.3f}")


if __name__ == "__main__":
    main()
