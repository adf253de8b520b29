"""The OpenAI-compatible server (alchemist.serve.app) over a fake scheduler on the numpy toy engine: the official
openai client streams, bad input gets OpenAI-shaped errors and the server keeps answering, a client that leaves
cancels its request, a full queue answers 429, /metrics parses. The SIGTERM drain test runs `alchemist serve` with
the real scheduler and slot engine (skipped where those modules are not there)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import uvicorn

from alchemist.serve.app import create_app
from serving_fake import FakeRequest, FakeScheduler
from serving_toy import ToySlotEngine

pytestmark = pytest.mark.filterwarnings("ignore::alchemist.tokenizer.chat.ChatTemplateWarning")  # fixtures: no template

MODEL = "toy-llama"
CONTEXT = 96


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf):
    from alchemist.tokenizer import load_tokenizer

    return load_tokenizer(tiny_gguf("llama"))


@contextlib.contextmanager
def running(app):
    """uvicorn in a thread on a port-0 socket; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()


def make(tokenizer, app_options=None, **kw):
    """A fake scheduler over the toy engine (`kw`: its options) and the app over it (`app_options`: create_app's)."""
    step_delay = kw.pop("step_delay", 0.0)
    engine = ToySlotEngine(tokenizer.vocab_size, n_slots=4, capacity=CONTEXT, chunk=4)
    sched = FakeScheduler(engine, tokenizer, step_delay=step_delay, **kw)
    return sched, create_app(sched, tokenizer, MODEL, request_cls=FakeRequest, drain_s=3.0, **(app_options or {}))


@pytest.fixture(scope="module")
def server(tokenizer):
    sched, app = make(tokenizer)
    with running(app) as url:
        yield sched, app, url
    assert sched.stopped_with == 3.0  # the lifespan stopped the scheduler with drain_s


def metrics(url: str) -> dict:
    """/metrics as {name or name{le="..."}: value}; asserts every line is well-formed Prometheus text."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) alchemist_\w+ .+", line), line
            continue
        m = re.fullmatch(r'(alchemist_\w+)(\{le="[^"]+"\})? ([0-9.e+-]+)', line)
        assert m, line
        values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def sse_chunks(text: str) -> list:
    """The JSON chunks of an SSE body; asserts the framing and the final [DONE]."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


# ---------------------------------------------------------------------------------------------- happy paths
def test_openai_client_streams_chat_and_completion(server):
    openai = pytest.importorskip("openai")
    sched, app, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]

    # what the official client sends when asked for the neutral values: accepted
    common = dict(model=MODEL, temperature=0, max_tokens=12, n=1, user="u1", presence_penalty=0, frequency_penalty=0)
    stream = client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                            **common)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    whole = client.chat.completions.create(messages=messages, **common)
    assert whole.choices[0].message.content == text  # greedy: streamed == whole
    assert [whole.choices[0].finish_reason] == finishes
    assert whole.usage.completion_tokens == usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 12
    # the prompt the server used is the tokenizer's chat rendering (no template: contents joined by newlines)
    assert usage.prompt_tokens == len(app.state.scheduler.tokenizer.encode_chat(messages))

    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert whole.choices[0].text == text
    assert whole.object == "text_completion" and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(sched.tokenizer.encode("Once upon a time"))


def test_sampling_params_and_stop_reach_the_scheduler(server):
    sched, app, url = server
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 20, "temperature": 0.7, "top_p": 0.9, "seed": 7}
    r1 = httpx.post(url + "/v1/completions", json=body).json()
    r2 = httpx.post(url + "/v1/completions", json=body).json()
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"]  # same seed, same draw
    base = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    assert len(base) >= 4, base
    stop = base[2:4]
    r = httpx.post(url + "/v1/completions", json={**body, "temperature": 0, "stop": [stop, "\x00never"]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == base[: base.find(stop)]
    assert sched.last_request.stop == [stop, "\x00never"] and not sched.last_request.ignore_eos
    assert httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}).status_code == 200
    assert sched.last_request.ignore_eos and sched.last_request.params.seed == 7


def test_logprobs_shapes(server):
    sched, app, url = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0,
                                                 "logprobs": 3}).json()  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    # offsets count from the prompt's start: the first token follows the prompt's 3 characters
    assert lp["text_offset"] == [3 + sum(map(len, lp["tokens"][:i])) for i in range(n)]
    ids = sched.tokenizer.encode("abc")
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "logprobs": 1}).json()
    assert r["choices"][0]["logprobs"]["text_offset"][0] == len(sched.tokenizer.decode(ids))
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0 and len(top) <= 3 and abs(max(top.values()) - chosen) < 1e-6  # greedy: chosen is best
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                   "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()  # fmt: skip
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} and len(c["top_logprobs"]) == 2 for c in content)


# ---------------------------------------------------------------------------------------------- errors
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}

BAD = [
    ("malformed JSON", CHAT, b'{"model": "toy-llama", "messages": [', 400, None, None),
    ("non-UTF-8 body", CHAT, b'{"model": "toy-llama\xff\xfe", "messages": []}', 400, None, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None, None),
    ("unknown field", CHAT, {**GOOD, "frobnicate": 1}, 400, None, "frobnicate"),
    ("missing messages", CHAT, {"model": MODEL}, 400, None, "messages"),
    ("bad role", CHAT, {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, None, "messages"),
    ("n over 8", CHAT, {**GOOD, "n": 9}, 400, None, "n"),
    ("n times prompts over 32", COMP, {"prompt": ["a"] * 5, "n": 8}, 400, None, "n"),
    ("penalty", CHAT, {**GOOD, "presence_penalty": 0.5}, 400, None, "presence_penalty"),
    ("temperature < 0", CHAT, {**GOOD, "temperature": -1}, 400, None, "temperature"),
    ("max_tokens 0", CHAT, {**GOOD, "max_tokens": 0}, 400, None, "max_tokens"),
    ("unknown model", CHAT, {**GOOD, "model": "gpt-5"}, 404, "model_not_found", "model"),
    ("max_tokens over the context", CHAT, {**GOOD, "max_tokens": CONTEXT}, 400, "context_length_exceeded", None),
    ("prompt over the context", COMP, {"model": MODEL, "prompt": [5] * (CONTEXT + 1)}, 400, "context_length_exceeded", None),
    ("token id out of range", COMP, {"model": MODEL, "prompt": [5, 99999]}, 400, None, "prompt"),
    ("too many prompts", COMP, {"model": MODEL, "prompt": ["a"] * 33}, 400, None, "prompt"),
    ("empty prompt list", COMP, {"model": MODEL, "prompt": []}, 400, None, "prompt"),
    ("a later prompt over the context", COMP, {"prompt": [[5], [5] * (CONTEXT + 1)]}, 400, "context_length_exceeded", None),
    ("scoring on a scheduler without it", COMP, {"prompt": "a", "echo": True, "logprobs": 1}, 400, None, "echo"),
    ("nested too deeply", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None, None),
]  # fmt: skip


@pytest.mark.parametrize("name,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_keeps_answering(server, name, path, body, status, code, param):
    sched, app, url = server
    if isinstance(body, bytes):
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status == 400 else err["type"])
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(url + CHAT, json=GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_unknown_route_is_openai_shaped_404(server):
    r = httpx.get(server[2] + "/v1/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------- lifecycle
def test_disconnect_mid_stream_cancels(tokenizer):
    sched, app = make(tokenizer, step_delay=0.02)
    with running(app) as url:
        body = {**GOOD, "max_tokens": 60, "stream": True}
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", url + CHAT, json=body) as r:
                assert r.status_code == 200
                got = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(json.loads(line[6:]))
                    if len(got) >= 4:
                        break
            rid = got[0]["id"].removeprefix("chatcmpl-")
        deadline = time.monotonic() + 5
        while not (rid in sched.cancelled_ids and sched.stats.active_slots == 0):
            assert time.monotonic() < deadline, (sched.cancelled_ids, sched.stats.active_slots)
            time.sleep(0.02)
        assert sched.stats.generated_tokens_total < 60  # it stopped early
        assert httpx.post(url + CHAT, json=GOOD).status_code == 200


def test_disconnect_before_a_whole_answer_cancels(tokenizer):
    """A non-streamed request whose client gives up (its timeout) is cancelled: its slot frees and generation stops."""
    sched, app = make(tokenizer, step_delay=0.02)
    with running(app) as url:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + CHAT, json={**GOOD, "max_tokens": 80, "ignore_eos": True}, timeout=0.3)
        deadline = time.monotonic() + 5
        while not (sched.cancelled_ids and sched.stats.active_slots == 0):
            assert time.monotonic() < deadline, (sched.cancelled_ids, sched.stats.active_slots)
            time.sleep(0.02)
        assert sched.stats.generated_tokens_total < 80  # it stopped early
        assert httpx.post(url + CHAT, json=GOOD).status_code == 200


def test_429_when_queue_full_then_recovers(tokenizer):
    sched, app = make(tokenizer, max_queue=1)
    with running(app) as url:
        sched.gate.clear()  # pause the loop: the queue fills
        time.sleep(0.1)
        first = {}
        th = threading.Thread(target=lambda: first.update(r=httpx.post(url + CHAT, json=GOOD, timeout=20)))
        th.start()
        deadline = time.monotonic() + 5
        while sched.queue.qsize() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(url + CHAT, json=GOOD)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        sched.gate.set()
        th.join(20)
        assert first["r"].status_code == 200
        assert httpx.post(url + CHAT, json=GOOD).status_code == 200


def test_health_and_metrics(server):
    sched, app, url = server
    assert httpx.post(url + COMP, json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0}).is_success
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    app.state.draining = True
    try:
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + CHAT, json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    finally:
        app.state.draining = False
    sched.stats.warming = True
    try:
        assert httpx.get(url + "/health").json() == {"status": "warming"}
    finally:
        sched.stats.warming = False

    values = metrics(url)
    assert values["alchemist_generated_tokens_total"] == sched.stats.generated_tokens_total > 0
    assert values["alchemist_queue_depth"] == 0 and values["alchemist_slots"] == 4
    assert values["alchemist_tokens_per_second"] > 0 and values["alchemist_kv_cache_usage_ratio"] == 0
    n = values["alchemist_time_to_first_token_seconds_count"]  # from a histogram object (the scheduler's kind)
    assert n == sched.stats.ttft_seconds.count > 0
    assert values['alchemist_time_to_first_token_seconds_bucket{le="+Inf"}'] == n
    n = values["alchemist_inter_token_latency_seconds_count"]  # from a plain list of seconds
    assert n == len(sched.stats.itl_seconds) > 0
    assert values['alchemist_inter_token_latency_seconds_bucket{le="+Inf"}'] == n
    assert values['alchemist_inter_token_latency_seconds_bucket{le="60"}'] == n


# ---------------------------------------------------------------------------------------------- the real scheduler
def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _importable("alchemist.serve.scheduler"), reason="needs alchemist.serve.scheduler")
def test_real_scheduler_over_toy_engine(tokenizer):
    """The app with alchemist.serve.scheduler.Scheduler (its own Request, events, QueueFull and histograms)."""
    openai = pytest.importorskip("openai")
    from alchemist.serve.scheduler import Scheduler

    sched = Scheduler(ToySlotEngine(tokenizer.vocab_size, n_slots=4, capacity=CONTEXT, chunk=4), tokenizer, max_queue=8)
    app = create_app(sched, tokenizer, MODEL, drain_s=3.0)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompts = [f"prompt number {i} says hello" for i in range(6)]
        solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in prompts]  # fmt: skip
        batched = [None] * len(prompts)

        def stream(i: int) -> None:
            chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0,
                                               stream=True)  # fmt: skip
            batched[i] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert batched == solo  # 6 concurrent streams over 4 slots: the same greedy texts as one at a time

        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                      max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert chunks[-1].usage.completion_tokens >= 1
        r = httpx.post(url + CHAT, json={**GOOD, "max_tokens": CONTEXT})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.post(url + CHAT, json={**GOOD, "ignore_eos": True}).status_code == 200

        with httpx.stream("POST", url + CHAT, json={**GOOD, "max_tokens": 80, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 5
        while sched.stats.active_slots:
            assert time.monotonic() < deadline, "the disconnected stream still holds a slot"
            time.sleep(0.02)

        values = metrics(url)
        assert values["alchemist_generated_tokens_total"] == sched.stats.generated_tokens_total > 6 * 12
        assert values["alchemist_time_to_first_token_seconds_count"] == sched.stats.ttft_seconds.count >= 8
    assert not sched.stats.running  # the lifespan stopped it


@pytest.mark.skipif(not _importable("alchemist.serve.scheduler"), reason="needs alchemist.serve.scheduler")
def test_extreme_sampling_values_answer_greedily_beside_a_running_stream(tokenizer):
    """Temperatures and penalties at the edge of float64 while another stream runs: each answers with the greedy
    text (the limit a vanishing temperature approaches), and the stream beside them finishes untouched."""
    from alchemist.serve.scheduler import Scheduler

    sched = Scheduler(ToySlotEngine(tokenizer.vocab_size, n_slots=4, capacity=CONTEXT, chunk=4), tokenizer)
    app = create_app(sched, tokenizer, MODEL, drain_s=3.0)
    body = {"model": MODEL, "prompt": "the extreme values", "max_tokens": 10}
    with running(app) as url:
        greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 60, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            for extreme in ({"temperature": 1e-320, "top_k": 40}, {"temperature": 1e-300, "top_p": 0.5},
                            {"temperature": 1e-40}, {"temperature": 1e-320, "repetition_penalty": 1e-320}):  # fmt: skip
                r = httpx.post(url + "/v1/completions", json={**body, **extreme})
                assert r.status_code == 200, r.text
                if "repetition_penalty" not in extreme:
                    assert r.json()["choices"][0]["text"] == greedy, extreme
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(" ", "")


@pytest.fixture(scope="module")
def scoring_server(tokenizer):
    """The app over alchemist.serve.scheduler.Scheduler (which scores prompts) on the toy engine."""
    from alchemist.serve.scheduler import Scheduler

    sched = Scheduler(ToySlotEngine(tokenizer.vocab_size, n_slots=4, capacity=CONTEXT, chunk=4), tokenizer)
    with running(create_app(sched, tokenizer, MODEL, drain_s=3.0)) as url:
        yield sched, url


def test_echo_with_logprobs_scores_the_prompt_in_the_legacy_format(scoring_server, tokenizer):
    """echo + logprobs (lm-evaluation-harness's log-likelihood request): the prompt's tokens come first, the first
    with a null logprob and null alternatives, each other's logprob the scheduler's prompt score; max_tokens 0
    scores only; text_offset counts characters from the prompt's start; the official client reads it."""
    from alchemist.serve.scheduler import Request

    sched, url = scoring_server
    ids = tokenizer.encode("the quick brown fox jumps over")
    want = sched.generate(Request(list(ids), max_tokens=1, prompt_logprobs=2, logprobs=2))
    r = httpx.post(url + COMP, json={"prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx([x for x, _ in want.prompt_logprobs[1:]], abs=1e-6)
    assert lp["token_logprobs"][n] == pytest.approx(want.logprobs[0][0], abs=1e-6)
    assert all(len(top) <= 2 and max(top.values()) >= x for top, x in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    prompt_text = tokenizer.decode(ids)
    assert choice["text"] == prompt_text + want.text and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][n] == len(prompt_text)
    assert "".join(lp["tokens"][:n]) == prompt_text
    only = httpx.post(url + COMP, json={"prompt": [ids], "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    assert only["choices"][0]["text"] == prompt_text and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model=MODEL, prompt="the quick brown fox jumps over", echo=True, logprobs=1,
                                  max_tokens=0)  # fmt: skip
    assert c.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-6)


def test_a_list_of_prompts_answers_a_choice_each_in_order(scoring_server, tokenizer):
    """Prompts as a list of strings or of token-id lists: each its own choice, `index` in order, each what it gets
    alone; streamed, every chunk names its choice and each choice ends with its finish_reason; echo puts each
    prompt before its text."""
    sched, url = scoring_server
    texts = ["first of three", "the second one is longer than that", "3"]
    body = {"max_tokens": 6, "temperature": 0}
    alone = [httpx.post(url + COMP, json={**body, "prompt": t}).json()["choices"][0]["text"] for t in texts]
    assert len(set(alone)) > 1
    r = httpx.post(url + COMP, json={**body, "prompt": texts}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and [c["text"] for c in r["choices"]] == alone
    ids = [tokenizer.encode(t) for t in texts]
    echoed = httpx.post(url + COMP, json={**body, "prompt": ids, "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == [tokenizer.decode(i) + a for i, a in zip(ids, alone)]
    assert echoed["usage"]["prompt_tokens"] == sum(map(len, ids))
    streamed = {i: "" for i in range(3)}
    finished = set()
    r = httpx.post(url + COMP, json={**body, "prompt": texts, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_chunks(r.text)
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert choice["index"] not in finished
        streamed[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1, 2} and [streamed[i] for i in range(3)] == alone
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18


def test_n_choices_are_sampled_apart_and_share_the_prefill(scoring_server):
    """n = 3: choice j is what seed + j draws alone, its index j; the prompt is prefilled once (the other two copy
    its rows: cached tokens); streamed, each choice opens with its role and ends with its finish_reason."""
    sched, url = scoring_server
    messages = [{"role": "user", "content": "tell me three different things about the sea, please"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0.9, "seed": 5}
    alone = [httpx.post(url + CHAT, json={**body, "seed": 5 + j}).json()["choices"][0]["message"]["content"]
             for j in range(3)]  # fmt: skip
    assert len(set(alone)) > 1
    r = httpx.post(url + CHAT, json={**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in r["choices"]] == alone
    n_prompt = r["usage"]["prompt_tokens"] // 3
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * (n_prompt - 4)
    chunks = sse_chunks(httpx.post(url + CHAT, json={**body, "n": 3, "stream": True}).text)
    texts, ends = {j: "" for j in range(3)}, {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            ends[choice["index"]] = choice["finish_reason"]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:3]] == ["assistant"] * 3
    assert [texts[j] for j in range(3)] == alone and set(ends) == {0, 1, 2}
    comp = httpx.post(url + COMP, json={"prompt": ["one", "two"], "n": 2, "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2, 3]
    assert comp["choices"][0]["text"] == comp["choices"][1]["text"] and comp["choices"][2]["text"] == comp["choices"][3]["text"]


# ---------------------------------------------------------------------------------------------- `alchemist serve`
FAKE_SERVE = """
import sys
sys.path.insert(0, {tests!r})
from serving_fake import FakeRequest, FakeScheduler
from serving_toy import ToySlotEngine
from alchemist.serve.cli import build_server
from alchemist.tokenizer import load_tokenizer

tok = load_tokenizer({path!r})
sched = FakeScheduler(ToySlotEngine(tok.vocab_size, n_slots=2, capacity=128, chunk=4), tok, step_delay=0.03)
build_server({path!r}, scheduler=sched, tokenizer=tok, request_cls=FakeRequest, port=0, drain=20).run()
print("scheduler stopped with drain_s", sched.stopped_with, flush=True)
"""


def _sigterm_mid_stream(cmd, model_id, startup_s):
    """Start a server process, stream a completion, SIGTERM it after the first chunk; the stream must finish whole
    and the process exit 0. Returns the process's stdout."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + startup_s
        while url is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
            assert time.monotonic() < deadline, "".join(lines)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        body = {"model": model_id, "prompt": "Hello", "max_tokens": 40, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        n_chunks, finish, usage = 0, None, None
        with httpx.stream("POST", url + COMP, json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                n_chunks += 1
                if n_chunks == 1:
                    proc.send_signal(signal.SIGTERM)
                if chunk["choices"]:
                    finish = chunk["choices"][0]["finish_reason"] or finish
                usage = chunk.get("usage") or usage
        assert finish in ("length", "stop") and n_chunks > 2, (finish, n_chunks)
        assert usage is not None and (finish == "stop" or usage["completion_tokens"] == 40), usage
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines)
        assert any("SIGTERM: draining" in x for x in lines), "".join(lines)
        with pytest.raises(httpx.ConnectError):  # the listening socket is closed
            httpx.get(url + "/health", timeout=2)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_in_flight_stream_fake_scheduler(tiny_gguf):
    """build_server + ServerHandle.run (what `alchemist serve` runs) with the fake scheduler injected."""
    path = str(tiny_gguf("llama"))
    script = FAKE_SERVE.format(tests=str(Path(__file__).parent), path=path)
    out = _sigterm_mid_stream([sys.executable, "-c", script], Path(path).stem, startup_s=60)
    assert "scheduler stopped with drain_s 20" in out  # the lifespan stopped the scheduler with --drain


@pytest.mark.slow
@pytest.mark.skipif(
    not (_importable("alchemist.serve.scheduler") and _importable("alchemist.runtime.slot_engine")),
    reason="needs alchemist.serve.scheduler and alchemist.runtime.slot_engine",
)
def test_sigterm_drains_in_flight_stream(tiny_gguf):
    """`alchemist serve` on a fixture with the real slot engine and scheduler (a cold graph cache compiles)."""
    path = str(tiny_gguf("llama"))
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", path, "--port", "0", "--slots", "2", "--context", "128",
           "--chunk", "8", "--drain", "20"]  # fmt: skip
    _sigterm_mid_stream(cmd, Path(path).stem, startup_s=900)


# ---------------------------------------------------------------------------------------------- who may ask
def test_model_may_be_left_out(server):
    """One model is served: a body without `model` (lm-eval's gguf client sends none) is answered by it."""
    body = {k: v for k, v in GOOD.items() if k != "model"}
    r = httpx.post(server[2] + CHAT, json=body)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert httpx.post(server[2] + COMP, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_refused(server, content_type):
    """A cross-site form can post text/plain without a CORS preflight: only application/json bodies are read."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(server[2] + CHAT, content=json.dumps(GOOD).encode(), headers=headers)
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", r.text
    ok = httpx.post(server[2] + CHAT, content=json.dumps(GOOD).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200


def test_a_body_over_the_limit_is_a_413_with_or_without_its_length(server):
    """8 MiB is the limit: a larger body is a 413 whether its Content-Length says so (refused before reading) or it
    streams without one (refused once 8 MiB have arrived)."""
    from alchemist.serve.app import MAX_BODY_BYTES

    big = b'{"model": "' + b"x" * MAX_BODY_BYTES + b'"}'
    headers = {"content-type": "application/json"}
    r = httpx.post(server[2] + CHAT, content=big, headers=headers)
    assert r.status_code == 413, r.text

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = httpx.post(server[2] + CHAT, content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body is over"), r.text
    assert httpx.post(server[2] + CHAT, json=GOOD).status_code == 200


@pytest.mark.parametrize("open_health", [True, False])
def test_api_key_is_required_everywhere_but_an_open_health(tokenizer, open_health):
    sched, app = make(tokenizer, {"api_key": "s3cret", "open_health": open_health})
    with running(app) as url:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
            r = httpx.post(url + CHAT, json=GOOD, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/metrics", headers=headers).status_code == 401
        key = {"authorization": "Bearer s3cret"}
        assert httpx.post(url + CHAT, json=GOOD, headers=key).status_code == 200
        assert httpx.get(url + "/v1/models", headers=key).status_code == 200
        assert httpx.get(url + "/health").status_code == (200 if open_health else 401)
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_loopback_server_answers_only_to_its_own_names(tokenizer):
    """DNS rebinding: a page on attacker.example re-points its name at 127.0.0.1; the browser then sends
    `Host: attacker.example`, which a server bound to loopback refuses (403) unless told the name."""
    from alchemist.serve.guard import allowed_hosts_for, host_name

    assert host_name("[::1]:8080") == "::1" and host_name("LocalHost:80") == "localhost" and host_name("::1") == "::1"
    assert allowed_hosts_for("0.0.0.0", None) is None and allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert allowed_hosts_for("10.0.0.5", ["api.example"]) == {"api.example"}
    sched, app = make(tokenizer, {"allowed_hosts": allowed_hosts_for("127.0.0.1", ["box.lan"])})
    with running(app) as url:
        port = url.rsplit(":", 1)[1]
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", ""):
            r = httpx.post(url + CHAT, json=GOOD, headers={"host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "box.lan"):
            assert httpx.post(url + CHAT, json=GOOD, headers={"host": host}).status_code == 200, host
        assert httpx.get(url + "/health").status_code == 200  # httpx sends the URL's own host


def test_serve_options_for_who_may_ask():
    from alchemist.cli import build_parser

    args = build_parser().parse_args(["serve", "m.gguf", "--api-key", "k", "--open-health",
                                      "--allowed-host", "a.lan", "--allowed-host", "b.lan"])  # fmt: skip
    assert (args.api_key, args.open_health, args.allowed_host) == ("k", True, ["a.lan", "b.lan"])


# ---------------------------------------------------------------------------------------------- the tokenizer
def test_tokenizer_endpoints_in_vllms_and_llamacpps_shapes(server):
    """lm-eval's remote tokenizer (vLLM's shapes) and llama.cpp's clients use the server's own tokenizer."""
    sched, app, url = server
    tok = sched.tokenizer
    text = "Once upon a time"
    r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT
    assert httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"] == tok.encode(text)  # vLLM: specials
    r = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()  # llama.cpp: no specials
    assert [p["id"] for p in r["tokens"]] == tok.encode(text, add_special_tokens=False)
    assert [p["piece"] for p in r["tokens"]] == [tok.token_to_piece(p["id"]).decode() for p in r["tokens"]]
    ids = tok.encode(text)
    r = httpx.post(url + "/detokenize", json={"tokens": ids}).json()
    assert r["prompt"] == r["content"] == tok.decode(ids)
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.id_to_token(tok.eos_id) and info["vocab_size"] == tok.vocab_size
    assert {"bos_token", "pad_token", "chat_template", "model_max_length"} <= set(info)
    for path, body, param in (("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "content": "b"}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):  # fmt: skip
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
