"""`python -m services.healthcheck ADDR [SERVICE]`: exit 0 when a gRPC server reports SERVICE as SERVING.

A dependency-free stand-in for grpc_health_probe in container health checks (compose, exec probes): it
speaks grpc.health.v1 over any address the services accept (unix:///run/specsplit/x.sock, host:port).
SERVICE defaults to "" (the whole server, i.e. liveness); pass the service's full name for readiness,
e.g. specsplit.v1.Verifier. Exit status: 0 SERVING, 1 anything else (the reason goes to stderr).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, status text) of `service` at `address`."""
    from services.rpc import open_sync_channel

    try:
        channel = open_sync_channel(address)
    except ValueError as e:
        return False, str(e)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="unix:///path/x.sock or host:port")
    ap.add_argument("service", nargs="?", default="", help="service name (default: whole server)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = ap.parse_args(argv)
    ok, status = check(args.address, args.service, args.timeout)
    if not ok:
        print(f"{args.address} {args.service or '(server)'}: {status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
