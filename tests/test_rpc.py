"""Shared gRPC plumbing: address parsing, health readiness per service, socket hygiene, graceful stop."""

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import rpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("text,kind,target", [
    ("unix:///run/x/d.sock", "unix", "unix:///run/x/d.sock"),
    ("localhost:50051", "tcp", "localhost:50051"),
    ("0.0.0.0:0", "tcp", "0.0.0.0:0"),
    ("[::1]:8080", "tcp", "[::1]:8080"),
    ("inproc", "inproc", None),
    ("inproc:drafter", "inproc", None),
])
def test_parse_address(text, kind, target):
    a = rpc.parse_address(text)
    assert a.kind == kind and str(a) == text
    if target:
        assert a.target == target
    else:
        assert a.target.startswith("unix:///") and a.path.endswith(f"{a.name}.sock")


def test_parse_relative_unix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rpc.parse_address("unix:sub/d.sock").path == str(tmp_path / "sub" / "d.sock")


@pytest.mark.parametrize("text,needle", [
    ("", "empty"), ("localhost", "host:port"), ("h:abc", "port"), ("h:70000", "port"), ("unix:", "socket"),
    ("unix://rel/x", "absolute"), ("http://h:1", "scheme"), ("::1:80", "brackets"), ("inproc:a/b", "name"),
])
def test_parse_address_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        rpc.parse_address(text)


async def _status(ch, name):
    return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name))).status


def test_health_readiness_and_stop(tmp_path):
    sock = tmp_path / "deep" / "s.sock"
    addr = f"unix://{sock}"

    async def go():
        running = await rpc.start_server([], addr, [rpc.SERVICE_DRAFTER])
        async with rpc.open_channel(addr) as ch:
            assert await _status(ch, "") == SERVING
            assert await _status(ch, rpc.SERVICE_DRAFTER) == NOT_SERVING
            waiter = asyncio.ensure_future(rpc.wait_ready(ch, rpc.SERVICE_DRAFTER))
            with pytest.raises(TimeoutError, match="not ready"):
                await rpc.wait_ready(ch, "no.such.Service", timeout=0.3)
            assert not waiter.done()
            await running.set_ready(rpc.SERVICE_DRAFTER)
            await asyncio.wait_for(waiter, 10)
            with pytest.raises(OSError, match="already listening"):       # a live socket is not stolen
                await rpc.start_server([], addr, [])
            await running.stop(0)
            await running.stop(0)                                          # idempotent
        assert not sock.exists()

    asyncio.run(go())


def test_stale_socket_is_replaced_and_tcp_port_resolved(tmp_path):
    sock = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))                     # a socket file nobody listens on: a crashed server's leftover
    s.close()

    async def go():
        running = await rpc.start_server([], f"unix://{sock}", [])
        await running.stop(0)
        tcp = await rpc.start_server([], "127.0.0.1:0", [])
        assert tcp.address.port > 0 and tcp.address.kind == "tcp"
        async with rpc.open_channel(tcp.address.target) as ch:
            await rpc.wait_ready(ch, "", timeout=10)
            with pytest.raises(OSError):
                await rpc.start_server([], tcp.address.target, [])
        await tcp.stop(0)

    asyncio.run(go())


def test_wait_ready_unimplemented_is_an_error(tmp_path):
    # a grpc server without the health service: wait_ready says so instead of waiting forever
    async def go():
        server = grpc.aio.server()
        server.add_insecure_port(f"unix://{tmp_path}/bare.sock")
        await server.start()
        try:
            async with rpc.open_channel(f"unix://{tmp_path}/bare.sock") as ch:
                with pytest.raises(RuntimeError, match="no grpc.health"):
                    await rpc.wait_ready(ch, "", timeout=10)
        finally:
            await server.stop(0)

    asyncio.run(go())
