"""The gateway's protocol-neutral core: tokenizer + chat template, one generation against a verifier.

Both front ends (OpenAI HTTP and the public gRPC `Gateway` service) turn a request into a
`GenerationRequest` and consume a `Generation`: a producer task reads the verifier's token stream, runs
it through the `TextAssembler` (stop strings, reasoning split) and queues `Delta`s and one final
`Outcome`. A queue between producer and consumer lets the HTTP side wait for the next event with a
timeout (SSE keep-alive pings) without cancelling the gRPC read, and leaving the `async with` cancels
the producer, which cancels the verifier call and frees its KV slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.engine.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from services.engine.errors import SpecsplitError
from services.engine.formats import open_model_file
from services.engine.logprobs import TokenLogprob
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.wire import logprobs_from_pb, pb, sampling_to_pb

from .errors import APIError, context_exceeded, from_engine, from_grpc, prompt_param, unavailable
from .metrics import GatewayMetrics
from .pool import VerifierEndpoint, VerifierPool
from .textstream import TextAssembler, think_token_ids
from .toolcalls import ToolCall, ToolCallParser

log = logging.getLogger("specsplit.gateway")

PROVIDER = "specsplit"

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
}


# ------------------------------------------------------------------------------------------ tokenizer


@dataclass
class TokenizerSource:
    """What the gateway needs of the target model: no weights, only tokenizer, template and a name."""

    path: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    name: str


def load_tokenizer_source(path: str) -> TokenizerSource:
    """Read tokenizer and chat template from a target GGUF (memory-mapped metadata only) or HF folder."""
    mf = open_model_file(path)
    if mf.kind == "gguf":
        if "tokenizer.ggml.tokens" not in mf.metadata:
            raise SpecsplitError(f"{path} carries no tokenizer (tokenizer.ggml.tokens); the gateway needs one")
        tok = Tokenizer.from_gguf_metadata(mf.metadata, path=mf.path)
        name = str(mf.metadata.get("general.name") or "")
    else:
        folder = mf.path if os.path.isdir(mf.path) else os.path.dirname(mf.path)
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            raise SpecsplitError(f"{path} has no tokenizer.json; the gateway needs the model's tokenizer")
        tok = Tokenizer.from_hf_folder(folder)
        name = ""
    base = os.path.basename(os.path.normpath(path))
    name = name or (base[:-5] if base.endswith(".gguf") else base)
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = next((s for s in ("<|im_end|>", "<|endoftext|>") if tok.token_to_id(s) is not None), "")
    tmpl = ChatTemplate(tok.chat_template or DEFAULT_CHATML_TEMPLATE, bos_token=bos or "", eos_token=eos,
                        source=path)
    return TokenizerSource(path=path, tokenizer=tok, chat_template=tmpl, name=name)


# ------------------------------------------------------------------------------------------ requests


@dataclass
class GenerationRequest:
    request_id: str
    operation: str                          # "chat" | "text_completion" (gen_ai.operation.name)
    endpoint: str                           # for metrics labels, e.g. "/v1/chat/completions"
    model: str
    prompt_ids: list[int]
    max_tokens: int | None = None           # None: up to the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # the sampling fields the client set; the verifier fills the others from its model's declared defaults
    # (GGUF general.sampling.*). None: all of them (the engine's defaults are sent as they are)
    sampling_set: frozenset[str] | None = None
    stop: list[str] = field(default_factory=list)
    split_reasoning: bool = False
    in_reasoning: bool = False              # the prompt opened a think block
    timeout: float | None = None            # seconds; becomes the gRPC deadline
    ignore_eos: bool = False                # do not stop at the model's end-of-sequence tokens
    top_logprobs: int | None = None         # set (0..20): each token's log-probability and that many alternatives
    prompt_logprobs: int | None = None      # set (0..20): the prompt's tokens' too (completions' `echo`)
    tools: list[dict] | None = None         # set: the answer's `<tool_call>` blocks become tool calls
    arrived: float = field(default_factory=time.perf_counter)
    trace_context: Context | None = None    # extracted from the client's traceparent


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)   # tokens consumed since the previous Delta
    # their log-probabilities when the request asked (end-of-sequence tokens left out: they have no text)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Outcome:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    spec: Any = None                        # pb.SpecStats of the verifier's last chunk, if it came
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    stop_string: str | None = None
    # every generated token's log-probability but the end-of-sequence ones', when the request asked (else None);
    # a stream's Deltas carried a prefix of it
    logprobs: list[TokenLogprob] | None = None
    # the prompt's tokens' after the first, when the request asked (prompt_logprobs set), else None
    prompt_logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)   # every call the answer made, in order

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0}}

    @property
    def timings(self) -> dict:
        """llama.cpp's `timings` object; draft_n / draft_n_accepted only when > 0 (as llama.cpp does)."""
        pn, pms = self.prompt_tokens, self.prompt_ms
        n, ms = self.completion_tokens, self.predicted_ms
        t = {
            "cache_n": 0,
            "prompt_n": pn,
            "prompt_ms": round(pms, 3),
            "prompt_per_token_ms": round(pms / pn, 3) if pn else 0.0,
            "prompt_per_second": round(pn / (pms / 1e3), 3) if pms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": round(ms, 3),
            "predicted_per_token_ms": round(ms / n, 3) if n else 0.0,
            "predicted_per_second": round(n / (ms / 1e3), 3) if ms > 0 else 0.0,
        }
        if self.spec is not None:
            if self.spec.draft_tokens > 0:
                t["draft_n"] = int(self.spec.draft_tokens)
            if self.spec.accepted_tokens > 0:
                t["draft_n_accepted"] = int(self.spec.accepted_tokens)
            if self.spec.steps > 0 and self.spec.draft_tokens > 0:
                # Our extension (SGLang's spec_verify_ct): verify passes, so clients can compute the mean
                # acceptance length (draft_n_accepted + draft_steps) / draft_steps.
                t["draft_steps"] = int(self.spec.steps)
        return t


Event = Delta | Outcome


# ------------------------------------------------------------------------------------------- the core


class GatewayCore:
    """Tokenizer, verifier pool, metrics and tracer shared by the HTTP and gRPC front ends."""

    def __init__(self, source: TokenizerSource, pool: VerifierPool, metrics: GatewayMetrics | None = None,
                 model_name: str | None = None, tracer: trace.Tracer | None = None,
                 default_timeout: float | None = None):
        self.source = source
        self.tokenizer = source.tokenizer
        self.template = source.chat_template
        self.pool = pool
        self.metrics = metrics or GatewayMetrics()
        self.model_name = model_name or source.name
        self.tracer = tracer or trace.get_tracer("specsplit.gateway")
        self.default_timeout = default_timeout
        self.think_ids = think_token_ids(self.tokenizer)
        self.stop_ids = sorted(self.tokenizer.eos_ids)
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------- model names

    def model_names(self) -> set[str]:
        names = {self.model_name, self.source.name}
        info = self.pool.model_info()
        if info is not None and info.id:
            names.add(info.id)
        return names

    def resolve_model(self, requested: str | None) -> str:
        """The served name for a request's `model` (absent = the default, like llama.cpp); 404 if unknown."""
        if requested is None or requested == "" or requested in self.model_names():
            return self.model_name
        raise APIError(404, f"The model `{requested}` does not exist.", param="model")

    def context_length(self) -> int | None:
        info = self.pool.model_info()
        return int(info.context_length) if info is not None and info.context_length > 0 else None

    # --------------------------------------------------------------------------------------- prompting

    def render_chat(self, messages: list, tools: list | None, kwargs: dict) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
        except SpecsplitError as e:
            raise from_engine(e) from None

    def encode(self, text: str, add_special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """A token as log-probability listings show it: its bytes decoded (U+FFFD for part of a character), and
        the bytes."""
        data = self.tokenizer.token_bytes(int(token_id))
        return data.decode("utf-8", errors="replace"), data

    def check_prompt(self, prompt_ids: list[int], endpoint: VerifierEndpoint | None = None,
                     param: str = "prompt") -> int | None:
        """Raise 400 when the prompt cannot fit (blamed on `param`: prompt_param); return the context length used
        (None if unknown yet)."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        n_vocab = self.tokenizer.vocab_size
        info = endpoint.info.model if endpoint is not None and endpoint.info is not None else self.pool.model_info()
        if info is not None and info.n_vocab > 0:
            n_vocab = int(info.n_vocab)
        bad = next((t for t in prompt_ids if not 0 <= int(t) < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                           param="prompt")
        ctx = int(info.context_length) if info is not None and info.context_length > 0 else None
        if ctx is not None and len(prompt_ids) >= ctx:
            raise context_exceeded(len(prompt_ids) + 1, ctx, param)
        return ctx

    # -------------------------------------------------------------------------------------- generation

    def open(self, req: GenerationRequest) -> Generation:
        return Generation(self, req)


class Generation:
    """One running request. Use as `async with core.open(req) as g: ev = await g.next()`."""

    def __init__(self, core: GatewayCore, req: GenerationRequest):
        self.core = core
        self.req = req
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._pending: asyncio.Task | None = None
        self.span: trace.Span | None = None
        self.outcome: Outcome | None = None
        self.first_token_at: float | None = None
        self._attributed = 0                    # token ids already handed out with a Delta
        self._token_lps: list[TokenLogprob] = []  # one per token id received, when the request asked
        self._prompt_lps: list[TokenLogprob] | None = None
        self._tools = ToolCallParser(req.tools) if req.tools else None
        self._calls: list[ToolCall] = []

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's tokens' log-probabilities (after the first), once the verifier's first chunk came."""
        return self._prompt_lps

    async def __aenter__(self) -> Generation:
        req = self.req
        span_attrs: dict[str, Any] = {
            "gen_ai.operation.name": req.operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": req.model,
            "gen_ai.response.id": req.request_id,
            "gen_ai.request.temperature": float(req.sampling.temperature),
            "gen_ai.request.top_p": float(req.sampling.top_p),
            "gen_ai.request.top_k": int(req.sampling.top_k),
        }
        if req.max_tokens is not None:
            span_attrs["gen_ai.request.max_tokens"] = int(req.max_tokens)
        if req.sampling.seed is not None:
            span_attrs["gen_ai.request.seed"] = int(req.sampling.seed)
        if req.stop:
            span_attrs["gen_ai.request.stop_sequences"] = list(req.stop)
        self.span = self.core.tracer.start_span(f"{req.operation} {req.model}", context=req.trace_context,
                                                kind=SpanKind.SERVER, attributes=span_attrs)
        # The producer task copies the current context when created: with the span current, the gRPC
        # client interceptor injects its traceparent into the verifier call's metadata.
        with trace.use_span(self.span, end_on_exit=False):
            self._task = asyncio.create_task(self._produce(), name=f"generate {req.request_id}")
        self.core.metrics.requests_running.inc()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        for t in (self._pending, self._task):
            if t is not None and not t.done():
                t.cancel()
        for t in (self._pending, self._task):
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self.core.metrics.requests_running.dec()
        span = self.span
        if span is not None:
            if self.outcome is None:
                if exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                    err = exc if isinstance(exc, APIError) else None
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    span.set_attribute("error.type", err.type if err is not None else type(exc).__name__)
                else:
                    span.set_attribute("error.type", "cancelled")
            span.end()

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event; None when `timeout` passed first (the read goes on). Raises APIError."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return None
        item = self._pending.result()
        self._pending = None
        if isinstance(item, BaseException):
            if self.span is not None:
                self.span.set_status(Status(StatusCode.ERROR, str(item)))
                if isinstance(item, APIError):
                    self.span.set_attribute("error.type", item.type)
            raise item
        return item

    async def collect(self) -> tuple[str, str, Outcome]:
        """Run to the end: (content, reasoning, outcome); the outcome holds the tool calls."""
        content, reasoning = [], []
        while True:
            ev = await self.next()
            if isinstance(ev, Outcome):
                return "".join(content), "".join(reasoning), ev
            if isinstance(ev, Delta):
                content.append(ev.content)
                reasoning.append(ev.reasoning)

    # ----------------------------------------------------------------------------------------- producer

    async def _produce(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except APIError as e:
            self._queue.put_nowait(e)
        except grpc.aio.AioRpcError as e:
            self._queue.put_nowait(from_grpc(e, prompt_param(self.req.operation)))
        except SpecsplitError as e:
            self._queue.put_nowait(from_engine(e, prompt_param(self.req.operation)))
        except Exception as e:       # a bug must reach the client as a 500, not a hung stream
            log.exception("generation %s failed", self.req.request_id)
            self._queue.put_nowait(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def _grpc_request(self, ctx: int | None) -> pb.GenerateRequest:
        req = self.req
        max_tokens = req.max_tokens
        if ctx is not None:
            room = ctx - len(req.prompt_ids)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        elif max_tokens is None:
            max_tokens = 0                      # unknown context: the verifier's own limit decides
        sampling = sampling_to_pb(req.sampling, None if req.sampling_set is None else sorted(req.sampling_set))
        out = pb.GenerateRequest(request_id=req.request_id, prompt_ids=req.prompt_ids, max_tokens=max_tokens,
                                 sampling=sampling, stop_ids=self._stop_ids())
        if req.top_logprobs is not None:
            out.top_logprobs = req.top_logprobs
        if req.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        return out

    def _stop_ids(self) -> list[int]:
        return [] if self.req.ignore_eos else self.core.stop_ids

    async def _run(self) -> None:
        core, req = self.core, self.req
        timeout = req.timeout if req.timeout is not None else core.default_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        asm = TextAssembler(core.tokenizer, stop=req.stop, stop_ids=self._stop_ids(),
                            think_ids=core.think_ids if req.split_reasoning else None,
                            in_reasoning=req.in_reasoning)
        token_ids: list[int] = []
        last = None
        tried: set[str] = set()
        while True:
            ep = core.pool.pick(exclude=tried)
            ctx = core.check_prompt(req.prompt_ids, ep, prompt_param(req.operation))
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            ep.outstanding += 1
            call = ep.stub.Generate(self._grpc_request(ctx), timeout=left)
            try:
                async for chunk in call:
                    now = time.perf_counter()
                    if chunk.token_ids:
                        if self.first_token_at is None:
                            self.first_token_at = now
                            core.metrics.ttft.observe(now - req.arrived)
                        elif last is not None:
                            core.metrics.observe_chunk(len(chunk.token_ids), now - last)
                        last = now
                    lps = self._chunk_logprobs(chunk)
                    if self._prompt_lps is None and req.prompt_logprobs is not None:
                        self._prompt_lps = self._chunk_prompt_logprobs(chunk)
                    for j, t in enumerate(chunk.token_ids):
                        token_ids.append(int(t))
                        if lps is not None:
                            self._token_lps.append(lps[j])
                        self._emit(asm.push(t), token_ids)
                        if asm.stopped:
                            break
                    if asm.stopped:
                        # Matched a stop string: stop the verifier now, its slot is wanted elsewhere.
                        call.cancel()
                        self._finish(asm, token_ids, "stop", None)
                        return
                    if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        self._emit(asm.finish(), token_ids)
                        if chunk.finish_reason == pb.FINISH_REASON_CANCELLED:
                            raise unavailable("the verifier cancelled the request")
                        self._finish(asm, token_ids, _FINISH.get(chunk.finish_reason, "stop"), chunk)
                        return
                raise APIError(502, "the verifier closed the stream without a finish reason",
                               type="server_error")
            except grpc.aio.AioRpcError as e:
                # Nothing reached the client yet and this verifier is down or full: another may take it.
                retriable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                if e.code() in retriable and not token_ids:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        core.pool.mark_down(ep, f"Generate failed: {e.details()}")
                    tried.add(ep.address)
                    if any(r.address not in tried for r in core.pool.ready):
                        continue
                raise
            finally:
                ep.outstanding -= 1
                if not call.done():
                    call.cancel()

    def _chunk_logprobs(self, chunk: Any) -> list[TokenLogprob] | None:
        if self.req.top_logprobs is None:
            return None
        if len(chunk.logprobs) != len(chunk.token_ids):
            raise APIError(502, f"the verifier sent {len(chunk.logprobs)} log-probabilities for "
                                f"{len(chunk.token_ids)} tokens", type="server_error")
        return logprobs_from_pb(chunk.logprobs)

    def _chunk_prompt_logprobs(self, chunk: Any) -> list[TokenLogprob]:
        want = len(self.req.prompt_ids) - 1
        if len(chunk.prompt_logprobs) != want:
            raise APIError(502, f"the verifier sent {len(chunk.prompt_logprobs)} prompt log-probabilities for a "
                                f"{want + 1}-token prompt", type="server_error")
        return logprobs_from_pb(chunk.prompt_logprobs)

    def _listed(self, lps: list[TokenLogprob]) -> list[TokenLogprob]:
        """The log-probabilities a client sees: end-of-sequence tokens' left out (their text is never shown)."""
        stop = set(self._stop_ids())
        return [lp for lp in lps if lp.token not in stop]

    def _emit(self, pieces, token_ids: list[int]) -> None:
        for p in pieces:
            if p.channel == "reasoning":
                self._put(Delta(reasoning=p.text), token_ids)
            elif self._tools is None:
                self._put(Delta(content=p.text), token_ids)
            else:       # the content channel through the tool-call parser: text, or a whole call
                self._put_parsed(self._tools.push(p.text), token_ids)

    def _put_parsed(self, events: list, token_ids: list[int]) -> None:
        for ev in events:
            if isinstance(ev, ToolCall):
                self._calls.append(ev)
                self._put(Delta(tool_calls=[ev]), token_ids)
            elif ev:
                self._put(Delta(content=ev), token_ids)

    def _put(self, delta: Delta, token_ids: list[int]) -> None:
        """Queue a Delta with the tokens consumed since the last one (and their log-probabilities)."""
        delta.token_ids = token_ids[self._attributed:]
        delta.logprobs = self._listed(self._token_lps[self._attributed:])
        self._attributed = len(token_ids)
        self._queue.put_nowait(delta)

    def _finish(self, asm: TextAssembler, token_ids: list[int], finish: str, last: Any) -> None:
        req, core = self.req, self.core
        if self._tools is not None:     # what the parser held back: text, or a call the answer ended in
            self._put_parsed(self._tools.finish(), token_ids)
        now = time.perf_counter()
        spec = last.spec if last is not None and last.HasField("spec") else None
        n_prompt = len(req.prompt_ids)
        n_gen = len(token_ids)              # after a stop-string match: tokens up to the matching one
        if asm.stopped:
            finish = "stop"
        elif last is not None and last.HasField("usage") and last.usage.completion_tokens > 0:
            n_gen = int(last.usage.completion_tokens)
        if self._calls and finish == "stop":    # OpenAI's reason when the answer called tools
            finish = "tool_calls"
        first = self.first_token_at
        prompt_ms = ((first if first is not None else now) - req.arrived) * 1e3
        predicted_ms = (now - first) * 1e3 if first is not None else 0.0
        if last is not None and last.HasField("timings"):
            if last.timings.prompt_ms > 0:
                prompt_ms = float(last.timings.prompt_ms)
            if last.timings.decode_ms > 0:
                predicted_ms = float(last.timings.decode_ms)
        out = Outcome(finish_reason=finish, prompt_tokens=n_prompt, completion_tokens=n_gen,
                      token_ids=token_ids[:n_gen], spec=spec, prompt_ms=prompt_ms, predicted_ms=predicted_ms,
                      stop_string=asm.matched_stop,
                      logprobs=None if req.top_logprobs is None else self._listed(self._token_lps[:n_gen]),
                      prompt_logprobs=self._prompt_lps, tool_calls=list(self._calls))
        self.outcome = out
        m = core.metrics
        m.observe_tokens(n_prompt, n_gen)
        m.e2e.observe(now - req.arrived)
        if predicted_ms > 0 and n_gen > 0:
            m.tokens_per_second.observe(n_gen / (predicted_ms / 1e3))
        m.observe_spec(spec)
        if self.span is not None:
            s = self.span
            s.set_attribute("gen_ai.response.model", req.model)
            s.set_attribute("gen_ai.response.finish_reasons", [finish])
            s.set_attribute("gen_ai.usage.input_tokens", n_prompt)
            s.set_attribute("gen_ai.usage.output_tokens", n_gen)
            if spec is not None:
                s.set_attribute("spec.mode", spec.mode)
                s.set_attribute("spec.steps", int(spec.steps))
                s.set_attribute("spec.draft_tokens", int(spec.draft_tokens))
                s.set_attribute("spec.accepted_tokens", int(spec.accepted_tokens))
                s.set_attribute("spec.fallback", bool(spec.fallback))
        self._queue.put_nowait(out)
