"""Features transport to the drafter: inline bytes vs shared memory, over a unix socket.

A stand-in Drafter (separate process, no model) decodes each request's features exactly as the real
service does (FeatureReader: copy out of the message or the mapped segment) and answers a block of top-8
ids, so the time is the transport's. Payload per step: Qwen3.6-27B sized, 16 rows x 5 layers x 5120, f16.
Prints ms per step for each and the ratio shm / inline (below 1: shared memory is faster).

    python bench/drafter_transport.py [--steps 200] [--rows 16] [--width 25600] [--dtype f16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services import rpc  # noqa: E402
from services.drafter.client import DrafterClient  # noqa: E402
from services.drafter.service import FeatureReader  # noqa: E402
from services.wire import pb, pb_grpc  # noqa: E402

POSITIONS, TOP_K = 15, 8


class CopyOnlyDrafter(pb_grpc.DrafterServicer):
    def __init__(self, width: int):
        self.width = width

    async def Info(self, request, context):
        return pb.DrafterInfo(block_size=POSITIONS + 1, target_layer_ids=[0], hidden_size=self.width, n_vocab=1000)

    async def Draft(self, request_iterator, context):
        reader = FeatureReader(self.width)
        ids = list(range(POSITIONS * TOP_K))
        logp = [-1.0] * (POSITIONS * TOP_K)
        try:
            async for req in request_iterator:
                feats = reader.read(req.features)
                assert feats is not None and feats.shape[1] == self.width
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=5 * 5120)
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--rounds", type=int, default=3, help="alternating inline/shm rounds; the best of each counts")
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
