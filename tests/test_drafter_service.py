"""The Drafter service in its own process: the same proposals as the in-process drafter (inline and shared
memory), bounded sessions, bad requests refused without harm, a dead drafter turns into a fallback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services import rpc
from services.drafter.client import DrafterClient
from services.engine.generate import GenerationResult
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.speculative import DrafterUnavailableError, LocalProposer, SpecConfig, speculative_stream
from services.wire import pb, pb_grpc

ROOT = Path(__file__).resolve().parents[1]


def spawn_drafter(tiny_pair, sock: Path, max_sessions: int = 2, extra: tuple[str, ...] = ()
                  ) -> tuple[subprocess.Popen, str]:
    """Start `python -m services drafter` (with `extra` flags) and block until its health says the Drafter is
    SERVING."""
    _, target, draft = tiny_pair
    addr = f"unix://{sock}"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "services", "drafter", "--model", target, "--draft", draft,
                             "--listen", addr, "--max-sessions", str(max_sessions), "--log-level", "WARNING",
                             *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)

    async def ready() -> None:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def watch() -> None:
            proc.wait()
            try:
                loop.call_soon_threadsafe(lambda: exited.done() or exited.set_result(None))
            except RuntimeError:        # the drafter outlived this wait (the normal case)
                pass

        # a daemon thread, not the loop's executor: asyncio.run would join it while the drafter runs on
        threading.Thread(target=watch, daemon=True).start()
        async with rpc.open_channel(addr) as ch:
            waiting = asyncio.ensure_future(rpc.wait_ready(ch, rpc.SERVICE_DRAFTER, timeout=120))
            done, _ = await asyncio.wait({waiting, exited}, return_when=asyncio.FIRST_COMPLETED)
            if waiting not in done:
                waiting.cancel()
                raise RuntimeError(f"the drafter exited with {proc.returncode}:\n{proc.stderr.read()}")
            waiting.result()

    try:
        asyncio.run(ready())
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, addr


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def drafter_addr(tiny_pair, tmp_path_factory):
    proc, addr = spawn_drafter(tiny_pair, tmp_path_factory.mktemp("drafter") / "d.sock")
    yield addr
    stop(proc)
    assert proc.returncode == 0, proc.stderr.read()


@pytest.fixture(scope="module")
def local(tiny_pair):
    _, target, draft = tiny_pair
    model = load_target(target, with_tokenizer=False).model
    return model, load_drafter(draft, model)


def feature_steps(drafter, seed=0):
    """(features, last_token, start) per step: a prompt's worth of rows, then a few per step."""
    rng = np.random.default_rng(seed)
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    start = 0
    steps = []
    for rows in (7, 1, 4, 0, 16, 3):
        feats = rng.standard_normal((rows, width)).astype(np.float32) if rows else None
        start += rows
        steps.append((feats, int(rng.integers(0, drafter.n_vocab)), start))
    return steps


@pytest.mark.parametrize("transport,dtype", [("inline", None), ("shm", None), ("inline", "f16"), ("shm", "f16")])
def test_proposals_equal_in_process(drafter_addr, local, transport, dtype):
    _, drafter = local
    ref = LocalProposer(drafter)
    with DrafterClient(drafter_addr, transport=transport, feature_dtype=dtype) as client:
        assert client.transport == transport
        assert client.block_size == drafter.block_size
        assert client.target_layer_ids == drafter.target_layer_ids
        for feats, last, start in feature_steps(drafter):
            sent = feats.astype(np.float16).astype(np.float32) if dtype == "f16" and feats is not None else feats
            for k in (1, 8):
                if k == 8:      # the same block again: the context must not grow twice
                    feats = sent = None
                ids, logp = client.propose(feats, last, start, k)
                want_ids, want_logp = ref.propose(sent, last, start, k)
                assert ids.dtype == np.int64 and ids.shape == (drafter.block_size - 1, k)
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)


def test_auto_transport_and_info(drafter_addr, local):
    _, drafter = local
    client = DrafterClient(drafter_addr, wait_ready=True, ready_timeout=30)
    assert client.transport == "shm"                  # unix address
    info = client.info()
    assert (info.block_size, info.target_layer_ids, info.mask_token_id) == \
        (drafter.block_size, drafter.target_layer_ids, drafter.mask_token_id)
    assert (info.hidden_size, info.n_vocab, info.max_sessions) == (drafter.cfg.n_embd, drafter.n_vocab, 2)
    client.close()
    client.close()
    assert DrafterClient("localhost:1", transport="auto").transport == "inline"
    with pytest.raises(ValueError, match="same host|this host"):
        DrafterClient("localhost:1", transport="shm")


def test_max_sessions(drafter_addr, local):
    _, drafter = local
    (feats, last, start), *_ = feature_steps(drafter)
    a, b = DrafterClient(drafter_addr), DrafterClient(drafter_addr)
    c, d = DrafterClient(drafter_addr), DrafterClient(drafter_addr)
    try:                                               # closed whatever happens: the module shares the drafter
        a.propose(feats, last, start, 1)
        b.propose(feats, last, start, 1)
        for _ in range(5):                             # the refusal's status, not INTERNAL, every time
            with pytest.raises(DrafterUnavailableError, match="RESOURCE_EXHAUSTED"):
                DrafterClient(drafter_addr).propose(feats, last, start, 1)
        with pytest.raises(DrafterUnavailableError, match="RESOURCE_EXHAUSTED"):
            c.propose(feats, last, start, 1)
        with pytest.raises(DrafterUnavailableError):   # a failed client stays failed
            c.propose(feats, last, start, 1)
        c.close()
        a.close()                                      # frees a session for the next request
        d.propose(feats, last, start, 1)
        assert d.info().active_sessions == 2
    finally:
        for cl in (a, b, c, d):
            cl.close()


def _raw_draft(addr, requests):
    """Send `requests` on one raw Draft stream; return the responses and the final status."""
    async def go():
        async with rpc.open_channel(addr) as ch:
            call = pb_grpc.DrafterStub(ch).Draft()
            out = []
            try:
                for r in requests:
                    await call.write(r)
                    out.append(await call.read())
                await call.done_writing()
                await call.read()
            except grpc.aio.AioRpcError:
                pass
            return out, await call.code(), await call.details()

    return asyncio.run(go())


def test_bad_requests_are_invalid_argument(drafter_addr, local):
    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    good = np.zeros((2, width), np.float32).tobytes()

    def req(rows=2, w=width, dtype="f32", data=good, start=2, last=1, k=1, shm=""):
        return pb.DraftRequest(features=pb.Features(rows=rows, width=w, dtype=dtype, data=data, shm_name=shm),
                               last_token=last, start=start, top_k=k)

    cases = {
        "width": req(w=width + 1),
        "start must be 2": req(start=3),
        "outside the vocabulary": req(last=drafter.n_vocab + 5),
        "dtype": req(dtype="bf16"),
        "bytes": req(data=good[:-4]),
        "top_k": req(k=-1),
        "an append (top_k 0) carries no feature rows": req(rows=0, data=b"", start=0, k=0),
        "cannot map shared memory": req(data=b"", shm="specsplit-no-such-segment"),
    }
    for needle, bad in cases.items():
        out, code, details = _raw_draft(drafter_addr, [bad])
        want = grpc.StatusCode.FAILED_PRECONDITION if "shared" in needle else grpc.StatusCode.INVALID_ARGUMENT
        assert code == want, (needle, code, details)
        assert needle in details
    # the drafter keeps serving, and a stream's bad request only ends that stream
    out, code, _ = _raw_draft(drafter_addr, [req(), req(rows=0, data=b"", start=2)])
    assert code == grpc.StatusCode.OK and len(out) == 2 and out[0].positions == drafter.block_size - 1
    with DrafterClient(drafter_addr, transport="inline") as client:
        with pytest.raises(DrafterUnavailableError, match="INVALID_ARGUMENT.*width"):
            client.propose(np.zeros((2, width + 3), np.float32), 1, 2, 1)
    assert DrafterClient(drafter_addr).info().active_sessions == 0


@pytest.mark.parametrize("transport,dtype", [("inline", None), ("shm", None), ("shm", "f16")])
def test_appends_then_drafts_equal_in_process(drafter_addr, local, transport, dtype):
    """A prompt's features as appends (DraftRequest.top_k 0: answered with 0 positions, each in flight while the
    caller runs on), then drafts: the proposals of the in-process drafter given the same appends. A bad append (a
    wrong start) fails the client at its next exchange, with the drafter's INVALID_ARGUMENT."""
    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    rng = np.random.default_rng(3)
    prompt = rng.standard_normal((40, width)).astype(np.float32)
    if dtype == "f16":
        prompt = prompt.astype(np.float16).astype(np.float32)
    ref = LocalProposer(drafter)
    with DrafterClient(drafter_addr, transport=transport, feature_dtype=dtype) as client:
        assert client.info().appends
        for a, b in ((0, 16), (16, 32)):
            client.append_features(prompt[a:b], b)
            ref.append_features(prompt[a:b], b)
        steps = [(prompt[32:], 7, 40), (prompt[:3] * 0.5, 11, 43), (None, 2, 43)]
        for feats, last, start in steps:
            ids, logp = client.propose(feats, last, start, 8)
            want_ids, want_logp = ref.propose(feats, last, start, 8)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)
        client.append_features(prompt[:5], 44)          # the context holds 43: start must be 48
        with pytest.raises(DrafterUnavailableError, match="INVALID_ARGUMENT.*start must be 48"):
            client.propose(None, 1, 44, 1)
    assert DrafterClient(drafter_addr).info().active_sessions == 0


def _log_exchanges(client: DrafterClient) -> list[tuple[int, int, int]]:
    """(top_k, feature rows, start) of each request the client sends from now on."""
    sent = []
    exchange = client._exchange

    async def logged(req):
        sent.append((req.top_k, req.features.rows, req.start))
        return await exchange(req)

    client._exchange = logged
    return sent


def test_auto_feature_dtype_is_f16_inline_and_f32_through_shared_memory(drafter_addr, local):
    """`--draft-features auto`: f16 on the wire where features travel inline (half the bytes across a network), f32
    through shared memory; f16 saturates at +-65504 instead of sending an infinity, and features that can cast where
    they live (`to_host`: the GPU engine's device rows) are cast there. The proposals are the in-process drafter's
    given the same rounded features."""
    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    prompt = np.random.default_rng(5).standard_normal((20, width)).astype(np.float32)
    prompt[3, :4] = [1e6, -1e6, 7e4, 65504.0]
    assert DrafterClient("localhost:1", feature_dtype="auto").feature_dtype == "f16"
    casts = []

    class OnDevice:                     # the interface of the GPU engine's DeviceRows that the client uses
        def __init__(self, rows):
            self.rows, self.dtype = rows, np.dtype(np.float32)

        def __len__(self):
            return len(self.rows)

        def to_host(self, dtype):
            casts.append(np.dtype(dtype))
            return np.clip(self.rows, -65504, 65504).astype(dtype)

    for transport, wire in (("inline", "f16"), ("shm", "f32")):
        client = DrafterClient(drafter_addr, transport=transport, feature_dtype="auto")
        assert client.feature_dtype == wire
        seen = []
        exchange = client._exchange

        async def logged(req, exchange=exchange, seen=seen):
            seen.append(req.features.dtype)
            return await exchange(req)

        client._exchange = logged
        ref = LocalProposer(drafter)
        sent = np.clip(prompt, -65504, 65504).astype(np.float16).astype(np.float32) if wire == "f16" else prompt
        assert wire == "f32" or (np.isfinite(sent).all() and sent[3, 0] == 65504.0 and sent[3, 1] == -65504.0)
        with client:
            client.append_features(prompt[:12], 12)
            ref.append_features(sent[:12], 12)
            ids, logp = client.propose(OnDevice(prompt[12:]), 4, 20, 4)
            want_ids, want_logp = ref.propose(sent[12:], 4, 20, 4)
        assert seen == [wire, wire]
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)
    assert casts == [np.dtype(np.float16), np.dtype(np.float32)]
    with pytest.raises(ValueError, match="feature_dtype must be one of auto, f32, f16"):
        DrafterClient(drafter_addr, feature_dtype="bf16")


def test_a_drafter_without_appends_gets_them_with_the_next_draft(drafter_addr, local):
    """Info without `appends` (a drafter from before them): the client holds the appended features and sends them
    with the next draft, one message as before; the proposals are the same."""
    import dataclasses

    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    prompt = np.random.default_rng(4).standard_normal((30, width)).astype(np.float32)
    ref = LocalProposer(drafter)
    ref.append_features(prompt[:20], 20)
    want = ref.propose(prompt[20:], 5, 30, 4)
    client = DrafterClient(drafter_addr, transport="inline")
    conn = client._conn
    try:
        conn._info = dataclasses.replace(client.info(), appends=False)
        sent = _log_exchanges(client)
        client.append_features(prompt[:12], 12)
        client.append_features(prompt[12:20], 20)
        ids, logp = client.propose(prompt[20:], 5, 30, 4)
        assert sent == [(4, 30, 30)]
        np.testing.assert_array_equal(ids, want[0])
        np.testing.assert_allclose(logp, want[1], rtol=1e-6, atol=1e-6)
    finally:
        client.close()
        conn.forget_info()


def test_features_past_the_message_limit_are_a_clear_error(drafter_addr, local, monkeypatch):
    """Inline features past gRPC's message limit (which gRPC would refuse as INTERNAL) fail the client with what to
    change, before anything is sent; appends of the same rows go through."""
    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    monkeypatch.setattr(rpc, "MAX_MESSAGE_BYTES", (1 << 16) + 64 * width * 4)   # the client checks 64 rows
    feats = np.ones((65, width), np.float32)
    with DrafterClient(drafter_addr, transport="inline") as client:
        with pytest.raises(DrafterUnavailableError, match="past gRPC's 0 MiB message limit"):
            client.propose(feats, 1, 65, 1)
    with DrafterClient(drafter_addr, transport="inline") as client:
        client.append_features(feats[:40], 40)
        client.append_features(feats[40:], 65)
        assert client.propose(None, 1, 65, 1)[0].shape == (drafter.block_size - 1, 1)


def test_a_long_prompt_goes_to_the_drafter_service_in_appends(drafter_addr, local):
    """speculative_stream with the service: a 300-token prompt (the NumPy target's one chunk) goes as an append of
    300 rows before the first draft, which brings none; the tokens are the in-process drafter's."""
    model, drafter = local
    prompt = np.random.default_rng(6).integers(0, model.cfg.n_vocab, 300).tolist()

    def run(proposer):
        res = GenerationResult()
        for _ in speculative_stream(model, proposer, prompt, 24, spec=SpecConfig(budget=7), result=res):
            pass
        return res

    want = run(LocalProposer(drafter))
    client = DrafterClient(drafter_addr)
    sent = _log_exchanges(client)
    got = run(client)
    assert got.token_ids == want.token_ids and not got.spec["fallback"]
    assert got.spec["accepted"] == want.spec["accepted"]
    assert sent[0] == (0, 300, 300) and sent[1][1:] == (0, 300) and sent[1][0] >= 1


def test_reflection_lists_services(drafter_addr):
    with rpc.open_sync_channel(drafter_addr) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {rpc.SERVICE_DRAFTER, rpc.HEALTH_SERVICE, rpc.REFLECTION_SERVICE} <= services


@pytest.mark.parametrize("budget", [None, 22])
def test_speculative_stream_same_tokens(drafter_addr, local, budget):
    model, drafter = local
    prompt = [5, 17, 99, 3, 42, 8, 250, 11]

    def run(proposer):
        res = GenerationResult()
        for _ in speculative_stream(model, proposer, prompt, 30, spec=SpecConfig(budget=budget), result=res):
            pass
        return res

    want = run(LocalProposer(drafter))
    got = run(DrafterClient(drafter_addr))
    assert got.token_ids == want.token_ids
    assert not got.spec["fallback"] and got.spec["steps"] == want.spec["steps"] > 0
    assert got.spec["accepted"] == want.spec["accepted"]
    # the service's own drafting time is reported beside the client's wait; in process there is none to report
    assert got.spec["drafter_ms"] > 0 and want.spec["drafter_ms"] == 0


def test_killed_drafter_is_unavailable(tiny_pair, local, tmp_path):
    _, drafter = local
    proc, addr = spawn_drafter(tiny_pair, tmp_path / "k.sock")
    try:
        steps = feature_steps(drafter)
        client = DrafterClient(addr, timeout=10)
        client.propose(*steps[0], 1)
        proc.kill()
        proc.wait()
        pending = client.propose_begin(*steps[1], 1)    # sent without waiting: the answer's wait fails
        with pytest.raises(DrafterUnavailableError, match=addr):
            pending()
        with pytest.raises(DrafterUnavailableError, match=addr):
            client.propose(*steps[1], 1)
        client.close()
        with pytest.raises(DrafterUnavailableError):      # a new client (shared channel) fails as well
            DrafterClient(addr, timeout=10).propose(*steps[0], 1)
    finally:
        stop(proc)


def test_unreachable_drafter(tmp_path):
    addr = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(DrafterUnavailableError, match="not ready after"):
        DrafterClient(addr, wait_ready=True, ready_timeout=0.5)
    lazy = DrafterClient(addr, timeout=5)             # nothing contacted yet
    assert lazy.block_size == 16 and lazy.target_layer_ids == []    # Info failed: the client is failed
    with pytest.raises(DrafterUnavailableError, match="UNAVAILABLE"):
        lazy.propose(None, 1, 0, 1)
    lazy.close()


def test_context_past_the_sessions_is_resource_exhausted():
    """A GPU drafter's sessions are made for --max-ctx at start-up (max_rows = context + a block): a request past
    it is refused with RESOURCE_EXHAUSTED (the client then decodes without drafting), not grown mid-request."""
    from types import SimpleNamespace

    from services.drafter.service import ContextFull, DrafterServicer

    fake = SimpleNamespace(target=SimpleNamespace(tok_embd=SimpleNamespace(shape=(100, 8))), target_layer_ids=[1],
                           cfg=SimpleNamespace(n_embd=8), block_size=16, max_rows=64 + 16)
    sv = DrafterServicer(max_sessions=1)
    sv.attach(fake)
    session = SimpleNamespace(n_ctx=60)
    sv._check(pb.DraftRequest(start=64, last_token=1, top_k=1), session, np.zeros((4, 8), np.float32))
    with pytest.raises(ContextFull, match="past the 64-token context"):
        sv._check(pb.DraftRequest(start=65, last_token=1, top_k=1), SimpleNamespace(n_ctx=61),
                  np.zeros((4, 8), np.float32))


def test_drafter_device_flag_is_checked(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as e:
        main(["drafter", "--model", "m.gguf", "--draft", "d.gguf", "--device", "tpu"])
    assert e.value.code == 2 and "expected a device" in capsys.readouterr().err


def test_streams_on_one_connection_reuse_shared_memory_segments(drafter_addr, local, monkeypatch):
    """A stream that ended with every exchange answered leaves its segment to the connection's next stream (the
    same name, no new segment per request); one past SEGMENT_KEEP_BYTES, or a failed stream's, is unlinked."""
    from multiprocessing import shared_memory

    from services.drafter import client as C

    _, drafter = local
    width = len(drafter.target_layer_ids) * drafter.cfg.n_embd
    feats = np.random.default_rng(8).standard_normal((20, width)).astype(np.float32)
    ref = LocalProposer(drafter)
    want = ref.propose(feats, 3, 20, 4)
    names = []
    for _ in range(2):
        with DrafterClient(drafter_addr, transport="shm") as client:
            ids, _ = client.propose(feats, 3, 20, 4)
            np.testing.assert_array_equal(ids, want[0])
            names.append(client._segment.shm.name)
    assert names[0] == names[1]
    # too big to keep: unlinked when its stream ends
    monkeypatch.setattr(C, "SEGMENT_KEEP_BYTES", 1024)
    with DrafterClient(drafter_addr, transport="shm") as client:
        client.propose(feats, 3, 20, 4)
        big = client._segment.shm.name
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=big)
    # a failed stream's segment is not handed on
    monkeypatch.setattr(C, "SEGMENT_KEEP_BYTES", 64 << 20)
    with DrafterClient(drafter_addr, transport="shm") as client:
        with pytest.raises(DrafterUnavailableError):
            client.propose(feats, 3, 21, 4)       # the context would hold 20: start must be 20
        failed = client._segment.shm.name
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=failed)


def test_feature_reader_widens_f16_unless_the_drafter_takes_it():
    """FeatureReader: f16 rows off the wire become float32 for the NumPy drafter, and stay float16 for a drafter that
    widens them itself (a GPU drafter's takes_f16_features: half the upload, no host conversion); f32 rows are float32
    either way; the values are the same."""
    from services.drafter.service import FeatureReader
    from services.engine.models.dflash import DFlashDrafter
    from services.engine.models.dflash_gpu import DFlashGpuDrafter

    assert DFlashGpuDrafter.takes_f16_features and not getattr(DFlashDrafter, "takes_f16_features", False)
    rows = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float16)
    msg16 = pb.Features(rows=3, width=8, dtype="f16", data=rows.tobytes())
    msg32 = pb.Features(rows=3, width=8, dtype="f32", data=rows.astype(np.float32).tobytes())
    for keep in (False, True):
        reader = FeatureReader(8, keep_f16=keep)
        got16, got32 = reader.read(msg16), reader.read(msg32)
        assert got16.dtype == (np.float16 if keep else np.float32) and got32.dtype == np.float32
        assert got16.shape == got32.shape == (3, 8) and np.array_equal(got16.astype(np.float32), got32)


def test_the_service_loads_only_the_targets_table_and_head(tiny_pair, local, monkeypatch):
    """The drafter service reads of its target the token table and the LM head (loader.load_target_head), never
    its blocks: a 27B's would be ~100 GB of float32 in the NumPy engine. The head is the target model's own values;
    packed (a GPU drafter's), the tensor as stored."""
    from services.drafter.service import DrafterConfig, load
    from services.engine.formats import RawTensor
    from services.engine.loader import TargetHead, load_target_head
    from services.engine.models.base import TargetModel

    _, target, draft = tiny_pair
    model, _ = local

    def no_blocks(*a, **k):
        raise AssertionError("the drafter service built the whole target")

    monkeypatch.setattr(TargetModel, "__init__", no_blocks)
    d = load(DrafterConfig(model=target, draft=draft, max_sessions=1))
    assert isinstance(d.target, TargetHead)
    head = load_target_head(target)
    assert head.cfg.n_embd == model.cfg.n_embd and head.cfg.n_layer == model.cfg.n_layer
    assert np.array_equal(head.output, model.output)
    ids = np.array([0, 3, int(head.tok_embd.shape[0]) - 1])
    assert np.array_equal(head.be.embed(head.tok_embd, ids), model.be.embed(model.tok_embd, ids))
    packed = load_target_head(target, packed=True)
    assert isinstance(packed.output, RawTensor) and np.array_equal(packed.output.dequantize(), model.output)


def test_gpu_drafts_run_on_the_event_loop_when_the_drafter_is_free():
    """A drafter with a device (use_device) drafts on the service's event loop, bound to its device there at attach,
    unless something else is in the drafter (a long prompt append on the drafting thread): then the draft queues on
    that thread after it. Never two callers in the drafter at once; a NumPy drafter always drafts off the loop."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from services.drafter.service import DrafterServicer

    bound = []
    gpu_like = SimpleNamespace(use_device=lambda: bound.append(threading.current_thread()),
                               target=SimpleNamespace(tok_embd=SimpleNamespace(shape=(10, 4))),
                               target_layer_ids=[0], cfg=SimpleNamespace(n_embd=4))
    numpy_like = SimpleNamespace(target=gpu_like.target, target_layer_ids=[0], cfg=gpu_like.cfg)

    async def run(servicer, drafter):
        loop_thread = threading.current_thread()
        servicer.attach(drafter)
        seen, active, overlap = [], [0], [False]

        def work(tag, seconds):
            active[0] += 1
            overlap[0] |= active[0] > 1
            seen.append((tag, threading.current_thread() is loop_thread))
            time.sleep(seconds)
            active[0] -= 1

        await servicer._call(work, "draft", 0.0, inline=servicer.inline_drafts)
        append = asyncio.ensure_future(servicer._call(work, "append", 0.3))
        await asyncio.sleep(0.05)
        await servicer._call(work, "draft while appending", 0.0, inline=servicer.inline_drafts)
        await append
        return loop_thread, seen, overlap[0]

    s = DrafterServicer(max_sessions=2)
    loop_thread, seen, overlap = asyncio.run(run(s, gpu_like))
    assert s.inline_drafts and bound == [loop_thread]
    assert seen == [("draft", True), ("append", False), ("draft while appending", False)] and not overlap
    s = DrafterServicer(max_sessions=2)
    _, seen, overlap = asyncio.run(run(s, numpy_like))
    assert not s.inline_drafts and [on_loop for _, on_loop in seen] == [False, False, False] and not overlap
