"""The Verifier service with its target (and in-process drafter) on the GPU: a real `specsplit verifier --device
cuda:0` process over gRPC, checked against in-process plain decoding on the CPU; and the Drafter service on a GPU
of its own (`specsplit drafter --device cuda:0`) proposing for a target elsewhere. Skips without a GPU, except the
flag checks, which need none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from kernels.loader import unavailable_reason
from services.engine.errors import SpecsplitError
from services.engine.generate import generate
from services.engine.loader import load_target
from services.engine.sampling import apply_penalties, resolve_sampling
from services.verifier.service import VerifierConfig
from services.wire import pb
from tests.test_verifier_service import VerifierProcess

_REASON = unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"no GPU backend: {_REASON}")


def test_draft_device_pairings_are_checked():
    base = dict(model="m.gguf", draft="d")
    assert VerifierConfig(**base).draft_device == "cpu"
    assert VerifierConfig(**base, device="cuda:0").draft_device == "cuda:0"          # default: the target's
    assert VerifierConfig(**base, device="cuda:1", draft_device="cpu").draft_device == "cpu"
    with pytest.raises(SpecsplitError, match="needs its target on the same GPU"):
        VerifierConfig(**base, device="cpu", draft_device="cuda:0")
    with pytest.raises(SpecsplitError, match="another GPU"):
        VerifierConfig(**base, device="cuda:0", draft_device="cuda:1")
    with pytest.raises(ValueError, match="device"):
        VerifierConfig(**base, device="tpu")


# 4x the largest |GPU - NumPy| logit difference measured on the embedded model (0.005, tests/test_gpu_backend.py):
# where the best two penalised logits are closer, the GPU's rounding may pick the other one
NEAR_TIE = 0.02


def _decisive_plain(cpu_target, ids: list[int], n: int) -> list[int]:
    """The CPU target's plain tokens for `ids` under its declared sampling (repetition penalty 1.1 over the last 64),
    after checking that no step along them is a near tie: there the GPU may rightly pick the other token, and a
    comparison would test the prompt, not the code."""
    params = resolve_sampling({}, cpu_target.sampling_defaults)
    want = generate(cpu_target.model, ids, n, params).token_ids
    seq = list(ids) + want
    model = cpu_target.model
    rows = model.forward(model.new_state(len(seq)), seq[:-1], logits="all").logits[len(ids) - 1:]
    last = params.repeat_last_n
    for i, row in enumerate(rows):
        hist = seq[:len(ids) + i]
        top = np.sort(apply_penalties(np.asarray(row), hist[-last:] if last > 0 else hist, params))[-2:]
        assert top[1] - top[0] >= NEAR_TIE, f"token {i} of this prompt is a near tie ({top[1] - top[0]:.3g})"
    return want


def _pair() -> tuple[str, str]:
    # the embedded default pair: its shapes suit the GPU kernels (the tiny test pair's 48-wide rows do not), and
    # tests/test_gpu_backend.py pins its GPU greedy output to the NumPy engine's
    from services.engine.default_model import default_model_paths

    target, drafter = default_model_paths()
    return str(target), str(drafter)


@pytest.fixture(scope="module")
def cpu_target():
    t = load_target(_pair()[0])
    t.model.set_kv_cache_types("f16", "f16")    # the verifier's KV types below: the same rounding on both sides
    return t


@pytest.fixture(scope="module", params=["cuda:0", "cpu"], ids=["drafter-on-gpu", "drafter-on-cpu"])
def gpu_verifier(request, tmp_path_factory):
    if _REASON is not None:
        pytest.skip(f"no GPU backend: {_REASON}")
    gguf, drafter = _pair()
    p = VerifierProcess(tmp_path_factory.mktemp("gpu_verifier") / "v.sock",
                        ["--model", gguf, "--draft", drafter, "--device", "cuda:0", "--draft-device", request.param,
                         "--slots", "2", "--cache-type-k", "f16", "--cache-type-v", "f16"])
    yield p
    p.stop()


@needs_gpu
def test_gpu_verifier_greedy_equals_cpu_plain(gpu_verifier, cpu_target):
    info = gpu_verifier.stub.Info(pb.InfoRequest(), timeout=60)
    assert info.backend == "cuda" and info.model.speculative
    tok = cpu_target.tokenizer
    for text in ("def add(a, b):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"):
        ids = tok.encode(text)
        # a request that sets no sampling gets what the embedded target declares (a repetition penalty)
        want = generate(cpu_target.model, ids, 24, resolve_sampling({}, cpu_target.sampling_defaults)).token_ids
        for speculative in (False, True):
            got, last, _ = gpu_verifier.generate(prompt_ids=ids, max_tokens=24, speculative=speculative)
            assert got == want, (text, speculative)
            if speculative:
                assert last.spec.steps > 0 and not last.spec.fallback


@needs_gpu
def test_gpu_verifier_logprobs_equal_cpu_ones(gpu_verifier, cpu_target):
    """Verifier.Generate with top_logprobs and prompt_logprobs on the GPU: one entry per token (the prompt's in the
    first chunk), within twice the logits' noise (test_gpu_backend LOGIT_TOL) of the NumPy engine's raw numbers,
    speculative and plain, and a prompt scored alone (max_tokens 0)."""
    from services.wire import logprobs_from_pb

    ids = cpu_target.tokenizer.encode("def add(a, b):\n")
    want = generate(cpu_target.model, ids, 12, resolve_sampling({}, cpu_target.sampling_defaults), top_logprobs=2,
                    prompt_logprobs=2)
    for speculative, max_tokens in ((True, 12), (False, 12), (True, 0)):
        chunks = list(gpu_verifier.stub.Generate(pb.GenerateRequest(
            prompt_ids=ids, max_tokens=max_tokens, speculative=speculative, top_logprobs=2, prompt_logprobs=2),
            timeout=120))
        got = [lp for c in chunks for lp in logprobs_from_pb(c.logprobs)]
        prompt = logprobs_from_pb(chunks[0].prompt_logprobs)
        assert not any(c.prompt_logprobs for c in chunks[1:])
        assert [lp.token for lp in got] == want.token_ids[:max_tokens] == [t for c in chunks for t in c.token_ids]
        for g, w in zip(prompt + got, want.prompt_logprobs + want.logprobs):
            assert g.token == w.token and abs(g.logprob - w.logprob) < 0.1 and len(g.top) == 2
        assert len(prompt) == len(ids) - 1


@needs_gpu
def test_gpu_verifier_keeps_serving_after_bad_input(gpu_verifier, cpu_target):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        gpu_verifier.generate(prompt_ids=[cpu_target.cfg.n_vocab + 5], max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got, last, _ = gpu_verifier.generate(prompt_ids=[5, 6, 7], max_tokens=8, speculative=True)
    assert len(got) == 8 and last.finish_reason == pb.FINISH_REASON_LENGTH


@needs_gpu
def test_gpu_verifier_out_of_memory_mid_request_fails_alone(tmp_path, cpu_target):
    """An allocation failure injected into the third forward pass of a served request (SPECSPLIT_INJECT_OOM) on a
    GPU verifier: RESOURCE_EXHAUSTED for that request after its first two tokens, the next requests (plain and
    speculative, one slot, no queue) succeed with the same tokens as before, and CUDA graphs stay on."""
    import grpc

    gguf, drafter = _pair()
    p = VerifierProcess(tmp_path / "v.sock", ["--model", gguf, "--draft", drafter, "--device", "cuda:0", "--slots", "1",
                                              "--max-queue", "0", "--cache-type-k", "f16", "--cache-type-v", "f16"],
                        env={"SPECSPLIT_INJECT_OOM": "forward:3"})
    try:
        ids = cpu_target.tokenizer.encode("def add(a, b):\n")
        want = generate(cpu_target.model, ids, 16, resolve_sampling({}, cpu_target.sampling_defaults)).token_ids
        got: list[int] = []
        with pytest.raises(grpc.RpcError) as e:
            for chunk in p.stub.Generate(pb.GenerateRequest(prompt_ids=ids, max_tokens=16, speculative=False),
                                         timeout=120):
                got += list(chunk.token_ids)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "out of memory on cuda:0 after 2 generated tokens" in e.value.details()
        assert got == want[:2]
        for speculative in (False, True):
            again, _, _ = p.generate(prompt_ids=ids, max_tokens=16, speculative=speculative)
            assert again == want
    finally:
        p.stop()
    log = p.log.read_text()
    assert "ran out of memory on cuda:0" in log and "CUDA graphs off" not in log


@needs_gpu
def test_drafter_service_on_a_gpu_of_its_own(tmp_path, cpu_target):
    """`specsplit drafter --device cuda:0`: sessions planned and made at start-up, top-k from the device; a target
    elsewhere (here the NumPy model in this process) decodes speculatively through it exactly as plainly, and the
    drafter's sessions are reused by the next request. A 300-token prompt goes to it as an append of its features
    (DraftRequest.top_k 0) before the first draft."""
    from services.drafter.client import DrafterClient
    from services.engine.generate import GenerationResult
    from services.engine.speculative import SpecConfig, speculative_stream
    from tests.test_drafter_service import _log_exchanges, spawn_drafter, stop

    gguf, drafter = _pair()
    proc, addr = spawn_drafter((None, gguf, drafter), tmp_path / "d.sock", max_sessions=2,
                               extra=("--device", "cuda:0", "--max-ctx", "1024"))
    try:
        model = cpu_target.model
        prompt = cpu_target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
        plain = generate(model, prompt, 40).token_ids
        for _ in range(2):
            with DrafterClient(addr) as client:
                assert client.info().backend == "cuda:0"
                res = GenerationResult()
                for _ in speculative_stream(model, client, prompt, 40, spec=SpecConfig(budget=22), result=res):
                    pass
            assert res.token_ids == plain
            assert not res.spec["fallback"] and res.spec["mean_acceptance_length"] > 1.0
        long = (prompt * (300 // len(prompt) + 1))[:300]
        plain = generate(model, long, 24).token_ids
        with DrafterClient(addr) as client:
            sent = _log_exchanges(client)
            res = GenerationResult()
            for _ in speculative_stream(model, client, long, 24, spec=SpecConfig(budget=22), result=res):
                pass
        assert res.token_ids == plain and not res.spec["fallback"]
        assert sent[0] == (0, 300, 300) and sent[1][1:] == (0, 300)
    finally:
        stop(proc)
    assert proc.returncode == 0, proc.stderr.read()


@needs_gpu
def test_a_gpu_targets_features_cross_to_a_drafter_service_as_f16(tmp_path, monkeypatch):
    """A GPU target and a drafter service with f16 on the wire (`--draft-features f16`, auto's choice across hosts):
    the captured rows are cast on the device and written by it into the stream's registered segment
    (DeviceRows.copy_into: half the bytes leave it, no host copy), a 300-token prompt's features go as an f16
    append, the steps' as f16 too, and the tokens are the GPU target's plain ones."""
    from services.drafter.client import DrafterClient
    from services.engine.generate import GenerationResult
    from services.engine.models.qwen35_gpu import DeviceRows
    from services.engine.placement import load_target_on
    from services.engine.speculative import SpecConfig, speculative_stream
    from tests.test_drafter_service import spawn_drafter, stop

    gguf, drafter = _pair()
    casts = []
    copy_into = DeviceRows.copy_into

    def spy(self, dst):
        copy_into(self, dst)
        casts.append((dst.dtype, dst.shape[0]))

    monkeypatch.setattr(DeviceRows, "copy_into", spy)
    target = load_target_on(gguf, "cuda:0")
    model = target.model
    prompt = target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    long = (prompt * (300 // len(prompt) + 1))[:300]
    plain = generate(model, long, 24).token_ids
    proc, addr = spawn_drafter((None, gguf, drafter), tmp_path / "d.sock", max_sessions=2)
    try:
        with DrafterClient(addr, feature_dtype="f16") as client:
            dtypes = []
            exchange = client._exchange

            async def logged(req):
                dtypes.append((req.top_k, req.features.dtype, req.features.rows))
                return await exchange(req)

            client._exchange = logged
            res = GenerationResult()
            seg = client._segment
            for _ in speculative_stream(model, client, long, 24, spec=SpecConfig(budget=22), result=res):
                pass
        assert seg.pinned       # registered on the first rows (copy_into runs only into a registered segment)
    finally:
        stop(proc)
    assert res.token_ids == plain and not res.spec["fallback"]
    # the prompt: appends of 256 rows or more as its chunks commit, the rest with the first draft
    first = next(i for i, (k, _, _) in enumerate(dtypes) if k)
    assert first >= 1 and all(k == 0 and n >= 256 for k, _, n in dtypes[:first])
    assert sum(n for _, _, n in dtypes[:first + 1]) == 300
    assert all(d == "f16" for _, d, n in dtypes if n)
    assert casts and all(dt == np.float16 for dt, _ in casts) and casts[0][1] >= 256


@contextlib.contextmanager
def _split_deployment(tmp_path, drafter_device: str) -> Iterator[tuple[VerifierProcess, str]]:
    """`specsplit drafter --device DEV` and `specsplit verifier --device cuda:0 --drafter ADDR` (two slots, f16 KV),
    two processes over gRPC: (the verifier, the drafter's address); both stopped after, the drafter cleanly."""
    from tests.test_drafter_service import spawn_drafter, stop

    gguf, drafter = _pair()
    dproc, addr = spawn_drafter((None, gguf, drafter), tmp_path / "d.sock", max_sessions=2,
                                extra=("--device", drafter_device, "--max-ctx", "1024"))
    v = None
    try:
        v = VerifierProcess(tmp_path / "v.sock", ["--model", gguf, "--drafter", addr, "--device", "cuda:0",
                                                  "--slots", "2", "--cache-type-k", "f16", "--cache-type-v", "f16"])
        yield v, addr
    finally:
        if v is not None:
            v.stop()
        stop(dproc)
    assert dproc.returncode == 0, dproc.stderr.read()


@needs_gpu
def test_concurrent_requests_through_a_drafter_service_on_the_same_gpu(tmp_path, cpu_target):
    """`specsplit verifier --device cuda:0 --drafter ADDR` with the drafter service on the same GPU and two slots: two
    requests at once, each slot's wait for its draft with the engine lock released (the other slot steps meanwhile);
    each gets the CPU target's plain tokens, drafting throughout."""
    from concurrent.futures import ThreadPoolExecutor

    with _split_deployment(tmp_path, "cuda:0") as (v, _):
        tok = cpu_target.tokenizer
        prompts = [tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
                   tok.encode("class Stack:\n    def __init__(self):\n")]
        params = resolve_sampling({}, cpu_target.sampling_defaults)
        want = [generate(cpu_target.model, ids, 40, params).token_ids for ids in prompts]
        for _ in range(2):
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda ids: v.generate(prompt_ids=ids, max_tokens=40, speculative=True), prompts))
            for (tokens, last, _), w in zip(got, want):
                assert tokens == w
                assert last.spec.steps > 0 and not last.spec.fallback


def _gpu_count() -> int:
    if _REASON is not None:
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


@pytest.mark.gpus2
@pytest.mark.skipif(_gpu_count() < 2, reason=f"needs two GPUs ({_REASON or f'{_gpu_count()} visible'})")
def test_verifier_on_one_gpu_with_its_drafter_service_on_another(tmp_path, cpu_target):
    """The split the README describes for two cards: `specsplit drafter --device cuda:1` and `specsplit verifier
    --device cuda:0 --drafter ADDR`, two processes over gRPC. The drafter reports cuda:1, the verifier drafts through
    it (no fallback), and the tokens are the CPU target's plain ones, for a short prompt and a 300-token one (whose
    features go ahead as appends)."""
    from services.drafter.client import DrafterClient
    from services.engine.default_model import heldout_prompts

    with _split_deployment(tmp_path, "cuda:1") as (v, addr):
        with DrafterClient(addr, wait_ready=True, ready_timeout=60) as client:
            assert client.info().backend == "cuda:1"
        tok = cpu_target.tokenizer
        short = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
        # real text, where no step is a near tie under the penalty (the fibonacci lines repeated have one at token 7)
        long = tok.encode("\n".join(heldout_prompts()))[500:800]
        for ids, n in ((short, 32), (long, 24)):
            want = _decisive_plain(cpu_target, ids, n)
            got, last, _ = v.generate(prompt_ids=ids, max_tokens=n, speculative=True)
            assert got == want
            assert last.spec.steps > 0 and not last.spec.fallback
