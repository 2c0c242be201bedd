"""The Verifier gRPC service: owns the target model and runs the speculative loop for each request.

Concurrency model. The engine is synchronous array code, so every admitted request runs its engine loop in
a worker thread of a pool with `slots` threads; the asyncio handler only validates, queues, and relays
chunks from an asyncio.Queue the worker feeds with `call_soon_threadsafe`. Each request has its own
SequenceState (its KV slot) inside the engine, so `slots` bounds the number of caches alive at once (a GPU
engine keeps up to `slots` finished states and drafter sessions, with their captured CUDA graphs, for the next
requests instead of capturing again).

Admission: up to `slots` requests run, up to `max_queue` more wait for a slot; past that a request gets
RESOURCE_EXHAUSTED at once (the gateway turns it into 429), so overload never turns into unbounded latency.

Memory: the start-up plan (services/engine/memory_plan.py) counts `slots` of everything per request; on a GPU the
verifier takes it all before serving (reserve_states / reserve_sessions / the graph arena) and caps each verify at
the planned width (a request's budget is lowered to it). A request whose allocation fails anyway (another process
took the memory) fails alone with RESOURCE_EXHAUSTED; its slot and state go back and the verifier keeps serving.

Stopping: client cancellation, the RPC deadline and shutdown all set one flag per request that the worker
checks between engine steps; the worker then closes the engine generator and the proposer, and the slot
is released when the worker thread returns (a done-callback on its future), never before: a slot freed
while its thread still computes would let `slots + 1` engine loops run.

Drafting: an in-process DFlash drafter (`draft`) or a remote Drafter service (`drafter_address`, one
DrafterClient per request = one Draft stream). Any drafter failure turns into DrafterUnavailableError,
which the engine answers by finishing the request with plain decoding; the request never fails for it.
SpecStats.fallback says so, and the request span gets a `spec.fallback` event.

Stream: one GenerateChunk per engine step (the first token, then each draft/verify/accept round); the
last one also carries finish_reason, usage, spec and timings. When generation ends for a reason the
worker cannot see coming (the context filled up) those travel in an extra chunk with no tokens.

Tracing: `verifier.generate` (child of the caller's context from the gRPC metadata) with per-step
children `spec.draft`, `spec.verify`, `spec.accept`, made from the engine's StepInfo durations.

In-process start: `server = await serve_verifier(VerifierConfig(...), "inproc:verifier")`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.cliargs import MAX_BUDGET
from services.engine import faults
from services.engine.budget import BudgetTuner
from services.engine.errors import (
    ContextOverflowError,
    DeviceMemoryError,
    InvalidRequestError,
    SpecsplitError,
    is_out_of_memory,
)
from services.engine.generate import GenerationResult, check_request
from services.engine.kvcache import kv_info
from services.engine.logprobs import MAX_TOP_LOGPROBS, check_top_logprobs
from services.engine.sampling import SamplingParams
from services.engine.speculative import (
    AUTO_MAX_BUDGET,
    DrafterUnavailableError,
    Proposer,
    SpecConfig,
    StepInfo,
    begin_propose,
    speculative_stream,
)
from services.wire import logprobs_to_pb, pb, pb_grpc, sampling_from_pb

log = logging.getLogger("specsplit.verifier")

SERVICE_NAME = "specsplit.v1.Verifier"
DEFAULT_BUDGET = "auto"      # the budget tuner (services/engine/budget.py) picks each step's tree size
WARMUP_TOKENS = 2
DRAFTER_INFO_TIMEOUT_S = 5.0  # reaching a remote drafter's Info; past it the request decodes plainly
DRAFTER_RETRY_S = 2.0         # after the drafter was unreachable, requests skip it this long

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "cancelled": pb.FINISH_REASON_CANCELLED}


@dataclass
class VerifierConfig:
    """Everything a verifier needs; the CLI flags and SPECSPLIT_* env vars map one to one onto it."""

    model: str                                  # target: GGUF file or Hugging Face folder
    draft: str | None = None                    # in-process DFlash drafter (folder or GGUF)
    drafter_address: str | None = None          # remote Drafter service (unix:///..., host:port)
    budget: int | str | None = DEFAULT_BUDGET   # DDTree non-root nodes; None = chain; "auto" = tuned per step
    slots: int = 1                              # concurrent generations (each its own KV cache)
    max_queue: int = 16                         # requests that may wait for a slot
    max_ctx: int | None = None                  # context per request (default: the model's)
    speculative: bool = True                    # default for requests that do not say
    trace: str | None = None                    # none | console | otlp | memory; None: leave the
                                                # process's tracing as configured (all-in-one, tests)
    shutdown_grace_s: float = 10.0              # in-flight requests get this long on SIGTERM
    drafter_timeout_s: float = 30.0             # longest wait for one remote draft before falling back
    draft_features: str = "auto"                # a remote drafter's features on the wire: auto, f32, f16
    cache_type_k: str = "auto"                  # KV cache types (auto, f16, q8_0, tq3_0, f32); `auto` is
    cache_type_v: str = "auto"                  # the rule in services/engine/kvcache.py
    device: str = "cpu"                         # where the target runs: cpu or cuda:N
    draft_device: str | None = None             # the in-process drafter's device (None: the target's)

    def __post_init__(self) -> None:
        if self.draft and self.drafter_address:
            raise ValueError("give either an in-process drafter (draft) or a drafter address, not both")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.budget != "auto" and self.budget is not None and not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in 1..{MAX_BUDGET}, None (chain) or 'auto', got {self.budget}")
        if self.max_ctx is not None and self.max_ctx < 2:
            raise ValueError(f"max_ctx must be >= 2, got {self.max_ctx}")
        from services.engine.kvcache import CACHE_TYPE_CHOICES

        for name in ("cache_type_k", "cache_type_v"):
            t = str(getattr(self, name)).lower()
            if t not in CACHE_TYPE_CHOICES:
                raise ValueError(f"{name} must be one of {', '.join(CACHE_TYPE_CHOICES)}, got {t!r}")
            setattr(self, name, t)
        from services.engine.placement import check_devices

        self.draft_device = check_devices(self.device, self.draft_device)
        if self.drafter_address:
            from services.rpc import parse_address

            parse_address(self.drafter_address)     # a typo is a start-up error, not a silent fallback
        from services.drafter.client import FEATURE_CHOICES

        if self.draft_features not in FEATURE_CHOICES:
            raise ValueError(f"draft_features must be one of {', '.join(FEATURE_CHOICES)}, got {self.draft_features!r}")


@dataclass
class Counters:
    """Totals since start; Info reports the live ones, the rest are for logs and tests."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0                 # RESOURCE_EXHAUSTED
    invalid: int = 0                  # INVALID_ARGUMENT
    failed: int = 0                   # INTERNAL
    out_of_memory: int = 0            # RESOURCE_EXHAUSTED: an allocation failed mid-request
    fallbacks: int = 0                # requests that lost their drafter and finished with plain decoding


# --------------------------------------------------------------------------------------------------
# time: the engine reports perf_counter durations; spans want epoch nanoseconds

class _Clock:
    """Maps perf_counter readings onto the wall clock with one anchor, so span times are monotonic."""

    def __init__(self) -> None:
        self.anchor_ns = time.time_ns() - time.perf_counter_ns()

    def now_ns(self) -> int:
        return time.perf_counter_ns() + self.anchor_ns


_clock = _Clock()


# --------------------------------------------------------------------------------------------------
# proposers

class _FailedProposer:
    """Stands in for a drafter that could not even be reached: the engine's first propose() falls back.

    Going through the engine's own fallback path (instead of passing no proposer) keeps one place that
    decides what a fallback looks like in SpecStats.
    """

    block_size = 16
    target_layer_ids: list[int] = []

    def __init__(self, reason: str):
        self.reason = reason

    def propose(self, new_features, last_token, start, k):
        raise DrafterUnavailableError(self.reason)

    def close(self) -> None:
        pass


class _EngineLock:
    """A GPU target's lock (slots take turns step by step), knowing which thread holds it, so that a slot waiting
    for a drafter service's answer can let the others step meanwhile (released())."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> _EngineLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Other slots may step inside (nothing in it may touch the device); a no-op on a thread not holding it."""
        if self._owner != threading.get_ident():
            yield
            return
        self._owner = None
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._owner = threading.get_ident()


class _GuardedProposer:
    """Wraps a proposer: any failure becomes DrafterUnavailableError (so the request goes on with plain
    decoding) and is recorded on the request span the moment it happens; close() is idempotent.

    waiting: a context the wait for an answer runs in. A drafter service's answer is waited for with the engine lock
    released (_EngineLock.released): the request is between two steps then (its features already sent, nothing of it
    on the device in flight but its commit), so the other slots' steps fill the GPU while the drafter drafts."""

    def __init__(self, inner: Proposer, on_failure: Callable[[str], None],
                 waiting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext):
        self.inner = inner
        self.block_size = inner.block_size
        self.target_layer_ids = list(inner.target_layer_ids)
        self._on_failure = on_failure
        self._waiting = waiting
        self._closed = False
        if hasattr(inner, "append_features"):     # only where the inner one takes features ahead of a draft
            self.append_features = self._append_features

    def propose(self, new_features, last_token, start, k):
        return self.propose_begin(new_features, last_token, start, k)()

    @property
    def last_draft_ms(self) -> float | None:
        """A drafter service's own time of its last draft (DrafterClient); None for an in-process drafter."""
        return getattr(self.inner, "last_draft_ms", None)

    def _append_features(self, new_features, start):
        return self._guarded(self.inner.append_features, new_features, start)

    def propose_begin(self, new_features, last_token, start, k):
        """speculative.begin_propose through the guard: a failure in either half becomes DrafterUnavailableError."""
        fetch = self._guarded(begin_propose, self.inner, new_features, last_token, start, k)

        def wait():
            with self._waiting():
                return self._guarded(fetch)

        return wait

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except DrafterUnavailableError as e:
            self._on_failure(str(e) or type(e).__name__)
            raise
        except Exception as e:        # a drafter bug must not fail the user's request
            log.warning("drafter failed, continuing with plain decoding:\n%s", traceback.format_exc())
            reason = f"{type(e).__name__}: {e}"
            self._on_failure(reason)
            raise DrafterUnavailableError(reason) from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.inner.close()
        except Exception:              # closing a broken stream may fail again; nothing left to save
            log.debug("closing the proposer failed", exc_info=True)


# --------------------------------------------------------------------------------------------------
# one request

@dataclass(eq=False)          # identity semantics: jobs live in a set
class _Job:
    """One admitted request: what the worker thread needs and how it talks back to the event loop."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: list[int]
    speculative: bool
    spec: SpecConfig
    deadline: float | None                      # time.monotonic() value, None = no deadline
    top_logprobs: int | None                    # set: the chunks carry each token's log-probability
    prompt_logprobs: int | None                 # set: the first chunk carries the prompt's
    span: Any                                   # the verifier.generate span
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult = field(default_factory=GenerationResult)
    stop_reason: str = ""                       # "cancelled" | "deadline" when the loop was stopped early
    fallback_reason: str = ""
    worker: asyncio.Future | None = None        # the worker thread's future; its done-callback frees the slot

    def put(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:           # the event loop is closed (process exit): nobody is listening
            self.cancel.set()


# --------------------------------------------------------------------------------------------------
# the servicer

class VerifierServicer(pb_grpc.VerifierServicer):
    """Verifier.Generate / Verifier.Info over one target model.

    Construct it, register it on a server, then `await load()` (weights + warm-up, in a thread so the
    server answers health checks meanwhile); until then Generate answers UNAVAILABLE.
    """

    def __init__(self, cfg: VerifierConfig, tracer: trace.Tracer | None = None):
        self.cfg = cfg
        self.counters = Counters()
        self.target = None                      # LoadedTarget once loaded
        self.drafter = None                     # in-process drafter (placement.LoadedDrafter)
        self._remote_layers: list[int] | None = None   # a remote drafter's feature layers, when known at start-up
        self._engine_lock: Any = contextlib.nullcontext()   # a real lock when the target is on a GPU
        self.tuner: BudgetTuner | None = None   # --budget auto (shared by all requests)
        self.max_ctx = 0
        self.kv: dict | None = None             # KV memory accounting (kvcache.kv_info) once loaded
        self.width = 0                          # the widest verify pass (memory_plan.serving_width) once loaded
        self.created = int(time.time())
        self._tracer = tracer or trace.get_tracer("specsplit.verifier")
        self._pool = ThreadPoolExecutor(max_workers=cfg.slots, thread_name_prefix="verifier-slot")
        self._sem: asyncio.Semaphore | None = None   # made on the serving loop (load())
        self._active = 0
        self._queued = 0
        self._jobs: set[_Job] = set()
        self._ready = False
        self._draining = False
        self._drafter_down_until = 0.0          # monotonic time before which the drafter is not tried
        self._drafter_down_reason = ""

    # -- lifecycle ---------------------------------------------------------------------------------
    async def load(self) -> None:
        """Load the weights (and in-process drafter), run one warm-up generation; then accept requests."""
        self._sem = asyncio.Semaphore(self.cfg.slots)
        await asyncio.to_thread(self._load_sync)
        self._ready = True

    def _load_sync(self) -> None:
        from services.engine.placement import load_drafter_on, load_target_on

        t0 = time.perf_counter()
        self.target = load_target_on(self.cfg.model, self.cfg.device, with_tokenizer=False)
        model_ctx = self.target.cfg.context_length
        if self.cfg.max_ctx is not None and self.cfg.max_ctx > model_ctx:
            log.warning("max_ctx %d is beyond the model's context length %d; using %d",
                        self.cfg.max_ctx, model_ctx, model_ctx)
        self.max_ctx = min(self.cfg.max_ctx or model_ctx, model_ctx)
        # the model's declared sampling (defaults of unset request fields): read, and a bad file refused, here
        declared = self.target.sampling_defaults
        if declared:
            log.info("model declares sampling defaults %s", declared)
        # a head size the chosen type cannot hold is a start-up error, not a per-request one
        self.target.model.set_kv_cache_types(self.cfg.cache_type_k, self.cfg.cache_type_v)
        self.kv = kv_info(self.target.cfg, *self.target.model.kv_cache_types, self.max_ctx)
        if getattr(self.target.model.be, "name", "numpy") == "cuda":
            # One GPU, one stream of steps: slots take turns step by step (a step is a CUDA-graph replay
            # that must not interleave with another thread's capture); NumPy slots run side by side.
            self._engine_lock = _EngineLock()
        if self.cfg.draft:
            self.drafter = load_drafter_on(self.cfg.draft, self.target.model, self.cfg.draft_device)
        elif self.cfg.drafter_address:
            self._remote_layers = self._remote_drafter_layers()
        self._reserve_memory()
        load_ms = (time.perf_counter() - t0) * 1e3
        if self.cfg.budget == "auto" and (self.cfg.draft or self.cfg.drafter_address):
            # the verify-cost curve of this machine, measured once, as the loop runs its steps (with the in-process
            # drafter's feature layers) on every slot's pooled state (a GPU target then holds those graphs);
            # acceptance is learnt while serving
            layers = self.drafter.drafter.target_layer_ids if self.drafter is not None else self._remote_layers or ()
            self.tuner = BudgetTuner.measure(self.target.model, min(AUTO_MAX_BUDGET, self.width - 1), capture=layers,
                                             states=self.cfg.slots)
            log.info("verifier: --budget auto, verify ms by width %s", self.tuner.snapshot()["verify_ms"])
        # Warm-up: the first forward pays one-off costs (lazy dequantisation, allocator growth); a
        # readiness probe should only pass once a request would not pay them.
        t1 = time.perf_counter()
        prompt = [i % self.target.cfg.n_vocab for i in range(4)]
        proposer = self.drafter.new_proposer() if self.drafter is not None else None
        for _ in speculative_stream(self.target.model, proposer, prompt, WARMUP_TOKENS,
                                    spec=self._spec_config(self.cfg.budget), max_ctx=self.max_ctx):
            pass
        # and a request that asks for log-probabilities (their kernels on a GPU): a scored prompt's, plain steps' and
        # a verify's rows
        proposer = self.drafter.new_proposer() if self.drafter is not None else None
        for _ in speculative_stream(self.target.model, proposer, prompt, 3, spec=self._spec_config(self.cfg.budget),
                                    max_ctx=self.max_ctx, top_logprobs=MAX_TOP_LOGPROBS,
                                    prompt_logprobs=MAX_TOP_LOGPROBS):
            pass
        log.info("verifier: %s (%s, vocab %d, context %d) loaded in %.0f ms, warm-up %.0f ms; drafter: %s",
                 self.target.name, self.target.cfg.arch, self.target.cfg.n_vocab, self.max_ctx, load_ms,
                 (time.perf_counter() - t1) * 1e3, self.drafter_description())
        log.info("verifier: KV cache K=%s V=%s, %d bytes per token (f16: %d), %.1f MiB per slot at context %d",
                 self.kv["cache_type_k"], self.kv["cache_type_v"], self.kv["kv_bytes_per_token"],
                 self.kv["kv_bytes_per_token_f16"], self.kv["kv_bytes"] / 2**20, self.max_ctx)
        armed = faults.arm()
        if armed:
            log.warning("verifier: %s=%s: an allocation failure will be injected", faults.ENV, armed)

    def _reserve_memory(self) -> None:
        """The widest verify the plan counted, and on a GPU everything it counts per slot and per device, taken
        now (placement.reserve_serving): `slots` states and drafter sessions of the serving context (pooled:
        finished requests' states and captured graphs serve the next ones) and the graph arena."""
        from services.engine import memory_plan as mp
        from services.engine.placement import reserve_serving

        dr = self.drafter.drafter if self.drafter is not None else None
        has_drafter = bool(self.cfg.draft or self.cfg.drafter_address)
        n_capture = len(dr.target_layer_ids) if dr is not None else len(self._remote_layers) if self._remote_layers \
            else mp.DEFAULT_CAPTURE_LAYERS if self.cfg.drafter_address else 0
        budget = AUTO_MAX_BUDGET if self.cfg.budget == "auto" else self.cfg.budget
        model = self.target.model
        self.width = reserve_serving(model, dr, self.cfg.slots, self.max_ctx, budget, has_drafter, n_capture,
                                     self.cfg.device, layer_ids=self._remote_layers or None)
        if hasattr(model, "memory_in_use"):
            used = model.memory_in_use()
            log.info("verifier: %d slot(s) on %s, verify width %d, steps up to %d tokens: states %.1f MiB, graph "
                     "arena %.1f MiB, CuPy pool %.1f MiB", self.cfg.slots, self.cfg.device, self.width,
                     getattr(model, "max_tree", self.width), used["pooled_states"] / 2**20, used["arena"] / 2**20,
                     used["pool_total"] / 2**20)

    def _remote_drafter_layers(self) -> list[int] | None:
        """The remote drafter's feature layers, asked once at start-up (one Info within DRAFTER_INFO_TIMEOUT_S), so
        that the memory plan and `--budget auto`'s calibration take the layers it reads (on a GPU: the graphs the
        loop replays). None when it does not answer yet or does not fit this target: start-up goes on, and requests
        find out as ever (and capture those graphs when they first draft)."""
        from services.drafter.client import DrafterClient

        addr = self.cfg.drafter_address
        client = DrafterClient(addr, transport="inline", timeout=DRAFTER_INFO_TIMEOUT_S)
        try:
            info = client.info()
        except Exception as e:  # noqa: BLE001 - any failure: the drafter is not usable yet, start anyway
            log.info("verifier: drafter %s not answering at start-up (%s); calibrating without its feature layers",
                     addr, e)
            return None
        finally:
            client.close()
        problem = self._drafter_mismatch(info)
        if problem:
            log.warning("verifier: drafter %s does not fit the target: %s", addr, problem)
            return None
        log.info("verifier: drafter %s reads target layers %s", addr, list(info.target_layer_ids))
        return list(info.target_layer_ids)

    def drafter_description(self) -> str:
        if self.cfg.drafter_address:
            return self.cfg.drafter_address
        if self.cfg.draft:
            where = f" on {self.drafter.device}" if self.drafter is not None else ""
            return f"inproc:{self.cfg.draft}{where}"
        return ""

    @property
    def ready(self) -> bool:
        return self._ready and not self._draining

    def close(self) -> None:
        """Cancel everything and let the worker threads go (they stop at their next step)."""
        self._draining = True
        for job in list(self._jobs):
            job.cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- Info --------------------------------------------------------------------------------------
    def info(self) -> pb.VerifierInfo:
        t = self.target
        model = pb.ModelInfo(
            id=t.name if t is not None else "",
            arch=t.cfg.arch if t is not None else "",
            n_vocab=t.cfg.n_vocab if t is not None else 0,
            context_length=self.max_ctx,
            speculative=bool(self.cfg.speculative and (self.cfg.draft or self.cfg.drafter_address)),
            created=self.created,
        )
        backend = getattr(getattr(t.model, "be", None), "name", "numpy") if t is not None else "numpy"
        kv = None
        if self.kv is not None:
            kv = pb.KVCacheInfo(cache_type_k=self.kv["cache_type_k"], cache_type_v=self.kv["cache_type_v"],
                                bytes_per_token=self.kv["kv_bytes_per_token"], max_ctx=self.kv["n_ctx"],
                                bytes_per_slot=self.kv["kv_bytes"])
        return pb.VerifierInfo(model=model, slots=self.cfg.slots, max_queue=self.cfg.max_queue,
                               active=self._active, queued=self._queued, backend=backend,
                               drafter_address=self.drafter_description(), kv_cache=kv)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.VerifierInfo:
        return self.info()

    # -- Generate ----------------------------------------------------------------------------------
    def _validate(self, request: pb.GenerateRequest) -> tuple[SamplingParams, bool, SpecConfig, int | None,
                                                              int | None]:
        """Raise InvalidRequestError / ContextOverflowError for anything the engine would reject."""
        top_logprobs = check_top_logprobs(request.top_logprobs if request.HasField("top_logprobs") else None)
        prompt_logprobs = check_top_logprobs(request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
                                             "prompt_logprobs")
        s = request.sampling
        # fields the client left unset: the model file's declared sampling (GGUF general.sampling.*)
        params = sampling_from_pb(s, self.target.sampling_defaults).validate()
        check_request(self.target.model, request.prompt_ids, request.max_tokens, self.max_ctx,
                      scoring=prompt_logprobs is not None, params=params)
        n_vocab = self.target.cfg.n_vocab
        bad = [t for t in request.stop_ids if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequestError(f"stop id {bad[0]} outside the vocabulary (0..{n_vocab - 1})",
                                      param="stop_ids")
        has_drafter = bool(self.cfg.draft or self.cfg.drafter_address)
        speculative = request.speculative if request.HasField("speculative") else self.cfg.speculative
        budget = self.cfg.budget
        if request.HasField("budget"):
            if not 0 <= request.budget <= MAX_BUDGET:
                raise InvalidRequestError(f"budget must be in 0..{MAX_BUDGET} (0 = chain), got {request.budget}",
                                          param="budget")
            budget = request.budget or None
            if budget is not None and self.width > 1:
                budget = min(budget, self.width - 1)     # the widest verify the memory plan counted
        return params, speculative and has_drafter, self._spec_config(budget), top_logprobs, prompt_logprobs

    def _spec_config(self, budget: int | str | None) -> SpecConfig:
        if budget == "auto":
            return SpecConfig.auto(self.tuner) if self.tuner is not None else SpecConfig()
        return SpecConfig(budget=budget)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        t_arrive = time.perf_counter()
        self.counters.requests += 1
        if not self._ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down")
        try:
            params, speculative, spec, top_logprobs, prompt_logprobs = self._validate(request)
        except ContextOverflowError as e:
            self.counters.invalid += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the prompt ({len(request.prompt_ids)} tokens) does not fit the context "
                                f"({self.max_ctx} tokens, the room for at least one generated token included)"
                                f": {e}")
        except InvalidRequestError as e:
            self.counters.invalid += 1
            where = f" [{e.param}]" if e.param else ""
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e}{where}")

        # Admission: a full queue answers at once rather than letting the caller wait without bound.
        if self._active + self._queued >= self.cfg.slots + self.cfg.max_queue:
            self.counters.rejected += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the verifier is busy: {self._active} running and {self._queued} queued "
                                f"(slots {self.cfg.slots}, max queue {self.cfg.max_queue}); retry later")

        request_id = request.request_id or uuid.uuid4().hex
        parent = _extract_context(context)
        span = self._tracer.start_span("verifier.generate", context=parent, kind=trace.SpanKind.SERVER)
        span.set_attributes({
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": self.target.name,
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
            "spec.enabled": speculative,
            "spec.mode": ("chain" if spec.chain else "ddtree") if speculative else "off",
        })
        if params.seed is not None:
            span.set_attribute("gen_ai.request.seed", params.seed)
        if params.penalized:   # the resolved values (the model file's defaults included)
            span.set_attribute("gen_ai.request.presence_penalty", params.presence_penalty)
            span.set_attribute("gen_ai.request.frequency_penalty", params.frequency_penalty)
            span.set_attribute("specsplit.request.repetition_penalty", params.repetition_penalty)
            span.set_attribute("specsplit.request.repeat_last_n", params.repeat_last_n)

        job: _Job | None = None
        status = "ok"
        span_open = True
        try:
            remaining = context.time_remaining()
            job = _Job(request_id=request_id, prompt_ids=list(request.prompt_ids), max_tokens=request.max_tokens,
                       params=params, stop_ids=list(request.stop_ids), speculative=speculative, spec=spec,
                       top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                       deadline=time.monotonic() + remaining if remaining is not None else None,
                       span=span, loop=asyncio.get_running_loop(), queue=asyncio.Queue())
            self._queued += 1
            try:
                await self._sem.acquire()
            finally:
                self._queued -= 1
            # From here the slot belongs to the worker: released when its thread returns (see _start).
            self._start(job)
            queue_ms = (time.perf_counter() - t_arrive) * 1e3
            span.set_attribute("gen_ai.latency.time_in_queue", queue_ms / 1e3)
            while True:
                kind, payload = await job.queue.get()
                if kind == "chunk":
                    tokens, lps, prompt_lps = payload
                    yield pb.GenerateChunk(token_ids=tokens, logprobs=logprobs_to_pb(lps),
                                           prompt_logprobs=logprobs_to_pb(prompt_lps))
                elif kind == "final":
                    span_open = False          # _final_chunk ends it with the totals
                    # The slot must be free before the client hears the end: a client that sends its next
                    # request at once would otherwise find this one still holding it (429 with max_queue 0).
                    await asyncio.wait({job.worker}, timeout=5.0)
                    yield self._final_chunk(job, payload, queue_ms)
                    self.counters.completed += 1
                    return
                elif kind == "stopped":
                    if job.stop_reason == "deadline":
                        status = "deadline"
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            "the request's deadline passed during generation")
                    status = "cancelled"
                    yield pb.GenerateChunk(finish_reason=pb.FINISH_REASON_CANCELLED)
                    return
                elif kind == "error":
                    status = "error"
                    raise payload
        except (asyncio.CancelledError, GeneratorExit):   # client went away / deadline / server stop
            status = "cancelled"
            raise
        except DeviceMemoryError as e:    # an allocation failed mid-request: this request only
            status = "out_of_memory"
            span.record_exception(e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except SpecsplitError as e:       # the engine rejected something validation did not catch
            status = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):     # context.abort above: already a status
                raise
            status = "error"
            self.counters.failed += 1
            log.error("verifier: request %s failed:\n%s", request_id, traceback.format_exc())
            span.record_exception(e)
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {type(e).__name__}: {e}")
        finally:
            if job is not None:
                job.cancel.set()          # no-op when finished; stops the engine at its next step otherwise
            if status == "cancelled":
                self.counters.cancelled += 1
            if span_open:
                span.set_attribute("verifier.status", status)
                if status not in ("ok", "cancelled"):
                    span.set_status(trace.Status(trace.StatusCode.ERROR, status))
                span.end()

    def _start(self, job: _Job) -> None:
        """Hand the held slot to a worker thread; the slot is released when that thread returns."""
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._run, job)
        except RuntimeError:                # the pool is shut down (stopping): give the slot back
            self._sem.release()
            raise
        self._active += 1
        self._jobs.add(job)
        job.worker = fut

        def release(_: Any) -> None:
            # Runs on the event loop once the worker thread has returned: only now is the slot free.
            self._active -= 1
            self._jobs.discard(job)
            self._sem.release()

        fut.add_done_callback(release)

    def _final_chunk(self, job: _Job, payload: tuple[list[int], list, list], queue_ms: float) -> pb.GenerateChunk:
        tokens, lps, prompt_lps = payload
        res = job.result
        spec = _spec_stats(res.spec, job)
        span = job.span
        span.set_attributes({
            "gen_ai.usage.output_tokens": len(res.token_ids),
            "gen_ai.response.finish_reasons": [res.finish_reason],
            "spec.steps": spec.steps,
            "spec.draft_tokens": spec.draft_tokens,
            "spec.accepted_tokens": spec.accepted_tokens,
            "spec.mean_acceptance_length": spec.mean_acceptance_length,
            "spec.draft_ms": spec.draft_ms,
            "spec.verify_ms": spec.verify_ms,
            "spec.accept_ms": spec.accept_ms,
            "spec.fallback": spec.fallback,
            "verifier.prompt_ms": res.prompt_ms,
            "verifier.decode_ms": res.decode_ms,
            "verifier.status": "ok",
        })
        if spec.budget:
            span.set_attribute("spec.budget", spec.budget)
        span.end()
        return pb.GenerateChunk(
            token_ids=tokens,
            logprobs=logprobs_to_pb(lps),
            prompt_logprobs=logprobs_to_pb(prompt_lps),
            finish_reason=_FINISH.get(res.finish_reason, pb.FINISH_REASON_LENGTH),
            usage=pb.Usage(prompt_tokens=res.prompt_tokens, completion_tokens=len(res.token_ids)),
            spec=spec,
            timings=pb.Timings(queue_ms=queue_ms, prompt_ms=res.prompt_ms, decode_ms=res.decode_ms),
        )

    # -- the worker thread -------------------------------------------------------------------------
    def _make_proposer(self, job: _Job) -> Proposer | None:
        if not job.speculative:
            return None

        def failed(reason: str) -> None:
            self._record_fallback(job, reason)

        if self.drafter is not None:
            return _GuardedProposer(self.drafter.new_proposer(), failed)
        from services.drafter.client import DrafterClient

        addr = self.cfg.drafter_address
        # Each propose() waits at most this long: a drafter slower than the deadline is no help, and a
        # shorter wait keeps a cancelled request from holding its slot behind a hung drafter for long.
        timeout = self.cfg.drafter_timeout_s
        if job.deadline is not None:
            timeout = max(0.05, min(timeout, job.deadline - time.monotonic()))
        now = time.monotonic()
        if now < self._drafter_down_until:
            # Recently unreachable: do not make every request pay a connect attempt (on a black-holed
            # host that is a full timeout each); one request per DRAFTER_RETRY_S probes again.
            return _GuardedProposer(_FailedProposer(self._drafter_down_reason), failed)
        try:
            # Made on the worker thread with the request span current: the Draft stream carries its
            # trace context, so the drafter's spans join this request's trace.
            client = DrafterClient(addr, timeout=min(timeout, DRAFTER_INFO_TIMEOUT_S),
                                   feature_dtype=self.cfg.draft_features)
            info = client.info()        # one Info per connection (cached); raises if unreachable
            client.timeout = timeout
        except Exception as e:          # unreachable: the engine falls back at its first draft
            reason = str(e) if isinstance(e, DrafterUnavailableError) else f"drafter {addr}: {type(e).__name__}: {e}"
            self._drafter_down_until = time.monotonic() + DRAFTER_RETRY_S
            self._drafter_down_reason = reason
            return _GuardedProposer(_FailedProposer(reason), failed)
        problem = self._drafter_mismatch(info)
        if problem:
            client.close()
            return _GuardedProposer(_FailedProposer(f"drafter {addr} does not fit the target: {problem}"), failed)
        # its answers are waited for with a GPU engine's lock released: the other slots step meanwhile
        return _GuardedProposer(client, failed, waiting=getattr(self._engine_lock, "released", contextlib.nullcontext))

    def _drafter_mismatch(self, info: Any) -> str:
        """Why a remote drafter cannot serve this target ('' when it can): its features would not exist."""
        cfg = self.target.cfg
        if info.n_vocab and info.n_vocab != cfg.n_vocab:
            return f"vocabulary {info.n_vocab} != target's {cfg.n_vocab}"
        bad = [i for i in info.target_layer_ids if not 0 <= i < cfg.n_layer]
        if bad:
            return f"target layer ids {bad} outside the target's {cfg.n_layer} layers"
        if info.hidden_size and info.hidden_size != cfg.n_embd:
            return f"hidden size {info.hidden_size} != target's {cfg.n_embd}"
        if info.block_size < 2:
            return f"block size {info.block_size}"
        return ""

    def _record_fallback(self, job: _Job, reason: str) -> None:
        if job.fallback_reason:
            return
        job.fallback_reason = reason
        log.warning("request %s: drafter failed after %d tokens (%s); continuing with plain decoding",
                    job.request_id, len(job.result.token_ids), reason)
        job.span.set_attribute("spec.fallback", True)
        job.span.add_event("spec.fallback", {"reason": reason, "tokens_so_far": len(job.result.token_ids)})
        job.loop.call_soon_threadsafe(self._count_fallback)

    def _count_fallback(self) -> None:
        self.counters.fallbacks += 1

    def _expired(self, job: _Job) -> bool:
        if job.cancel.is_set():
            job.stop_reason = job.stop_reason or "cancelled"
            return True
        if job.deadline is not None and time.monotonic() >= job.deadline:
            job.stop_reason = "deadline"
            return True
        return False

    def _run(self, job: _Job) -> None:
        """The engine loop of one request (worker thread). Checks the cancel flag between steps."""
        # The request span is current in this thread, so a DrafterClient made here sends its trace context.
        token = otel_context.attach(trace.set_span_in_context(job.span))
        proposer: Proposer | None = None
        gen = None
        try:
            if self._expired(job):
                job.put("stopped")
                return
            proposer = self._make_proposer(job)
            gen = speculative_stream(self.target.model, proposer, job.prompt_ids, job.max_tokens, job.params,
                                     job.spec, job.stop_ids, self.max_ctx, job.result,
                                     on_step=lambda info: self._step_spans(job, info),
                                     top_logprobs=job.top_logprobs, prompt_logprobs=job.prompt_logprobs)
            stop = set(job.stop_ids)
            n = 0
            prompt_sent = False

            def with_logprobs(chunk: list[int]) -> tuple[list[int], list, list]:
                """A chunk's tokens, their log-probabilities and (the first chunk sent) the prompt's."""
                nonlocal prompt_sent
                lps, plps = job.result.logprobs, job.result.prompt_logprobs
                first = not prompt_sent and plps is not None
                prompt_sent = True
                return chunk, ([] if lps is None else lps[n - len(chunk):n]), (plps if first else [])

            while True:
                if self._expired(job):
                    job.put("stopped")
                    return
                try:
                    with self._engine_lock:
                        chunk = next(gen)
                except StopIteration:
                    # Ended for a reason we could not see coming (the context filled up): the last chunk
                    # was already sent, so the totals go in an empty closing chunk (and a scored prompt that
                    # generated nothing its log-probabilities).
                    job.put("final", with_logprobs([]))
                    return
                n += len(chunk)
                if (chunk and chunk[-1] in stop) or n >= job.max_tokens:
                    # This is the last chunk: let the engine finish its bookkeeping (decode time, spec
                    # totals) so the chunk can carry them instead of needing one more message.
                    with self._engine_lock:
                        for _ in gen:
                            pass
                    job.put("final", with_logprobs(chunk))
                    return
                job.put("chunk", with_logprobs(chunk))
        except BaseException as e:          # noqa: BLE001 - handed to the event loop, which reports it
            job.put("error", self._out_of_memory(job, e) if is_out_of_memory(e) else e)
        finally:
            if gen is not None:
                with self._engine_lock:
                    gen.close()
            if proposer is not None:
                proposer.close()
            otel_context.detach(token)

    def _out_of_memory(self, job: _Job, e: BaseException) -> DeviceMemoryError:
        """A failed allocation during a request: log it, give cached device memory back, and say what to change
        (the state and the slot are released on the way out, as for any ending)."""
        device = self.cfg.device
        log.error("verifier: request %s ran out of memory on %s after %d tokens: %s: %s", job.request_id, device,
                  len(job.result.token_ids), type(e).__name__, e)
        release = getattr(self.target.model, "release_cached_memory", None)
        if release is not None:
            with self._engine_lock:
                release()
        job.loop.call_soon_threadsafe(self._count_oom)
        return DeviceMemoryError(
            f"out of memory on {device} after {len(job.result.token_ids)} generated tokens ({type(e).__name__}: "
            f"{e}); the request was stopped and the verifier goes on serving. If this repeats, restart it with a "
            f"smaller --max-ctx, --slots or --budget, or a cheaper --cache-type-k/-v (--plan-only shows the plan)",
            device=device)

    def _count_oom(self) -> None:
        self.counters.out_of_memory += 1

    def _step_spans(self, job: _Job, info: StepInfo) -> None:
        """spec.draft / spec.verify / spec.accept spans for one round, laid end to end ending now.

        The engine reports durations only; the three phases run back to back (the tree build, a few
        microseconds, is counted with the draft), so their times follow from the end of the accept.
        """
        end = _clock.now_ns()
        accept_start = end - int(info.accept_ms * 1e6)
        verify_start = accept_start - int(info.verify_ms * 1e6)
        draft_start = verify_start - int(info.draft_ms * 1e6)
        parent = trace.set_span_in_context(job.span)
        attrs = {"spec.step": info.index, "spec.budget": info.budget, "spec.tree_size": info.tree_size,
                 "spec.accepted_length": info.accepted}
        for name, start, stop, ms in (("spec.draft", draft_start, verify_start, info.draft_ms),
                                      ("spec.verify", verify_start, accept_start, info.verify_ms),
                                      ("spec.accept", accept_start, end, info.accept_ms)):
            s = self._tracer.start_span(name, context=parent, start_time=start, attributes=attrs)
            s.set_attribute(f"{name}_ms", ms)
            if name == "spec.draft" and info.drafter_ms is not None:    # a drafter service's own time of it
                s.set_attribute("spec.drafter_ms", info.drafter_ms)
            s.end(end_time=stop)


def _spec_stats(spec: dict | None, job: _Job) -> pb.SpecStats:
    if not spec:
        return pb.SpecStats(mode="off")
    mode = spec.get("mode", "off") if job.speculative else "off"
    budget = spec.get("budget")
    if budget is None:   # chain: report the nodes per step (block - 1), the same number spans carry
        budget = len(spec.get("per_position", [])) if job.speculative else 0
    return pb.SpecStats(
        mode=mode, budget=int(budget), steps=spec.get("steps", 0), draft_tokens=spec.get("draft_tokens", 0),
        accepted_tokens=spec.get("accepted", 0),
        mean_acceptance_length=float(spec.get("mean_acceptance_length", 0.0)),
        accepted_per_position=[int(x) for x in spec.get("per_position", [])],
        acceptance_histogram=[int(x) for x in spec.get("histogram", [])],
        draft_ms=float(spec.get("draft_ms", 0.0)), verify_ms=float(spec.get("verify_ms", 0.0)),
        accept_ms=float(spec.get("accept_ms", 0.0)), fallback=bool(spec.get("fallback", False)),
        fallback_reason=spec.get("fallback_reason", "") or job.fallback_reason,
        plain_steps=int(spec.get("plain_steps", 0)) if job.speculative else 0,
        drafter_ms=float(spec.get("drafter_ms", 0.0)),
    )


def _extract_context(context: grpc.aio.ServicerContext) -> otel_context.Context | None:
    """The caller's trace context from the gRPC metadata (W3C traceparent), or None."""
    from services import telemetry

    return telemetry.extract_context(context)



# --------------------------------------------------------------------------------------------------
# starting a verifier in this process

class VerifierServer:
    """A running verifier: the gRPC server, its servicer, and the background load (weights + warm-up)."""

    def __init__(self, running: Any, servicer: VerifierServicer, loading: asyncio.Task):
        self.running = running                  # services.rpc.RunningServer
        self.servicer = servicer
        self.loading = loading                  # done once ready (its exception, if loading failed)
        self._stopped = False

    @property
    def address(self) -> Any:
        """The bound services.rpc.Address (a tcp port 0 resolved to the real port; `.target` to dial)."""
        return self.running.address

    async def wait_loaded(self) -> None:
        """Wait for the weights and the warm-up; re-raises a loading failure (bad path, bad file)."""
        await asyncio.shield(self.loading)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: readiness NOT_SERVING and no new requests, in-flight ones get `grace` seconds
        (default cfg.shutdown_grace_s) to finish, then they are cancelled and their slots freed."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.servicer.cfg.shutdown_grace_s if grace is None else grace
        self.servicer._draining = True      # new Generate calls: UNAVAILABLE (retriable elsewhere)
        if not self.loading.done():
            self.loading.cancel()
        await self.running.stop(grace)      # cancels what is left after `grace`; their handlers set cancel
        self.servicer.close()
        c = self.servicer.counters
        log.info("verifier stopped: %d requests, %d completed, %d cancelled, %d rejected (queue full), "
                 "%d invalid, %d failed, %d out of memory, %d drafter fallbacks", c.requests, c.completed,
                 c.cancelled, c.rejected, c.invalid, c.failed, c.out_of_memory, c.fallbacks)

    async def wait_for_termination(self) -> None:
        await self.running.wait_for_termination()


async def serve_verifier(cfg: VerifierConfig, address: str, wait: bool = True) -> VerifierServer:
    """Start a Verifier on `address` (unix:///..., host:port, inproc:NAME) in the running event loop.

    The server listens at once (liveness SERVING, readiness "specsplit.v1.Verifier" NOT_SERVING); the
    model loads in a worker thread and one warm-up generation runs, then readiness turns SERVING.
    `wait=True` returns only then (raising if loading failed); `wait=False` returns immediately (use
    `await server.wait_loaded()` or a health wait_ready on a channel).
    """
    from services import rpc, telemetry

    if cfg.trace is not None:
        telemetry.configure_tracing(cfg.trace, "specsplit-verifier")
    servicer = VerifierServicer(cfg, tracer=telemetry.get_tracer("specsplit.verifier"))
    running = await rpc.start_server([(pb_grpc.add_VerifierServicer_to_server, servicer)], address,
                                     [SERVICE_NAME])

    async def load() -> None:
        try:
            await servicer.load()
        except SpecsplitError as e:         # a message for the operator; a traceback adds nothing
            log.error("verifier: cannot load: %s", e)
            raise
        except BaseException:
            log.exception("verifier: loading %s failed", cfg.model)
            raise
        await running.set_ready(SERVICE_NAME)

    loading = asyncio.ensure_future(load())
    server = VerifierServer(running, servicer, loading)
    if wait:
        try:
            await server.wait_loaded()
        except BaseException:
            await server.stop(0)
            raise
    return server
