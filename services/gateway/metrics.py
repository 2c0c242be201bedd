"""Prometheus metrics of one gateway, in a private registry (tests run several gateways in one process).

Names carry the `specsplit:` prefix; the speculative-decoding counters copy vLLM's names
(`spec_decode_num_drafts_total`, ...) so existing PromQL and dashboards carry over (serving.md §5):
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts (bonus included).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "specsplit:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """All metrics of one gateway; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = PREFIX
        self.requests = Counter(p + "requests", "HTTP and gRPC requests by endpoint and final status",
                                ["endpoint", "status"], registry=r)
        self.requests_running = Gauge(p + "requests_running", "requests being generated now", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time from request to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "time between generated tokens (a chunk of n tokens counts n gaps of dt/n)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request latency, arrival to last byte",
                             buckets=_E2E_BUCKETS, registry=r)
        self.tokens_per_second = Histogram(p + "request_generation_tokens_per_second",
                                           "decode speed of each finished request",
                                           buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000), registry=r)
        # vLLM-compatible speculative-decoding counters.
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "verify steps that checked a draft", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens",
                                           "draft tokens accepted (bonus tokens not counted)", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "accepted draft tokens by position in the block", ["position"],
                                        registry=r)
        self.mean_acceptance_length = Gauge(p + "spec_decode_mean_acceptance_length",
                                            "1 + accepted / drafts since start (bonus token included)",
                                            registry=r)
        self.draft_seconds = Counter(p + "spec_decode_draft_seconds", "time spent drafting", registry=r)
        self.drafter_seconds = Counter(p + "spec_decode_drafter_seconds",
                                       "time a drafter service spent on its drafts, as it reported them (0 with an "
                                       "in-process drafter); beside draft_seconds, what the steps waited", registry=r)
        self.verify_seconds = Counter(p + "spec_decode_verify_seconds", "time spent verifying", registry=r)
        self.draft_step = Histogram(p + "spec_decode_draft_step_seconds",
                                    "mean draft time per step of each request", buckets=_STEP_BUCKETS, registry=r)
        self.verify_step = Histogram(p + "spec_decode_verify_step_seconds",
                                     "mean verify time per step of each request", buckets=_STEP_BUCKETS,
                                     registry=r)
        self.fallbacks = Counter(p + "spec_decode_fallbacks",
                                 "requests that finished with plain decoding because the drafter failed",
                                 registry=r)
        # What each ready verifier allocates for attention KV (from its Info): capacity planning.
        self.kv_bytes_per_token = Gauge(p + "kv_cache_bytes_per_token",
                                        "KV cache bytes per token (K + V, all attention layers)",
                                        ["verifier", "cache_type_k", "cache_type_v"], registry=r)
        self.kv_capacity_tokens = Gauge(p + "kv_cache_capacity_tokens",
                                        "tokens the verifier's KV slots hold (max_ctx x slots)", ["verifier"],
                                        registry=r)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "KV cache bytes the verifier allocates over all slots",
                              ["verifier"], registry=r)
        self._drafts_total = 0
        self._accepted_total = 0

    def observe_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def observe_chunk(self, n_tokens: int, gap_s: float) -> None:
        """A chunk of `n_tokens` arrived `gap_s` after the previous one (not the first chunk)."""
        if n_tokens <= 0:
            return
        per = gap_s / n_tokens
        for _ in range(n_tokens):
            self.itl.observe(per)

    def observe_spec(self, spec) -> None:
        """Fold one request's SpecStats (the proto message) into the counters."""
        if spec is None:
            return
        if spec.fallback:
            self.fallbacks.inc()
        steps = int(spec.steps)
        if spec.mode in ("", "off") and not spec.draft_tokens:
            return
        self.num_drafts.inc(steps)
        self.num_draft_tokens.inc(int(spec.draft_tokens))
        self.num_accepted_tokens.inc(int(spec.accepted_tokens))
        for pos, n in enumerate(spec.accepted_per_position):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(int(n))
        self._drafts_total += steps
        self._accepted_total += int(spec.accepted_tokens)
        if self._drafts_total:
            self.mean_acceptance_length.set(1.0 + self._accepted_total / self._drafts_total)
        self.draft_seconds.inc(spec.draft_ms / 1e3)
        self.drafter_seconds.inc(spec.drafter_ms / 1e3)
        self.verify_seconds.inc(spec.verify_ms / 1e3)
        if steps:
            self.draft_step.observe(spec.draft_ms / 1e3 / steps)
            self.verify_step.observe(spec.verify_ms / 1e3 / steps)

    def observe_verifiers(self, endpoints) -> None:
        """Set the KV gauges from the verifiers' Info (pool endpoints); called before each render."""
        for ep in endpoints:
            info = getattr(ep, "info", None)
            if info is None or not info.HasField("kv_cache"):
                continue
            kv = info.kv_cache
            self.kv_bytes_per_token.labels(verifier=ep.address, cache_type_k=kv.cache_type_k,
                                           cache_type_v=kv.cache_type_v).set(kv.bytes_per_token)
            self.kv_capacity_tokens.labels(verifier=ep.address).set(kv.max_ctx * max(1, info.slots))
            self.kv_bytes.labels(verifier=ep.address).set(kv.bytes_per_slot * max(1, info.slots))

    def render(self) -> bytes:
        return generate_latest(self.registry)
