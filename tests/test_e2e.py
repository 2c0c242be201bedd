"""Process-level integration: THREE real processes (drafter, verifier --drafter, gateway) over unix sockets,
driven by the real `openai` client.

Checks: chat and completions, streaming and not; greedy output equal to `specsplit generate --json` (plain
decoding, no drafter) for the same prompt ids; usage and timings (draft_n > 0); bad requests get the right
status while the server keeps serving; a client disconnect frees the verifier slot; 50 concurrent requests
against one slot and a small queue each complete or get 429 (none hang); one request yields one trace
across the three processes (console exporters, parsed from each process's stdout) with spec.draft /
spec.verify / spec.accept spans matching the response's draft steps; killing the drafter mid-request
still completes the request with the same tokens.

Every wait polls a condition against a deadline (health endpoints, gRPC health, span files); processes
are stopped in finalizers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from services.gateway.core import load_tokenizer_source
from services.healthcheck import check
from services.wire import pb, pb_grpc

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 120.0
SLOTS, MAX_QUEUE = 1, 2


class Proc:
    """One `python -m services ...` process with its stdout (spans) and stderr (logs) in files."""

    def __init__(self, name: str, args: list[str], folder: Path):
        self.name, self.args = name, args
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        self.popen: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        with open(self.out, "ab") as out, open(self.err, "ab") as err:
            self.popen = subprocess.Popen([sys.executable, "-m", "services", *self.args], cwd=ROOT, env=env,
                                          stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def logs(self) -> str:
        return self.err.read_text(errors="replace")[-4000:] if self.err.exists() else ""

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(10)

    def stop(self) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_until(cond, what: str, procs: list[Proc], timeout: float = START_TIMEOUT, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise AssertionError(f"{dead[0].name} exited ({dead[0].popen.returncode}) while waiting for {what}:\n"
                                 f"{dead[0].logs()}")
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(f"--- {p.name}\n{p.logs()}" for p in procs))


def grpc_ready(address: str, service: str) -> bool:
    return check(address, service, timeout=1.0)[0]


def wait_drafter(p: Proc, address: str) -> None:
    wait_until(lambda: grpc_ready(address, "specsplit.v1.Drafter"), "drafter readiness", [p])


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    _, target, drafter = tiny_pair
    folder = tmp_path_factory.mktemp("e2e")
    # Unix socket paths must stay under ~100 bytes: keep them short, in a folder of their own.
    import tempfile

    sockdir = Path(tempfile.mkdtemp(prefix="ss-"))
    d_addr, v_addr = f"unix://{sockdir}/d.sock", f"unix://{sockdir}/v.sock"
    procs: list[Proc] = []
    try:
        d = Proc("drafter", ["drafter", "--model", target, "--draft", drafter, "--listen", d_addr,
                             "--trace", "console"], folder)
        procs.append(d)
        v = Proc("verifier", ["verifier", "--model", target, "--drafter", d_addr, "--listen", v_addr,
                              "--slots", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--trace", "console"], folder)
        procs.append(v)
        g = Proc("gateway", ["gateway", "--model", target, "--verifier", v_addr, "--host", "127.0.0.1",
                             "--port", "0", "--trace", "console", "--ping-interval", "5"], folder)
        procs.append(g)
        wait_drafter(d, d_addr)
        wait_until(lambda: grpc_ready(v_addr, "specsplit.v1.Verifier"), "verifier readiness", procs)
        url = wait_until(lambda: (m := re.search(r"gateway on (http://\S+)", g.logs())) and m.group(1),
                         "gateway listening", procs)
        wait_until(lambda: _health(url) == 200, "gateway /health 200", procs)
        source = load_tokenizer_source(target)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield {"url": url, "client": client, "drafter": d, "verifier": v, "gateway": g, "procs": procs,
               "d_addr": d_addr, "v_addr": v_addr, "target": target, "model": client.models.list().data[0].id,
               "tok": source.tokenizer, "template": source.chat_template}
    finally:
        for p in reversed(procs):
            p.stop()
        import shutil

        shutil.rmtree(sockdir, ignore_errors=True)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of one plain HTTP request (stdlib: error statuses are answers, not exceptions)."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _health(url: str) -> int:
    try:
        return http("GET", f"{url}/health", timeout=2)[0]
    except OSError:
        return 0


_REFS: dict[tuple, dict] = {}


def reference(target: str | None, prompt_ids: list[int], max_tokens: int, extra: tuple[str, ...] = ()) -> dict:
    """`specsplit generate --json` (plain decoding, no drafter) for these prompt ids (target None: the embedded
    default model); `extra`: more options (sampling)."""
    key = (target, tuple(prompt_ids), max_tokens, extra)
    if key not in _REFS:
        model = ["--model", target] if target else ["--no-draft"]
        out = subprocess.run([sys.executable, "-m", "services", "generate", *model, "--prompt-ids",
                              ",".join(map(str, prompt_ids)), "--max-tokens", str(max_tokens), "--json", *extra],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                             text=True, timeout=120, check=True)
        _REFS[key] = json.loads(out.stdout)
    return _REFS[key]


def chat_prompt_ids(c, messages: list[dict]) -> list[int]:
    return c["tok"].encode(c["template"].render(messages, add_generation_prompt=True))


def verifier_idle(c) -> bool:
    async def info():
        async with grpc.aio.insecure_channel(c["v_addr"]) as ch:
            return await pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=2)
    i = asyncio.run(info())
    return i.active == 0 and i.queued == 0


MSGS = [{"role": "user", "content": "Write a function that adds two numbers."}]
N = 24


# -------------------------------------------------------------------------------------- basic API


def test_completions_match_plain_generation(cluster):
    c = cluster
    client, model = c["client"], c["model"]
    ids = c["tok"].encode("def add(a, b):")
    ref = reference(c["target"], ids, N)
    r = client.completions.create(model=model, prompt=ids, max_tokens=N)
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref["token_ids"])
    t = r.model_extra["timings"]
    assert t["draft_n"] > 0 and t["predicted_n"] == len(ref["token_ids"]) and t["prompt_n"] == len(ids)
    # Streaming, with usage, a string prompt (the gateway tokenizes it the same way).
    stream = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=N, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    assert chunks[-1].model_extra["timings"]["draft_n"] > 0
    # the drafter service's own drafting time reaches /metrics beside the steps' wait on drafting
    metrics = http("GET", f"{c['url']}/metrics")[1].decode()
    own = re.search(r"^specsplit:spec_decode_drafter_seconds_total (\S+)$", metrics, re.M)
    waited = re.search(r"^specsplit:spec_decode_draft_seconds_total (\S+)$", metrics, re.M)
    assert own and waited and float(own.group(1)) > 0 and float(waited.group(1)) > 0


def test_chat_matches_plain_generation(cluster):
    c = cluster
    client, model = c["client"], c["model"]
    ids = chat_prompt_ids(c, MSGS)
    ref = reference(c["target"], ids, N)
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=N)
    msg = r.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    if "<think>" in ref["text"] or "</think>" in ref["text"]:      # the model "thought": compare the parts
        assert (reasoning or "") in ref["text"]
    else:
        assert msg.content == ref["text"] and reasoning is None
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref["token_ids"])
    assert r.model_extra["timings"]["draft_n"] > 0
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=N, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (msg.content or "")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_logprobs_match_specsplit_generate(cluster):
    """`logprobs` through three processes (speculative, the drafter service) read by the openai client: the numbers
    `specsplit generate --logprobs` prints for plain decoding, end-of-sequence tokens left out."""
    c = cluster
    client, model, tok = c["client"], c["model"], c["tok"]
    ids = c["tok"].encode("def add(a, b):")
    ref = reference(c["target"], ids, N, ("--logprobs", "3"))
    listed = [lp for lp in ref["logprobs"] if lp["token_id"] not in tok.eos_ids]
    r = client.completions.create(model=model, prompt=ids, max_tokens=N, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.model_extra["timings"]["draft_n"] > 0
    assert lp.tokens == [tok.token_bytes(x["token_id"]).decode("utf-8", "replace") for x in listed]
    assert lp.token_logprobs == pytest.approx([x["logprob"] for x in listed], abs=2e-4)
    assert [len(t) for t in lp.top_logprobs] == [len({tok.token_bytes(i).decode("utf-8", "replace")
                                                      for i, _ in x["top"]} | {t}) for x, t in zip(listed, lp.tokens)]
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=N, logprobs=True, top_logprobs=2)
    ref = reference(c["target"], chat_prompt_ids(c, MSGS), N, ("--logprobs", "2"))
    listed = [x for x in ref["logprobs"] if x["token_id"] not in tok.eos_ids]
    content = r.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [tok.token_bytes(x["token_id"]) for x in listed]
    assert [e.logprob for e in content] == pytest.approx([x["logprob"] for x in listed], abs=2e-4)
    for e, x in zip(content, listed):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in x["top"]], abs=2e-4)
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=N, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [e for ch in stream for cc in ch.choices if cc.logprobs for e in cc.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_echo_scores_the_prompt_like_specsplit_generate(cluster):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, token ids) through the three processes: the
    prompt's log-probabilities `specsplit generate --prompt-logprobs` prints; max_tokens 0 scores it alone."""
    c = cluster
    client, model, tok = c["client"], c["model"], c["tok"]
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)     # past one 64-token chunk
    assert len(ids) > 64
    ref = reference(c["target"], ids, 1, ("--logprobs", "1", "--prompt-logprobs", "1"))
    r = client.completions.create(model=model, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[1:-1] == pytest.approx([x["logprob"] for x in ref["prompt_logprobs"]], abs=2e-4)
    assert lp.token_logprobs[-1] == pytest.approx(ref["logprobs"][0]["logprob"], abs=2e-4)
    assert r.choices[0].text.startswith(tok.decode(ids))
    r = client.completions.create(model=model, prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert r.choices[0].text == tok.decode(ids) and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=2e-4)


def test_n_choices_through_the_openai_client(cluster):
    """n = 2 through the three processes: choice i is the request with seed + i, and the client reads both."""
    c = cluster
    client, model = c["client"], c["model"]
    kw = dict(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0.9)
    r = client.completions.create(n=2, seed=5, **kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    singles = [client.completions.create(seed=5 + i, **kw).choices[0].text for i in range(2)]
    assert [ch.text for ch in r.choices] == singles
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, n=2, stream=True,
                                            temperature=0.9, seed=3)
    seen = {cc.index for ch in stream for cc in ch.choices}
    assert seen == {0, 1}


def test_anthropic_messages_match_plain_generation(cluster):
    """The Anthropic Messages API through the three processes, read by the `anthropic` client: the text plain
    decoding of the same rendered chat gives, streamed and not."""
    import anthropic

    c = cluster
    ids = c["tok"].encode(c["template"].render(MSGS, add_generation_prompt=True, enable_thinking=False))
    ref = reference(c["target"], ids, N)
    client = anthropic.Anthropic(base_url=c["url"], api_key="none", max_retries=0, timeout=60)
    r = client.messages.create(model=c["model"], max_tokens=N, messages=MSGS)
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == ref["text"] and r.usage.input_tokens == len(ids)
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref["finish_reason"]]
    with client.messages.stream(model=c["model"], max_tokens=N, messages=MSGS) as stream:
        assert "".join(stream.text_stream) == text


def test_responses_api_matches_plain_generation(cluster):
    """The Responses API through the three processes, read by the openai client: plain decoding's text."""
    c = cluster
    ids = chat_prompt_ids(c, MSGS)
    ref = reference(c["target"], ids, N)
    r = c["client"].responses.create(model=c["model"], input=MSGS[0]["content"], max_output_tokens=N)
    assert r.output_text == ref["text"] and r.usage.input_tokens == len(ids)
    assert r.status == {"length": "incomplete", "stop": "completed"}[ref["finish_reason"]]


def test_penalties_reach_the_verifier(cluster):
    """OpenAI presence_penalty and the vLLM / llama.cpp extensions travel to the verifier; speculative decoding
    under them gives `specsplit generate`'s plain tokens; an out-of-range value is a 400 naming the field."""
    c = cluster
    client, model = c["client"], c["model"]
    ids = c["tok"].encode("def add(a, b):")
    ref = reference(c["target"], ids, N, ("--repeat-penalty", "1.8", "--presence-penalty", "0.5",
                                          "--repeat-last-n", "-1"))
    assert ref["token_ids"] != reference(c["target"], ids, N)["token_ids"], "the penalties must matter here"
    r = client.completions.create(model=model, prompt=ids, max_tokens=N, presence_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.8, "repeat_last_n": -1})
    assert r.choices[0].text == ref["text"]
    assert r.model_extra["timings"]["draft_n"] > 0
    for bad, field in (({"frequency_penalty": 2.5}, "frequency_penalty"),
                       ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
                       ({"extra_body": {"repeat_last_n": -5}}, "repeat_last_n")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=ids, max_tokens=4, **bad)
        assert field in str(e.value)


def test_bad_requests_and_server_keeps_serving(cluster):
    c = cluster
    client, model = c["client"], c["model"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MSGS, n=17)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 4000, max_tokens=2)
    assert e.value.body["type"] == "exceed_context_size_error"
    status, body = http("POST", f"{c['url']}/v1/chat/completions", b"{nope")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=model, messages=MSGS, max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_frees_the_slot(cluster):
    c = cluster
    client, model = c["client"], c["model"]
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()
    wait_until(lambda: verifier_idle(c), "verifier slot freed after disconnect", c["procs"], timeout=30)
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_fifty_concurrent_requests_complete_or_429(cluster):
    c = cluster

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{c['url']}/v1", api_key="none", max_retries=0, timeout=90)

        async def one(i: int):
            try:
                r = await client.completions.create(model=c["model"], prompt=f"Hello {i}", max_tokens=4)
                return "ok" if 1 <= r.usage.completion_tokens <= 4 else f"bad usage {r.usage}"
            except openai.RateLimitError:
                return "429"
            except Exception as e:       # noqa: BLE001 - reported in the assertion below
                return repr(e)

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 180)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert set(results) <= {"ok", "429"}, results
    assert results.count("ok") >= SLOTS and results.count("429") > 0
    wait_until(lambda: verifier_idle(c), "verifier idle after the burst", c["procs"], timeout=30)
    r = c["client"].completions.create(model=c["model"], prompt="Hello", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 2


# ------------------------------------------------------------------------------------------ traces


def _spans(path: Path) -> list[dict]:
    """Span objects printed by ConsoleSpanExporter (pretty JSON, one after the other) in a stdout file."""
    text = path.read_text(errors="replace") if path.exists() else ""
    dec, spans, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict) and "context" in obj and "name" in obj:
            spans.append(obj)
        i = end
    return spans


def test_one_trace_spans_gateway_verifier_and_drafter(cluster):
    c = cluster
    r = c["client"].chat.completions.create(model=c["model"], messages=MSGS, max_tokens=N)
    steps = r.model_extra["timings"]["draft_steps"]
    assert steps > 0

    def collect():
        gw = [s for s in _spans(c["gateway"].out) if s["attributes"].get("gen_ai.response.id") == r.id]
        if not gw:
            return None
        tid = gw[0]["context"]["trace_id"]
        by_proc = {name: [s for s in _spans(c[name].out) if s["context"]["trace_id"] == tid]
                   for name in ("gateway", "verifier", "drafter")}
        names = [s["name"] for s in by_proc["verifier"]]
        done = "verifier.generate" in names and any(s["name"] == "drafter.session" for s in by_proc["drafter"])
        return (gw[0], by_proc) if done else None

    req, by_proc = wait_until(collect, "spans of the request in all three processes", c["procs"], timeout=30)
    assert req["name"] == f"chat {c['model']}" and req["kind"] == "SpanKind.SERVER"
    assert req["attributes"]["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert req["attributes"]["spec.draft_tokens"] == r.model_extra["timings"]["draft_n"]
    ver = {s["name"]: s for s in by_proc["verifier"]}
    assert ver["verifier.generate"]["parent_id"] == req["context"]["span_id"]
    counts = {n: sum(s["name"] == n for s in by_proc["verifier"]) for n in ("spec.draft", "spec.verify", "spec.accept")}
    assert counts == {"spec.draft": steps, "spec.verify": steps, "spec.accept": steps}
    assert ver["verifier.generate"]["attributes"]["spec.steps"] == steps
    drafts = [s for s in by_proc["drafter"] if s["name"] == "drafter.draft"]
    assert len(drafts) >= steps
    assert {s["resource"]["attributes"]["service.name"] for p in by_proc.values() for s in p} >= {
        "specsplit-gateway", "specsplit-verifier", "specsplit-drafter"}


def test_healthcheck_module(cluster):
    from services.healthcheck import main

    assert main([cluster["v_addr"], "specsplit.v1.Verifier"]) == 0
    assert main([cluster["d_addr"], "specsplit.v1.Drafter"]) == 0
    assert main([cluster["v_addr"]]) == 0                       # liveness
    assert main([cluster["v_addr"], "no.such.Service", "--timeout", "2"]) == 1
    assert main(["unix:///nonexistent/specsplit.sock", "--timeout", "1"]) == 1


# ------------------------------------------------------------------------------- drafter failure


def test_killing_the_drafter_mid_request_still_completes(cluster):
    """Runs last: it kills the drafter (restarted afterwards for any later test)."""
    c = cluster
    client, model, d = c["client"], c["model"], c["drafter"]
    n = 200
    ids = c["tok"].encode("for i in range(10):")
    ref = reference(c["target"], ids, n)
    try:
        stream = client.completions.create(model=model, prompt=ids, max_tokens=n, stream=True,
                                           stream_options={"include_usage": True})
        it = iter(stream)
        first = next(it)
        d.kill()
        chunks = [first, *it]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == ref["text"]
        assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
        # The next request goes on without a drafter (plain decoding), and the metrics say so.
        r = client.completions.create(model=model, prompt=ids, max_tokens=8)
        assert r.usage.completion_tokens == 8
        metrics = http("GET", f"{c['url']}/metrics")[1].decode()
        fallbacks = re.search(r"^specsplit:spec_decode_fallbacks_total (\S+)$", metrics, re.M)
        assert fallbacks and float(fallbacks.group(1)) >= 1
    finally:
        if not d.alive():
            d.start()
            wait_drafter(d, c["d_addr"])


# --------------------------------------------------------------------------------- all in one


def test_serve_runs_all_three_in_one_process(tiny_pair, tmp_path):
    _, target, drafter = tiny_pair
    p = Proc("serve", ["serve", "--model", target, "--draft", drafter, "--host", "127.0.0.1", "--port", "0",
                       "--trace", "console"], tmp_path)
    try:
        url = wait_until(lambda: (m := re.search(r"gateway on (http://\S+)", p.logs())) and m.group(1),
                         "serve listening", [p])
        wait_until(lambda: _health(url) == 200, "serve /health 200", [p])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8)
        assert r.usage.completion_tokens >= 1 and r.model_extra["timings"]["draft_n"] > 0

        def spans():
            got = _spans(p.out)
            req = [s for s in got if s["attributes"].get("gen_ai.response.id") == r.id]
            if not req:
                return None
            tid = req[0]["context"]["trace_id"]
            names = {s["name"] for s in got if s["context"]["trace_id"] == tid}
            return names if {"verifier.generate", "spec.verify"} <= names else None

        assert f"chat {model}" in wait_until(spans, "one trace in the one process", [p], timeout=30)
    finally:
        p.stop()
    assert p.popen.returncode == 0, p.logs()


def test_serve_without_model_serves_the_embedded_pair(tmp_path):
    """The README's first try: `specsplit serve` with no model flags speculates with the shipped pair."""
    p = Proc("serve-default", ["serve", "--host", "127.0.0.1", "--port", "0"], tmp_path)
    try:
        url = wait_until(lambda: (m := re.search(r"gateway on (http://\S+)", p.logs())) and m.group(1),
                         "serve listening", [p])
        wait_until(lambda: _health(url) == 200, "serve /health 200", [p])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["specsplit-code-tiny"]
        r = client.completions.create(model="specsplit-code-tiny", prompt="def add(a, b):\n", max_tokens=24)
        assert r.usage.completion_tokens >= 1
        assert r.model_extra["timings"]["draft_n"] > 0
        # the embedded target declares a repetition penalty (GGUF general.sampling.*): a request that sets none
        # gets it, as `specsplit generate` does; an explicit 1 turns it off
        from services.engine.default_model import default_model_paths

        ids = load_tokenizer_source(default_model_paths()[0]).tokenizer.encode("def fibonacci(n):\n")
        declared, off = reference(None, ids, 32), reference(None, ids, 32, ("--repeat-penalty", "1"))
        assert declared["token_ids"] != off["token_ids"]
        r = client.completions.create(model="specsplit-code-tiny", prompt=ids, max_tokens=32)
        assert r.choices[0].text == declared["text"] and r.model_extra["timings"]["draft_n"] > 0
        r = client.completions.create(model="specsplit-code-tiny", prompt=ids, max_tokens=32,
                                      extra_body={"repetition_penalty": 1})
        assert r.choices[0].text == off["text"]
    finally:
        p.stop()
