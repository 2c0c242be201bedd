"""The public gRPC `Gateway` service: text in, text out, beside the HTTP API.

Same core as HTTP (tokenizer, template, stop strings, routing, metrics, spans). Text comes raw: a model's
`<think>` block stays in `text` (the chunk has no reasoning field). Errors are real gRPC statuses
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from services import telemetry
from services.engine.errors import InvalidRequestError
from services.wire import pb, pb_grpc, sampling_fields_set, sampling_from_pb

from .core import Delta, GatewayCore, GenerationRequest, Outcome
from .errors import APIError, invalid
from .openai_api import MAX_STOP, new_id, parse_top_logprobs

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
ENDPOINT = "grpc:Generate"


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        core = self.core
        info = core.pool.model_info()
        model = pb.ModelInfo(id=core.model_name, created=core.created)
        if info is not None:
            model.arch, model.n_vocab, model.context_length = info.arch, info.n_vocab, info.context_length
            model.speculative, model.created = info.speculative, info.created or core.created
        return pb.ListModelsResponse(models=[model])

    def _request(self, request: pb.PublicGenerateRequest, context: grpc.aio.ServicerContext,
                 arrived: float) -> GenerationRequest:
        core = self.core
        model = core.resolve_model(request.model or None)
        if request.max_tokens < 0:
            raise invalid(f"max_tokens must be >= 1 (0 = up to the context), got {request.max_tokens}",
                          "max_tokens")
        s = request.sampling
        try:
            sampling = sampling_from_pb(s).validate()
        except InvalidRequestError as e:
            raise invalid(str(e), e.param) from None
        top_logprobs = parse_top_logprobs(request.top_logprobs if request.HasField("top_logprobs") else None)
        if len(request.stop) > MAX_STOP:
            raise invalid(f"stop takes at most {MAX_STOP} sequences, got {len(request.stop)}", "stop")
        which = request.WhichOneof("input")
        if which == "prompt":
            operation = "text_completion"
            prompt_ids = core.encode(request.prompt, add_special=True)
        elif which == "chat":
            operation = "chat"
            msgs = [{"role": m.role, "content": m.content,
                     **({"reasoning_content": m.reasoning_content} if m.HasField("reasoning_content") else {})}
                    for m in request.chat.messages]
            if not msgs:
                raise invalid("chat.messages must not be empty", "messages")
            kwargs = {"enable_thinking": request.enable_thinking} if request.HasField("enable_thinking") else {}
            prompt_ids = core.encode(core.render_chat(msgs, None, kwargs), add_special=False)
        else:
            raise invalid("set either prompt or chat", "input")
        core.check_prompt(prompt_ids, param="messages" if which == "chat" else "prompt")
        return GenerationRequest(
            request_id=new_id("gen"), operation=operation, endpoint=ENDPOINT, model=model, prompt_ids=prompt_ids,
            max_tokens=request.max_tokens or None, sampling=sampling, sampling_set=frozenset(sampling_fields_set(s)),
            stop=[x for x in request.stop if x], top_logprobs=top_logprobs,
            timeout=context.time_remaining(), arrived=arrived,
            trace_context=telemetry.extract_context(context))

    def _logprobs(self, lps: list) -> list:
        def text(token: int, logprob: float) -> pb.TokenText:
            t, data = self.core.token_text(token)
            return pb.TokenText(token_id=token, token=t, bytes=data, logprob=logprob)

        return [pb.PublicTokenLogprob(chosen=text(lp.token, lp.logprob), top=[text(i, v) for i, v in lp.top])
                for lp in lps]

    async def Generate(self, request: pb.PublicGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.PublicGenerateChunk]:
        core = self.core
        status: int | str = 200
        try:
            req = self._request(request, context, time.perf_counter())
            async with core.open(req) as gen:
                sent = sent_lps = 0
                while True:
                    ev = await gen.next()
                    if isinstance(ev, Delta):
                        sent += len(ev.token_ids)
                        sent_lps += len(ev.logprobs)
                        yield pb.PublicGenerateChunk(text=ev.content + ev.reasoning, token_ids=ev.token_ids,
                                                     logprobs=self._logprobs(ev.logprobs))
                    elif isinstance(ev, Outcome):
                        yield pb.PublicGenerateChunk(
                            token_ids=ev.token_ids[sent:], finish_reason=_FINISH.get(ev.finish_reason,
                                                                                     pb.FINISH_REASON_STOP),
                            usage=pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
                            spec=ev.spec, logprobs=self._logprobs((ev.logprobs or [])[sent_lps:]))
                        return
        except APIError as e:
            status = e.status
            await context.abort(e.grpc_code, e.message)
        except BaseException:
            status = 499 if context.cancelled() else 500
            raise
        finally:
            core.metrics.observe_request(ENDPOINT, status)
