"""The Verifier service over gRPC: a real `specsplit verifier` process on a unix socket.

What is pinned here: greedy output equals in-process plain decoding (with and without the drafter),
a dead drafter degrades to plain decoding instead of failing, cancellation and deadlines free the slot,
the bounded queue rejects with RESOURCE_EXHAUSTED instead of hanging, bad input is INVALID_ARGUMENT and
the service keeps serving; and (in-process) the verifier.generate span with its per-step children.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.generate import generate
from services.engine.loader import load_target
from services.wire import pb, pb_grpc

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "specsplit.v1.Verifier"
CALL_TIMEOUT = 120.0          # a safety net so a broken server fails the test instead of hanging it


class VerifierProcess:
    """`python -m services verifier ...` on a unix socket, waited on through its readiness health check."""

    def __init__(self, sock: Path, args: list[str], env: dict[str, str] | None = None):
        self.address = f"unix://{sock}"
        self.log = sock.with_suffix(".log")
        # the child also keeps this interpreter's extra import paths (e.g. wheels installed beside the system's)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services", "verifier", "--listen", self.address,
                                          *args], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self._wait_ready()

    def _wait_ready(self) -> None:
        # Health Watch streams status changes: no polling, no sleeps; wait_for_ready rides over the time
        # before the socket exists. A watcher thread turns an early process exit into a failure at once.
        health = health_pb2_grpc.HealthStub(self.channel)
        call = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), wait_for_ready=True,
                            timeout=CALL_TIMEOUT)
        threading.Thread(target=lambda: (self.proc.wait(), call.cancel()), daemon=True).start()
        try:
            for resp in call:
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    call.cancel()
                    return
        except grpc.RpcError:
            pass
        self.stop()
        raise AssertionError(f"verifier did not become ready:\n{self.log.read_text()}")

    def generate(self, timeout: float = CALL_TIMEOUT, **kw) -> tuple[list[int], pb.GenerateChunk, int]:
        """(all token ids, the last chunk, number of chunks)."""
        chunks = list(self.stub.Generate(pb.GenerateRequest(**kw), timeout=timeout))
        return [t for c in chunks for t in c.token_ids], chunks[-1], len(chunks)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_target(tiny_pair[1])


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    tok = target.tokenizer
    return [tok.encode(t) for t in ("def add(a, b):", "The quick brown", "Hello, how are you")] + [[5]]


@pytest.fixture(scope="module")
def verifier(tiny_pair, tmp_path_factory) -> Iterator[VerifierProcess]:
    """One slot, one queue place, the in-process drafter."""
    _, gguf, drafter = tiny_pair
    p = VerifierProcess(tmp_path_factory.mktemp("verifier") / "v.sock",
                        ["--model", gguf, "--draft", drafter, "--slots", "1", "--max-queue", "1"])
    yield p
    p.stop()


@pytest.fixture(scope="module")
def verifier_dead_drafter(tiny_pair, tmp_path_factory) -> Iterator[VerifierProcess]:
    """--drafter pointing where nothing listens; the model path comes from SPECSPLIT_MODEL (env flags)."""
    folder = tmp_path_factory.mktemp("verifier_dead")
    p = VerifierProcess(folder / "v.sock", ["--drafter", f"unix://{folder}/nobody.sock", "--budget", "chain"],
                        env={"SPECSPLIT_MODEL": tiny_pair[1]})
    yield p
    p.stop()


def test_greedy_matches_in_process_plain(verifier, target, prompts):
    for ids in prompts:
        want = generate(target.model, ids, 24).token_ids
        for speculative in (False, True):
            got, last, n_chunks = verifier.generate(prompt_ids=ids, max_tokens=24, speculative=speculative)
            assert got == want, (ids, speculative)
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == 24
            assert last.timings.decode_ms > 0 and last.timings.prompt_ms > 0
            if speculative:
                assert last.spec.mode == "ddtree" and 1 <= last.spec.budget <= 64   # auto: mean tree size
                # --budget auto may pause a drafter that does not pay (this random one) for plain steps
                assert last.spec.steps + last.spec.plain_steps > 0 and not last.spec.fallback
                assert (last.spec.draft_tokens > 0) == (last.spec.steps > 0)
                assert len(last.spec.acceptance_histogram) == 16
                # the first token, then one chunk per step (a plain step where --budget auto paused the drafter)
                assert n_chunks == last.spec.steps + last.spec.plain_steps + 1
            else:
                assert last.spec.mode == "off" and last.spec.steps == 0
                assert n_chunks == 24


def test_stop_ids_and_chain_budget(verifier, target, prompts):
    ids = prompts[0]
    want = generate(target.model, ids, 20).token_ids
    stop = want[7]
    got, last, _ = verifier.generate(prompt_ids=ids, max_tokens=20, stop_ids=[stop], budget=0)
    assert got == want[:want.index(stop) + 1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.spec.mode == "chain" and last.spec.steps > 0


def test_dead_drafter_falls_back_to_plain(verifier_dead_drafter, target, prompts):
    info = verifier_dead_drafter.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
    assert info.model.speculative and "nobody.sock" in info.drafter_address
    for ids in prompts[:2]:
        got, last, _ = verifier_dead_drafter.generate(prompt_ids=ids, max_tokens=12, timeout=60)
        assert got == generate(target.model, ids, 12).token_ids
        assert last.spec.fallback and last.spec.fallback_reason
        assert last.finish_reason == pb.FINISH_REASON_LENGTH


def test_cancel_frees_the_slot(verifier, prompts):
    call = verifier.stub.Generate(pb.GenerateRequest(prompt_ids=prompts[0], max_tokens=480), timeout=CALL_TIMEOUT)
    it = iter(call)
    next(it), next(it)                       # it is running: two engine steps came back
    call.cancel()
    t0 = time.perf_counter()
    got, last, _ = verifier.generate(prompt_ids=prompts[1], max_tokens=4)
    elapsed = time.perf_counter() - t0
    assert len(got) == 4 and last.finish_reason == pb.FINISH_REASON_LENGTH
    # 480 speculative steps take seconds; the slot came back after at most one of them.
    assert elapsed < 2.0, elapsed


def test_deadline_stops_generation(verifier, prompts):
    # As many tokens as a slot holds: on a fast CPU the tiny model runs 480 (mostly plain) steps in 0.35 s.
    info = verifier.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
    with pytest.raises(grpc.RpcError) as e:
        verifier.generate(prompt_ids=prompts[0], max_tokens=info.kv_cache.max_ctx - len(prompts[0]), timeout=0.1)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    t0 = time.perf_counter()
    got, _, _ = verifier.generate(prompt_ids=prompts[1], max_tokens=4)
    assert len(got) == 4 and time.perf_counter() - t0 < 2.0


def test_queue_full_is_resource_exhausted(verifier, prompts):
    # slots=1, max_queue=1: of 4 simultaneous requests one runs, one waits, two are turned away at once.
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def one() -> None:
        start.wait()
        try:
            verifier.generate(prompt_ids=prompts[2], max_tokens=100, timeout=60, speculative=True)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert sorted(c.name for c in codes) == ["OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]


@pytest.mark.parametrize("fields, needle", [
    ({"prompt_ids": [], "max_tokens": 4}, "empty"),
    ({"prompt_ids": [1, 99999], "max_tokens": 4}, "vocabulary"),
    ({"prompt_ids": [1, -3], "max_tokens": 4}, "vocabulary"),
    ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt_ids": [1], "max_tokens": 4, "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
    ({"prompt_ids": [1], "max_tokens": 4, "sampling": pb.SamplingParams(top_p=1.5)}, "top_p"),
    ({"prompt_ids": [1], "max_tokens": 4, "sampling": pb.SamplingParams(top_k=-2)}, "top_k"),
    ({"prompt_ids": [1], "max_tokens": 4, "stop_ids": [100000]}, "stop"),
    ({"prompt_ids": [1], "max_tokens": 4, "budget": -1}, "budget"),
    ({"prompt_ids": [7] * 600, "max_tokens": 4}, "context"),
])
def test_bad_requests_are_invalid_argument(verifier, fields, needle):
    with pytest.raises(grpc.RpcError) as e:
        verifier.generate(**fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()
    got, _, _ = verifier.generate(prompt_ids=[1, 2], max_tokens=2)   # still serving
    assert len(got) == 2


def test_out_of_memory_mid_request_fails_alone(tiny_pair, tmp_path, target, prompts):
    """An allocation that fails mid-request (injected: SPECSPLIT_INJECT_OOM=forward:3, the third forward pass
    after the verifier is ready) ends that request, after its first two tokens were streamed, with
    RESOURCE_EXHAUSTED naming what to change; its slot and state come back (one slot, no queue: a slot still held
    would turn the next request away) and the same process serves the next requests, plain and speculative."""
    p = VerifierProcess(tmp_path / "v.sock", ["--model", tiny_pair[1], "--draft", tiny_pair[2], "--budget", "chain",
                                              "--slots", "1", "--max-queue", "0"],
                        env={"SPECSPLIT_INJECT_OOM": "forward:3"})
    try:
        ids = prompts[0]
        want = generate(target.model, ids, 40).token_ids
        got: list[int] = []
        call = p.stub.Generate(pb.GenerateRequest(prompt_ids=ids, max_tokens=40, speculative=False),
                               timeout=CALL_TIMEOUT)
        with pytest.raises(grpc.RpcError) as e:
            for chunk in call:
                got += list(chunk.token_ids)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = e.value.details()
        assert "out of memory on cpu after 2 generated tokens" in details and "injected" in details
        assert "--max-ctx" in details and "verifier goes on serving" in details
        assert got == want[:2]               # the prefill's token, one decode step's; the third pass failed
        for speculative in (False, True):
            again, last, _ = p.generate(prompt_ids=ids, max_tokens=12, speculative=speculative)
            assert again == want[:12] and last.finish_reason == pb.FINISH_REASON_LENGTH
        info = p.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        assert info.active == 0 and info.queued == 0
    finally:
        p.stop()
    log = p.log.read_text()
    assert "allocation failure will be injected" in log and "ran out of memory on cpu" in log


def test_request_budget_is_capped_at_the_planned_width(tiny_pair, tmp_path, target, prompts):
    """A request may not verify a wider tree than the memory plan counted (the server's budget, or a chain):
    with --budget 3 a request's budget 200 runs as budget 3, and greedy output is unchanged."""
    p = VerifierProcess(tmp_path / "v.sock", ["--model", tiny_pair[1], "--draft", tiny_pair[2], "--budget", "3"])
    try:
        ids = prompts[1]
        got, last, _ = p.generate(prompt_ids=ids, max_tokens=16, budget=200, speculative=True)
        assert got == generate(target.model, ids, 16).token_ids
        assert last.spec.mode == "ddtree" and last.spec.budget == 15    # max(budget + 1, block 16) - 1
    finally:
        p.stop()


def test_info(verifier, target):
    info = verifier.stub.Info(pb.InfoRequest())
    assert info.model.id == target.name and info.model.arch == target.cfg.arch
    assert info.model.n_vocab == target.cfg.n_vocab and info.model.context_length == target.cfg.context_length
    assert info.model.speculative and info.slots == 1 and info.max_queue == 1 and info.backend == "numpy"


def test_sigterm_lets_the_running_request_finish(tiny_pair, tmp_path, prompts):
    p = VerifierProcess(tmp_path / "v.sock", ["--model", tiny_pair[1], "--grace", "30"])
    try:
        call = p.stub.Generate(pb.GenerateRequest(prompt_ids=prompts[0], max_tokens=200), timeout=CALL_TIMEOUT)
        it = iter(call)
        first = next(it)
        p.proc.terminate()
        rest = list(it)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert p.proc.wait(timeout=30) == 0
    finally:
        p.stop()


def test_spans_in_process(tiny_pair, tmp_path):
    """verifier.generate is a child of the caller's span; one spec.draft/verify/accept per spec step."""
    from opentelemetry import trace

    from services import telemetry
    from services.verifier.service import VerifierConfig, serve_verifier

    provider = telemetry.configure_tracing("memory", "test")
    mem = provider.memory_exporter

    async def main() -> pb.GenerateChunk:
        server = await serve_verifier(VerifierConfig(model=tiny_pair[1], draft=tiny_pair[2]),
                                      f"unix://{tmp_path}/v.sock")
        try:
            tracer = telemetry.get_tracer("test")
            async with grpc.aio.insecure_channel(server.address.target,
                                                 interceptors=telemetry.client_interceptors()) as ch:
                stub = pb_grpc.VerifierStub(ch)
                with tracer.start_as_current_span("client"):
                    chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt_ids=[1, 2, 3],
                                                                                max_tokens=10))]
            return chunks[-1]
        finally:
            await server.stop(1)

    last = asyncio.run(main())
    spans = mem.get_finished_spans()
    client = next(s for s in spans if s.name == "client")
    gen = next(s for s in spans if s.name == "verifier.generate")
    assert gen.parent is not None and gen.parent.span_id == client.context.span_id
    assert gen.context.trace_id == client.context.trace_id
    assert gen.attributes["gen_ai.usage.output_tokens"] == 10
    assert gen.attributes["gen_ai.request.max_tokens"] == 10
    assert gen.attributes["spec.steps"] == last.spec.steps > 0
    for name in ("spec.draft", "spec.verify", "spec.accept"):
        steps = [s for s in spans if s.name == name]
        assert len(steps) == last.spec.steps
        for s in steps:
            assert s.parent.span_id == gen.context.span_id
            assert s.attributes["spec.tree_size"] > 0 and "spec.accepted_length" in s.attributes
            assert gen.start_time <= s.start_time <= s.end_time <= gen.end_time
    assert trace.get_tracer_provider() is not None


def test_remote_drafter_layers_reach_the_calibration(tiny_pair, tmp_path, monkeypatch):
    """With --drafter ADDR and --budget auto, the verifier asks the drafter's Info once at start-up, so the memory
    plan and the tuner's calibration take the layers it reads (on a GPU: the graphs the loop replays); a drafter that
    does not answer yet leaves start-up to go on without them."""
    from services.drafter.service import DrafterConfig, serve_drafter
    from services.engine.budget import BudgetTuner
    from services.verifier.service import VerifierConfig, serve_verifier

    _, gguf, draft = tiny_pair
    seen = []
    real = BudgetTuner.measure.__func__

    def spy(cls, target, max_budget=64, capture=(), states=1):
        seen.append(tuple(capture))
        return real(cls, target, max_budget, capture=capture, states=states)

    monkeypatch.setattr(BudgetTuner, "measure", classmethod(spy))

    async def main() -> tuple[list[int], list[int] | None]:
        drafter = await serve_drafter(DrafterConfig(model=gguf, draft=draft), f"unix://{tmp_path}/d.sock")
        await drafter.wait_loaded()
        try:
            server = await serve_verifier(VerifierConfig(model=gguf, drafter_address=f"unix://{tmp_path}/d.sock",
                                                         budget="auto"), f"unix://{tmp_path}/v.sock")
            await server.stop(1)
            lonely = await serve_verifier(VerifierConfig(model=gguf, drafter_address=f"unix://{tmp_path}/none.sock",
                                                         budget="auto"), f"unix://{tmp_path}/v2.sock")
            await lonely.stop(1)
            return list(drafter.servicer.drafter.target_layer_ids), lonely.servicer._remote_layers
        finally:
            await drafter.stop(0)

    layers, unknown = asyncio.run(main())
    assert layers and seen[0] == tuple(layers)
    assert unknown is None and seen[1] == ()


def test_draft_features_reach_a_remote_drafter_in_the_chosen_dtype(tiny_pair, target, tmp_path, monkeypatch):
    """--draft-features: `auto` (the default) sends f16 to a drafter across a network (TCP: inline bytes) and f32
    through a unix socket's shared memory; `f16` / `f32` force it (CLI flag or SPECSPLIT_DRAFT_FEATURES); the
    output is plain decoding's either way, and a bad value is refused at start-up."""
    from services.cli import build_parser
    from services.drafter.service import DrafterConfig, FeatureReader, serve_drafter
    from services.verifier.cli import config_from_args
    from services.verifier.service import VerifierConfig, serve_verifier

    _, gguf, draft = tiny_pair
    prompt = target.tokenizer.encode("def add(a, b):")
    want = generate(target.model, prompt, 12).token_ids
    seen: list[str] = []
    read = FeatureReader.read

    def spy(self, f):
        if f.rows:
            seen.append(f.dtype)
        return read(self, f)

    monkeypatch.setattr(FeatureReader, "read", spy)

    async def run(listen: str, **kw) -> tuple[list[int], set[str]]:
        drafter = await serve_drafter(DrafterConfig(model=gguf, draft=draft), listen)
        await drafter.wait_loaded()
        seen.clear()
        try:
            server = await serve_verifier(VerifierConfig(model=gguf, drafter_address=str(drafter.address), budget=8,
                                                         **kw), f"unix://{tmp_path}/v.sock")
            try:
                async with grpc.aio.insecure_channel(server.address.target) as ch:
                    stub = pb_grpc.VerifierStub(ch)
                    tokens, last = [], None
                    async for c in stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_tokens=12)):
                        tokens += c.token_ids
                        last = c
                    assert last.spec.steps > 0 and not last.spec.fallback
            finally:
                await server.stop(1)
        finally:
            await drafter.stop(0)
        return tokens, set(seen)

    assert asyncio.run(run("127.0.0.1:0")) == (want, {"f16"})
    assert asyncio.run(run(f"unix://{tmp_path}/d.sock")) == (want, {"f32"})
    assert asyncio.run(run("127.0.0.1:0", draft_features="f32")) == (want, {"f32"})
    assert asyncio.run(run(f"unix://{tmp_path}/d.sock", draft_features="f16")) == (want, {"f16"})

    parser = build_parser()
    assert config_from_args(parser.parse_args(["verifier", "--model", "m.gguf"])).draft_features == "auto"
    monkeypatch.setenv("SPECSPLIT_DRAFT_FEATURES", "f16")
    assert config_from_args(build_parser().parse_args(["verifier", "--model", "m.gguf"])).draft_features == "f16"
    args = build_parser().parse_args(["verifier", "--model", "m.gguf", "--draft-features", "f32"])
    assert config_from_args(args).draft_features == "f32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verifier", "--model", "m.gguf", "--draft-features", "bf16"])
    with pytest.raises(ValueError, match="draft_features must be one of auto, f32, f16"):
        VerifierConfig(model=gguf, drafter_address="127.0.0.1:1", draft_features="f8")


def test_remote_drafter_in_process(tiny_pair, target, tmp_path):
    """--drafter with a live Drafter service: same output, spec steps, the drafter's spans in the trace;
    then the drafter dies mid-request and the request still completes, with plain decoding."""
    from services import telemetry
    from services.drafter.service import DrafterConfig, serve_drafter
    from services.verifier.service import VerifierConfig, serve_verifier

    mem = telemetry.configure_tracing("memory", "test").memory_exporter
    _, gguf, draft = tiny_pair
    prompt = target.tokenizer.encode("def add(a, b):")
    want = generate(target.model, prompt, 60).token_ids

    async def main() -> tuple[pb.GenerateChunk, list[int], pb.GenerateChunk]:
        drafter = await serve_drafter(DrafterConfig(model=gguf, draft=draft), f"unix://{tmp_path}/d.sock")
        await drafter.wait_loaded()
        # a fixed budget: --budget auto would rightly pause this random drafter for plain steps
        server = await serve_verifier(VerifierConfig(model=gguf, drafter_address=f"unix://{tmp_path}/d.sock",
                                                     budget=22), f"unix://{tmp_path}/v.sock")
        try:
            async with grpc.aio.insecure_channel(server.address.target) as ch:
                stub = pb_grpc.VerifierStub(ch)
                chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_tokens=20))]
                tokens, last = [], None
                async for c in stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_tokens=60)):
                    tokens += c.token_ids
                    last = c
                    if len(tokens) >= 3 and drafter is not None:
                        await drafter.stop(0)         # the drafter goes away mid-request
                        drafter = None
            return chunks[-1], tokens, last
        finally:
            await server.stop(1)
            if drafter is not None:
                await drafter.stop(0)

    first, tokens, last = asyncio.run(main())
    assert first.spec.steps > 0 and not first.spec.fallback
    # the drafter service's own time of its drafts, beside the time the steps waited on drafting
    assert first.spec.drafter_ms > 0 and first.spec.draft_ms > 0
    assert tokens == want
    assert last.spec.fallback and last.spec.fallback_reason and last.spec.steps >= 1
    spans = mem.get_finished_spans()
    gens = [s for s in spans if s.name == "verifier.generate"]
    sessions = [s for s in spans if s.name == "drafter.session"]
    assert sessions and sessions[0].parent.span_id == gens[0].context.span_id
    drafts = [s for s in spans if s.name == "spec.draft" and s.parent.span_id == gens[0].context.span_id]
    assert drafts and all(s.attributes["spec.drafter_ms"] > 0 for s in drafts)
    assert any(e.name == "spec.fallback" for e in gens[1].events)


def test_the_guard_passes_prompt_appends_only_where_the_drafter_takes_them():
    """_GuardedProposer has append_features only when the proposer it wraps does (a remote drafter's client takes
    a prompt's features with its first draft); a failing append becomes DrafterUnavailableError, recorded once."""
    from services.engine.speculative import DrafterUnavailableError
    from services.verifier.service import _GuardedProposer

    class Keeps:
        block_size, target_layer_ids = 16, [1, 2]

        def propose(self, *a):
            raise AssertionError("not called")

        def close(self):
            pass

    class Takes(Keeps):
        def __init__(self):
            self.got = []

        def append_features(self, rows, start):
            if start < 0:
                raise ValueError("bad start")
            self.got.append((rows, start))

    failures = []
    inner = Takes()
    guarded = _GuardedProposer(inner, failures.append)
    guarded.append_features("rows", 256)
    assert inner.got == [("rows", 256)] and failures == []
    with pytest.raises(DrafterUnavailableError, match="bad start"):
        guarded.append_features("rows", -1)
    assert failures == ["ValueError: bad start"]
    assert not hasattr(_GuardedProposer(Keeps(), failures.append), "append_features")


def test_a_slot_waiting_for_a_drafter_service_lets_the_others_step():
    """A GPU verifier's slots take turns on the engine lock step by step; a slot waiting for a drafter service's
    answer releases it for the wait only (the features go out under it), so another slot steps meanwhile, and holds
    it again when the answer is in. Released on a thread that does not hold it: nothing happens."""
    import numpy as np

    from services.verifier.service import _EngineLock, _GuardedProposer

    lock = _EngineLock()
    answered = threading.Event()
    seen = {}

    class Remote:                       # a DrafterClient's shape: the send now, the answer later
        block_size, target_layer_ids = 16, [0]

        def propose_begin(self, feats, last, start, k):
            seen["sent_under_lock"] = lock._owner == threading.get_ident()

            def answer():
                assert answered.wait(5.0), "no other slot stepped while this one waited"
                return np.zeros((15, k), np.int64), np.zeros((15, k))
            return answer

        def close(self):
            pass

    def other_slot():
        time.sleep(0.05)
        with lock:                      # only possible while the first slot waits
            seen["other_stepped"] = True
        answered.set()

    guarded = _GuardedProposer(Remote(), lambda reason: seen.setdefault("failed", reason), waiting=lock.released)
    t = threading.Thread(target=other_slot)
    with lock:
        t.start()
        ids, _ = guarded.propose(None, 1, 2, 4)
        assert lock._owner == threading.get_ident()    # held again after the wait
    t.join(5.0)
    assert ids.shape == (15, 4) and seen == {"sent_under_lock": True, "other_stepped": True}
    # not the holder: released() does nothing (the lock stays with the thread that has it)
    holder_in, holder_out = threading.Event(), threading.Event()

    def hold():
        with lock:
            holder_in.set()
            holder_out.wait(5.0)

    h = threading.Thread(target=hold)
    h.start()
    assert holder_in.wait(5.0)
    with lock.released():
        assert lock._owner == h.ident and lock._lock.locked()
    holder_out.set()
    h.join(5.0)
