"""Replicas on Ray Serve (alchemist.serve.ray_serve): two replicas of a real fixture model (one process each,
each with its SlotEngine and scheduler) behind Ray's HTTP proxy on a local Ray instance.

Ray is in the `test` extra, so these run in CI; a missing Ray is an error here, not a skip."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from alchemist import inference, load_llm
from alchemist.errors import AlchemistError
from alchemist.serve.ray_serve import APP_NAME, REPLICA_HEADER, ReplicaOptions, application

pytestmark = pytest.mark.filterwarnings("ignore::alchemist.tokenizer.chat.ChatTemplateWarning")  # fixtures: no template

# 16 distinct prompts (token ids) of different lengths
PROMPTS = [[2 + i, 7, 11 + 3 * i, 5][: 2 + i % 3] + [13 + i] * (i % 4) for i in range(16)]
MAX_TOKENS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gemma3(fixture_files):
    return fixture_files("gemma3", "Q8_0")


@pytest.fixture(scope="module")
def solo_texts(gemma3, tiny_dir):
    """Each prompt's greedy answer from one-at-a-time inference on the unbatched engine (what one server gives:
    tests/test_serving_e2e.py holds batching to it)."""
    m = load_llm(gemma3, backend="c", context=128, generated_dir=tiny_dir / "ray", progress=False)
    return [m.tokenizer.decode(inference(m, ids, max_tokens=MAX_TOKENS).output_token_ids) for ids in PROMPTS]


@pytest.fixture(scope="module")
def cluster(gemma3):
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    opts = ReplicaOptions(model=str(gemma3), slots=4, context=512, chunk=4, replicas=2, cpus_per_replica=0)
    serve.run(application(opts), name=APP_NAME, route_prefix="/", blocking=False)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _stream(url: str, ids, max_tokens: int, out: dict, started: threading.Event | None = None) -> None:
    """One streamed completion: its text, replica, completion_tokens (from the usage chunk) and whether it ended
    with [DONE]; an exception is recorded, not raised. `started` is set once the response has begun."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": max_tokens > MAX_TOKENS}  # fmt: skip
    out.update(text="", done=False, tokens=None, error=None)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
            if started is not None:
                started.set()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    out["text"] += choice.get("text") or ""
    except Exception as e:  # the stream of a killed replica breaks off
        out["error"] = repr(e)
    finally:
        out["end"] = time.monotonic()
        if started is not None:
            started.set()


def test_two_replicas_answer_16_concurrent_streams_as_one_server(cluster, solo_texts):
    results = [dict() for _ in PROMPTS]
    threads = [
        threading.Thread(target=_stream, args=(cluster, ids, MAX_TOKENS, out)) for ids, out in zip(PROMPTS, results)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r["error"] is None and r["status"] == 200 and r["done"] for r in results), results
    assert [r["text"] for r in results] == solo_texts
    assert len({r["replica"] for r in results}) == 2  # Ray's router used both replicas


def test_killing_a_replica_fails_only_its_requests(cluster, solo_texts):
    """8 long streams over both replicas; once each has begun one replica's process is killed: its streams break
    off, every stream on the other replica finishes with all its tokens, and new requests are
    answered (by the survivor, or by the replica Ray starts in its place)."""
    import ray

    n, long = 8, 480
    results, started = [dict() for _ in range(n)], [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(target=_stream, args=(cluster, PROMPTS[i], long, results[i], started[i])) for i in range(n)
    ]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    assert all(r.get("status") == 200 for r in results), results
    victims = {r["replica"] for r in results if r.get("replica")}
    assert len(victims) == 2, results  # the 8 streams are spread over both replicas
    victim = sorted(victims)[0]
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    on_victim = [r for r in results if r["replica"] == victim and r["end"] > killed_at]
    survivors = [r for r in results if r["replica"] != victim]
    assert on_victim and survivors, results  # streams long enough that the kill met some mid-stream
    assert all(r["done"] and r["error"] is None and r["tokens"] == long for r in survivors), survivors
    assert not any(r["done"] or r["tokens"] == long for r in on_victim), on_victim  # cut off, not completed
    after = {}
    _stream(cluster, PROMPTS[0], MAX_TOKENS, after)
    assert after["done"] and after["text"] == solo_texts[0], after


def test_replica_options_from_the_command_line():
    """--replicas gives a fixed count; --min/--max-replicas Ray's autoscaling config; bad bounds are clear."""
    from alchemist.cli import build_parser
    from alchemist.serve.cli import _replica_options

    args = build_parser().parse_args(["serve", "m.gguf", "--replicas", "3", "--slots", "4", "--max-queue", "8"])
    opts = _replica_options(args).deployment_options()
    assert opts["num_replicas"] == 3 and opts["max_ongoing_requests"] == 12 and "autoscaling_config" not in opts
    args = build_parser().parse_args(["serve", "m.gguf", "--min-replicas", "1", "--max-replicas", "4"])
    auto = _replica_options(args).deployment_options()["autoscaling_config"]
    assert auto == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    args = build_parser().parse_args(["serve", "m.gguf", "--min-replicas", "3", "--max-replicas", "2"])
    with pytest.raises(AlchemistError, match="min-replicas <= --max-replicas"):
        _replica_options(args).deployment_options()
    with pytest.raises(AlchemistError, match="go together"):
        ReplicaOptions(model="m", min_replicas=1).deployment_options()
