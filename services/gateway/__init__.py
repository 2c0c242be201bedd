"""The gateway: OpenAI-compatible HTTP API and public gRPC API in front of one or more verifiers.

It loads no weights, only the target's tokenizer and chat template. Modules: `core` (tokenize, route,
stream tokens through stop strings and the reasoning split), `http` (aiohttp routes, SSE), `grpc_api`
(the public Gateway service), `pool` (verifier readiness and least-outstanding routing), `metrics`
(Prometheus), `server` (start/stop both listeners), `cli` (`specsplit gateway`).
"""
